"""The functional layer: workspace -> schedule -> forward -> backward.

These four calls mirror the structure of the fused kernels, so a backend
slots in behind them: the reference backend (pure PyTorch, any device, any
torch.distributed group, the oracle), the portable backend (torch_backend.py:
grouped GEMMs from torch ops, any device) and, where built, the CUDA kernels. MoKFunction and
MoKMoELayer are thin wrappers over them.

    ws = get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, device=..., dtype=...)
    schedule = build_schedule(topk_ids, ws)
    y, saved = forward(x, topk_ids, topk_weights, params, schedule, ws)
    dx, d_topk_weights, grads = backward(dy, saved, x, topk_ids, topk_weights, params, ws)

params: ExpertParams (gate_up_proj [E_l, 2I, H], down_proj [E_l, H, I], optional biases).
"""

from __future__ import annotations

import atexit
import contextlib
import functools

from dataclasses import dataclass, field

import torch

from . import distributed, reference, torch_backend, torch_ep
from .config import MoKConfig
from .mxfp8 import fake_quantize_fast

BACKENDS = ("reference", "torch", "cuda")


@dataclass(frozen=True)
class ExpertParams:
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def as_args(self):
        return self.gate_up_proj, self.down_proj, self.gate_up_bias, self.down_bias


@dataclass(eq=False)
class Workspace:
    """Per-(group, shape, backend) state reused across calls.

    The reference backend allocates per call and keeps no buffers; a kernel
    backend keeps its persistent buffers in `buffers`.
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    ep_group: object
    device: torch.device
    dtype: torch.dtype
    backend: str
    activation: str = "swiglu"
    swiglu_limit: float | None = None
    config: MoKConfig = field(default_factory=MoKConfig)
    precision: str = "bf16"
    # backend "torch": where its local experts' MLP runs: "torch", or "cuda" (the fused one-GPU kernels; the
    # layer picks it for expert parallelism the EP kernels cannot take, e.g. across hosts, on Hopper)
    local_experts: str = "torch"
    buffers: dict = field(default_factory=dict)
    ep_state: dict = field(default_factory=dict)  # an EP path's state across calls (token capacity, error flags)

    @functools.cached_property
    def ep_size(self) -> int:
        # cached: a group's size does not change, and each query costs the host ~10 us per call
        return distributed.group_size_and_rank(self.ep_group)[0]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


_WORKSPACES: dict = {}
_DEFAULT_CONFIG = MoKConfig()  # frozen: one shared instance (building one per call costs the host ~6 us)


@functools.cache  # an import statement costs the host ~1 us per call, on the path the GPU may wait for
def _cuda_backend():
    from . import cuda_backend  # imported lazily: needs the built kernels

    return cuda_backend


def get_workspace(
    *, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, ep_group=None, device=None,
    dtype: torch.dtype = torch.bfloat16, backend: str = "reference", activation: str = "swiglu",
    swiglu_limit: float | None = None, config: MoKConfig | None = None, precision: str = "bf16",
    local_experts: str = "torch",
) -> Workspace:
    """The workspace for these shapes, created once and reused. local_experts (backend "torch"): "torch", or
    "cuda" to run the local experts' MLP on the fused kernels (Workspace.local_experts)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if precision not in ("bf16", "mxfp8"):
        raise ValueError(f"precision must be 'bf16' or 'mxfp8', got {precision!r}")
    if local_experts not in ("torch", "cuda") or (local_experts == "cuda" and backend != "torch"):
        raise ValueError(f"local_experts must be 'torch', or 'cuda' with backend='torch', got {local_experts!r} "
                         f"with backend={backend!r}")
    config = config if config is not None else _DEFAULT_CONFIG
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig or None, got {type(config).__name__}")
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:<current>" are one workspace
        device = torch.device("cuda", torch.cuda.current_device())
    # id(ep_group) cannot be reused by another group while the entry exists: the workspace holds
    # the group. Entries live until release_workspaces() (a workspace may hold GPU buffers).
    key = (hidden_size, intermediate_size, num_experts, top_k, id(ep_group), str(device), dtype, backend,
           activation, swiglu_limit, config, precision, local_experts)
    ws = _WORKSPACES.get(key)
    if ws is None:
        _check_workspace_args(hidden_size, intermediate_size, num_experts, top_k, dtype, activation, swiglu_limit)
        ws = Workspace(hidden_size, intermediate_size, num_experts, top_k, ep_group, device, dtype, backend,
                       activation, swiglu_limit, config, precision, local_experts)
        if backend == "cuda":
            _cuda_backend().init_workspace(ws)
        _WORKSPACES[key] = ws
    return ws


def _check_workspace_args(hidden_size, intermediate_size, num_experts, top_k, dtype, activation, swiglu_limit):
    """get_workspace's sizes and settings (checked when a workspace is made; a cached one passed already)."""
    for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                    ("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must be at most num_experts ({num_experts})")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    check_activation(activation, swiglu_limit)


def check_activation(activation, swiglu_limit) -> None:
    """ValueError unless activation is one of reference.ACTIVATIONS and swiglu_limit None or a number > 0
    (get_workspace and mok_nn.ops.routed_experts)."""
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))
                                     or not swiglu_limit > 0):
        raise ValueError(f"swiglu_limit must be None or a number > 0, got {swiglu_limit!r}")


def release_workspaces(ep_group=None) -> int:
    """Forget cached workspaces (those of ep_group only, when given); returns how many.

    Call it before destroying a process group, or to free a workspace's buffers; the
    next forward creates a fresh one. At exit every workspace goes (below).
    """
    keys = [k for k, ws in _WORKSPACES.items() if ep_group is None or ws.ep_group is ep_group]
    for k in keys:
        del _WORKSPACES[k]
    return len(keys)


# A workspace holds its EP group. A ProcessGroup first freed during interpreter shutdown can abort the process
# (gloo's threads outlive the interpreter: "terminate called without an active exception"), so the workspaces
# go while Python is still whole.
atexit.register(release_workspaces)


def build_schedule(topk_ids: torch.Tensor, workspace: Workspace, x: torch.Tensor | None = None):
    """Which rows each rank computes, grouped by expert, from the routing. x: the tokens the next forward
    call takes (the CUDA backend may gather them in schedule order with the schedule; optional)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be an int64 [tokens, top_k] tensor, got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)} {tuple(getattr(topk_ids, 'shape', ()))}")
    if topk_ids.shape[1] != workspace.top_k:
        raise ValueError(f"topk_ids has top_k = {topk_ids.shape[1]}, the workspace {workspace.top_k}")
    if workspace.backend == "cuda":
        with on_device(topk_ids.device):
            return _cuda_backend().build_schedule(topk_ids, workspace, x)
    signature = _ep_signature(workspace, topk_ids) if workspace.ep_group is not None else None
    if workspace.backend == "torch":
        return torch_backend.build_schedule(topk_ids, workspace.num_experts, workspace.hidden_size,
                                            workspace.intermediate_size, workspace.dtype, workspace.ep_group,
                                            signature, workspace.config.schedule_capacity_multiplier,
                                            workspace.ep_state)
    return reference.build_dispatch_plan(topk_ids, workspace.num_experts, workspace.ep_group, signature)


def check_errors(workspace: Workspace | None = None, block: bool = True) -> None:
    """Raise distributed.EPError for a finished expert-parallel call that flagged an error on the device (its
    outputs are NaN): on `workspace`, or on every cached workspace. block=True waits for the calls' flags (on
    CUDA, a synchronisation with them); call it on every rank at the same point (e.g. the end of each step), so
    that all ranks raise together. The next EP call on a flagged workspace raises it too."""
    for ws in [workspace] if workspace is not None else list(_WORKSPACES.values()):
        if ws.ep_group is None:
            continue
        if ws.backend == "cuda":
            from . import cuda_ep

            cuda_ep.check_errors(ws, block)
        elif ws.backend == "torch":
            torch_ep.check_errors(ws.ep_state, block)


_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _ep_signature(ws: Workspace, topk_ids) -> dict:
    """What the ranks of an expert-parallel group must agree on, as ints (reference.build_dispatch_plan)."""
    limit = ws.swiglu_limit
    return {"num_experts": ws.num_experts, "hidden_size": ws.hidden_size, "intermediate_size": ws.intermediate_size,
            "top_k": int(topk_ids.shape[-1]), "dtype code": _DTYPE_CODES.get(ws.dtype, 0),
            "precision code": 1 if ws.precision == "mxfp8" else 0,
            "activation code": reference.ACTIVATIONS.index(ws.activation),
            "swiglu_limit x 1e6": -1 if limit is None else round(float(limit) * 1e6)}


def on_device(device: torch.device):
    """The kernels launch on the current CUDA device's current stream: make the tensors' device current where
    it is not (a layer on cuda:1 while cuda:0 is current would launch on the wrong GPU); nothing otherwise."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _check_against_workspace(x, topk_ids, params: ExpertParams, ws: Workspace) -> None:
    """The tensors' sizes against the workspace's (shapes only, no values read): a workspace made for other
    sizes would otherwise compute something else without a word (e.g. with fewer experts, ids wrap)."""
    w13 = params.gate_up_proj
    if (w13.dim() != 3 or w13.shape[0] * ws.ep_size != ws.num_experts or w13.shape[1] != 2 * ws.intermediate_size
            or w13.shape[2] != ws.hidden_size or x.shape[-1] != ws.hidden_size or topk_ids.shape[-1] != ws.top_k):
        raise ValueError(
            f"mok_nn.functional: the workspace is for hidden_size={ws.hidden_size}, intermediate_size="
            f"{ws.intermediate_size}, num_experts={ws.num_experts} over {ws.ep_size} rank(s), top_k={ws.top_k}; got x "
            f"{tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, gate_up_proj {tuple(w13.shape)} (local experts)")


def forward(x, topk_ids, topk_weights, params: ExpertParams, schedule, workspace: Workspace, needs=None):
    """Routed experts. Returns (y [T, H] in x.dtype, saved-for-backward). Expert ids must lie in [0, num_experts):
    the reference backend raises ValueError otherwise; the CUDA backend reads no values back to the host: its
    schedule kernel (at EP > 1 the publish kernel) prints an id outside that range and stops with a device-side
    trap (the CUDA context fails at the next synchronisation, as with torch's device-side index checks). The
    layer's router only gives valid ids. needs: the parameter gradients the backward will compute (as backward
    takes it; None: all): with precision="mxfp8" and frozen experts the portable backend's expert parallelism
    sends the token rows as MXFP8 bytes."""
    _check_against_workspace(x, topk_ids, params, workspace)
    if workspace.backend == "cuda":
        with on_device(x.device):
            return _cuda_backend().forward(x, topk_ids, topk_weights, params, schedule, workspace, needs)
    if workspace.backend == "torch":
        with on_device(x.device):
            return torch_backend.experts_forward(
                x, topk_ids, topk_weights, *params.as_args(), workspace.activation, workspace.swiglu_limit, schedule,
                workspace.precision, local_kernels=workspace.local_experts == "cuda", needs=needs,
            )
    return reference.experts_forward(
        x, topk_ids, topk_weights, *params.as_args(), workspace.activation, workspace.swiglu_limit, schedule,
        workspace.precision,
    )


def weight_values_along_n(w: torch.Tensor, backend: str) -> torch.Tensor:
    """The MXFP8 values of expert weights w [E_l, N, K] along N, the operand of the backward's d x / d h GEMMs with
    precision="mxfp8", computed as `backend` (a workspace's) computes them (cuda_backend.mx_weight on the CUDA path,
    fake_quantize_fast elsewhere: the same bits)."""
    if backend == "cuda":
        return _cuda_backend().mx_weight(w, -2)
    return fake_quantize_fast(w, -2)


def backward(grad_y, saved, x, topk_ids, topk_weights, params: ExpertParams, workspace: Workspace,
             grads_into=None, needs=None, consume_saved=False):
    """Returns (dx, d_topk_weights, reference.GroupedMLPGrads of the local experts). Its grad_rows (the d x of
    each expert row) are None on the CUDA path and the portable backend: they are freed once summed into dx (peak
    memory; at EP > 1 the CUDA dgrad GEMM may send them to their sources instead of keeping them,
    cuda_ep.dx_push_mode).

    grads_into: the GroupedMLPGrads of an earlier backward (an earlier macrobatch pass); this call's
    parameter gradients are added to its tensors in place (each sum rounded to their dtype) and it is returned
    with this call's row gradients. The CUDA kernels add the weight gradients in their stores.

    needs: which parameter gradients to compute, four bools in ExpertParams order (gate_up_proj, down_proj,
    gate_up_bias, down_bias), None for all; those not needed (frozen experts) come back None and their GEMMs /
    sums are not run. d x and d topk-weights do not depend on it.

    consume_saved: nothing will read saved after this call (autograd does not keep the graph), so the CUDA path
    and the portable backend may overwrite its tensors (d gate_up takes the forward's gate_up buffer). Same
    results.
    """
    if workspace.backend == "cuda":
        with on_device(x.device):
            return _cuda_backend().backward(grad_y, saved, x, topk_ids, topk_weights, params, workspace, grads_into,
                                            needs, consume_saved)
    args = (grad_y, saved, x, topk_ids, topk_weights, *params.as_args(), workspace.activation, workspace.swiglu_limit,
            workspace.precision, grads_into, needs)
    if workspace.backend == "torch":
        return torch_backend.experts_backward(*args, consume_saved=consume_saved)
    return reference.experts_backward(*args)
