"""torch.library custom ops over the routed-expert computation (one process).

Each op has a fake (meta) implementation, so torch.compile can trace through
code that calls them without running them, and the forward op has its
backward registered, so autograd works through `routed_experts`.

    y = mok_nn.ops.routed_experts(x, topk_ids, topk_weights, gate_up_proj, down_proj,
                                  gate_up_bias=None, down_bias=None, activation="swiglu", swiglu_limit=None,
                                  backend="auto", precision="bf16")

`precision` is "bf16" or "mxfp8" (every expert GEMM's operands quantised, docs/mxfp8.md).
`backend` picks who runs them: "cuda" (the CuTe DSL kernels, bf16 on sm_90a),
"torch" (the portable backend, torch_backend.py), "reference" (pure PyTorch,
the oracle), or "auto" (the kernels where they can run, else "torch"). The
backward op rebuilds the schedule from topk_ids (a pure function of the
routing) and re-gathers the rows of x instead of saving them, so only tensors
cross the op boundary.

routed_experts checks the arguments' shapes, dtypes and devices first
(check_expert_args: no values are read, so nothing waits for the GPU). Expert
ids outside [0, E): the reference backend raises ValueError; on the CUDA
backend the schedule kernel (with expert parallelism the publish kernel), which
reads every id anyway, prints each bad id it meets (in no fixed order) and stops
with a device-side trap (the launch, and with it the CUDA context, fails at the
next synchronisation, as with torch's own device-side index checks; above 512
experts, where torch ops build the schedule, torch's index check stops it):
reading the ids back to raise a Python error would be a host synchronisation
per call. The layer's router only gives valid ids.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference, torch_backend
from .autograd import autocast_off
from .functional import check_activation, on_device

BACKENDS = ("auto", "reference", "torch", "cuda")


def _cuda():
    from . import cuda_backend  # lazily: needs the kernel library only when used

    return cuda_backend


def resolve_backend(backend, x, topk_ids, gate_up_proj, down_proj, activation, label="backend") -> str:
    """'reference', 'torch' or 'cuda': "auto" takes the kernels where they can run these operands, else the
    portable backend; backend='cuda' raises where the kernels cannot run. label: the argument's name in the
    errors (the integrations' own keyword)."""
    if backend not in BACKENDS:
        raise ValueError(f"{label} must be one of {BACKENDS}, got {backend!r}")
    if backend in ("reference", "torch"):
        return backend
    why = _cuda().unavailable_reason(x, topk_ids, gate_up_proj, down_proj, activation)
    if why is None:
        return "cuda"
    if backend == "cuda":
        raise RuntimeError(f"{label}='cuda' cannot run these experts: {why}")
    return "torch"


def check_expert_args(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None,
                      activation="swiglu", swiglu_limit=None, precision="bf16") -> None:
    """Raise ValueError / TypeError naming the argument where the shapes, dtypes or devices do not fit
    y = routed_experts(x [T, H], topk_ids [T, k] int64, topk_weights [T, k], gate_up_proj [E, 2I, H],
    down_proj [E, H, I], gate_up_bias [E, 2I], down_bias [E, H]). Shapes only: no values are read (no host
    synchronisation); ids outside [0, E) raise on the reference backend and stop the CUDA schedule kernel
    (module docstring)."""
    def need(ok, msg, exc=ValueError):
        if not ok:
            raise exc(f"mok_nn.ops.routed_experts: {msg}")

    tensors = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "gate_up_proj": gate_up_proj,
               "down_proj": down_proj, "gate_up_bias": gate_up_bias, "down_bias": down_bias}
    for name, t in tensors.items():
        need(t is None and "bias" in name or isinstance(t, Tensor), f"{name} must be a tensor, got {type(t).__name__}",
             TypeError)
    check_activation(activation, swiglu_limit)
    need(x.dim() == 2, f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    need(topk_ids.dtype == torch.int64, f"topk_ids must be int64, got {topk_ids.dtype}", TypeError)
    need(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
         f"topk_ids must be [{x.shape[0]}, top_k] like x's tokens, got shape {tuple(topk_ids.shape)}")
    need(tuple(topk_weights.shape) == tuple(topk_ids.shape),
         f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    need(topk_weights.is_floating_point(), f"topk_weights must be floating point, got {topk_weights.dtype}", TypeError)
    need(gate_up_proj.dim() == 3 and down_proj.dim() == 3,
         f"gate_up_proj and down_proj must be [experts, 2I, H] and [experts, H, I], got {tuple(gate_up_proj.shape)} "
         f"and {tuple(down_proj.shape)}")
    E, two_i, H = gate_up_proj.shape
    need(two_i % 2 == 0 and tuple(down_proj.shape) == (E, H, two_i // 2),
         f"down_proj must be [{E}, {H}, {two_i // 2}] for gate_up_proj {tuple(gate_up_proj.shape)}, got "
         f"{tuple(down_proj.shape)}")
    need(x.shape[1] == H, f"x has hidden size {x.shape[1]}, the experts {H}")
    need(gate_up_bias is None or tuple(gate_up_bias.shape) == (E, two_i),
         f"gate_up_bias must be [{E}, {two_i}], got {None if gate_up_bias is None else tuple(gate_up_bias.shape)}")
    need(down_bias is None or tuple(down_bias.shape) == (E, H),
         f"down_bias must be [{E}, {H}], got {None if down_bias is None else tuple(down_bias.shape)}")
    floats = [t for t in (x, gate_up_proj, down_proj, gate_up_bias, down_bias) if t is not None]
    need(all(t.dtype == x.dtype for t in floats),
         f"x, the expert weights and biases must share one dtype, got {sorted({str(t.dtype) for t in floats})}",
         TypeError)
    need(all(t.device == x.device for t in (topk_ids, topk_weights, *floats)),
         "every tensor must be on x's device")
    need(precision in ("bf16", "mxfp8"), f"precision must be 'bf16' or 'mxfp8', got {precision!r}")
    if precision == "mxfp8":
        need(H % 32 == 0 and two_i % 64 == 0,
             f"precision='mxfp8' needs hidden and intermediate sizes that are multiples of 32, got {H} and {two_i // 2}")
        need(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
             f"precision='mxfp8' needs bfloat16, float16 or float32 tensors, got {x.dtype}", TypeError)


def _saved_rows(backend, num_tokens, top_k, num_experts) -> int:
    """Rows of the gate_up tensor kept for backward: the kernels pad each expert to a tile."""
    if backend == "cuda":
        return _cuda().schedule_capacity(num_tokens, top_k, num_experts)
    return num_tokens * top_k


@torch.library.custom_op("mok_nn::routed_experts_fwd", mutates_args=())
def routed_experts_fwd(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
    gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, swiglu_limit: Optional[float],
    backend: str, precision: str = "bf16",
) -> tuple[Tensor, Tensor]:
    """Returns (y [T, H], gate_up in the backend's row order, kept for backward)."""
    impl = {"cuda": _cuda, "torch": lambda: torch_backend}.get(backend, lambda: reference)()
    with autocast_off(x.device.type), on_device(x.device):  # the inputs' dtype, as the backward op computes
        y, saved = impl.experts_forward(
            x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
            precision=precision,
        )
    return y, saved.gate_up


@routed_experts_fwd.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
      backend, precision="bf16"):
    y = x.new_empty(x.shape)
    rows = _saved_rows(backend, topk_ids.shape[0], topk_ids.shape[1], gate_up_proj.shape[0])
    gate_up = x.new_empty(rows, gate_up_proj.shape[1])
    return y, gate_up


@torch.library.custom_op("mok_nn::routed_experts_bwd", mutates_args=())
def routed_experts_bwd(
    grad_y: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor, gate_up_proj: Tensor,
    down_proj: Tensor, gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str,
    swiglu_limit: Optional[float], backend: str, precision: str = "bf16",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx, d_topk_weights, d_gate_up_proj, d_down_proj, d_gate_up_bias, d_down_bias).

    A bias gradient is an empty tensor where the bias is None (ops cannot return None).
    """
    with on_device(x.device):
        if backend == "cuda":
            cb = _cuda()
            sched = cb.make_schedule(topk_ids, gate_up_proj.shape[0])
            saved, impl = cb.CudaSaved(sched, gate_up), cb  # (the backward gathers x's rows itself)
        elif backend == "torch":
            sched = torch_backend.build_schedule(topk_ids, gate_up_proj.shape[0], x.shape[1], down_proj.shape[2],
                                                 x.dtype)
            saved = torch_backend.TorchSaved(sched, x[sched.order // topk_ids.shape[1]], gate_up)
            impl = torch_backend
        else:
            plan = reference.build_dispatch_plan(topk_ids, gate_up_proj.shape[0], None)
            saved, impl = reference.ExpertsSaved(plan, x[plan.order // topk_ids.shape[1]], gate_up), reference
        with autocast_off(x.device.type):
            dx, d_topk, g = impl.experts_backward(
                grad_y, saved, x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                activation, swiglu_limit, precision=precision,
            )
    return dx, d_topk, g.gate_up_proj, g.down_proj, _or_empty(g.gate_up_bias, x), _or_empty(g.down_bias, x)


def _or_empty(t, like):
    return like.new_empty(0) if t is None else t


@routed_experts_bwd.register_fake
def _(grad_y, x, topk_ids, topk_weights, gate_up, gate_up_proj, down_proj, gate_up_bias, down_bias,
      activation, swiglu_limit, backend, precision="bf16"):
    # contiguous, as both backends return them (empty_like would keep a non-contiguous input's strides: the fake
    # then disagreed with the real op, and inductor asserted on the strides)
    def like(t):
        return x.new_empty(0) if t is None else t.new_empty(t.shape)

    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape), like(gate_up_proj), like(down_proj),
            like(gate_up_bias), like(down_bias))


def _setup_context(ctx, inputs, output):
    (x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
     backend, precision) = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, output[1], gate_up_proj, down_proj, gate_up_bias, down_bias)
    ctx.activation, ctx.swiglu_limit, ctx.backend, ctx.precision = activation, swiglu_limit, backend, precision


def _backward(ctx, grad_y, _grad_gate_up):
    x, topk_ids, topk_weights, gate_up, gate_up_proj, down_proj, gate_up_bias, down_bias = ctx.saved_tensors
    dx, d_topk, d13, d2, db13, db2 = routed_experts_bwd(
        grad_y.contiguous(), x, topk_ids, topk_weights, gate_up, gate_up_proj, down_proj, gate_up_bias, down_bias,
        ctx.activation, ctx.swiglu_limit, ctx.backend, ctx.precision,
    )
    db13 = db13 if gate_up_bias is not None else None
    db2 = db2 if down_bias is not None else None
    return dx, None, d_topk, d13, d2, db13, db2, None, None, None, None


routed_experts_fwd.register_autograd(_backward, setup_context=_setup_context)


def routed_experts(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None,
                   activation="swiglu", swiglu_limit=None, backend="auto", precision="bf16"):
    """y [T, H] = sum_j w_tj * expert_{ids_tj}(x_t), through the custom ops (differentiable).

    Under torch.compile(fullgraph=True) pass backend="cuda", "torch" or "reference": resolving "auto"
    loads the kernel library, which Dynamo cannot trace (it graph-breaks there otherwise).
    An explicit backend is not re-checked while compiling; the op raises at run time if the
    kernels cannot run.
    """
    check_expert_args(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
                      swiglu_limit, precision)
    if not (torch.compiler.is_compiling() and backend in ("cuda", "torch", "reference")):
        backend = resolve_backend(backend, x, topk_ids, gate_up_proj, down_proj, activation)
    return routed_experts_fwd(
        x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
        backend, precision,
    )[0]
