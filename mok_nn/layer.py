"""MoKMoELayer: a drop-in deterministic Mixture-of-Experts block.

The module owns the parameters (names are the public state-dict contract of
the project's ARCHITECTURE.md, outside this repository; README "Usage"), runs
the router in fp32 with ordinary autograd, hands the routed experts to
MoKFunction on the chosen backend, and adds the shared expert.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
from torch import nn

from . import router as routing
from . import functional, ops
from .autograd import MoKFunction, autocast_off, pass_bounds
from .config import MoKConfig
from .distributed import group_size_and_rank
from .reference import ACTIVATIONS, compute_dtype

logger = logging.getLogger("mok_nn")

BACKENDS = ("auto", "reference", "torch", "cuda")

# Fallback reasons already logged in this process: a 48-layer model says each reason once.
_LOGGED_FALLBACKS: set[str] = set()
PRECISIONS = ("bf16", "mxfp8")


class Router(nn.Module):
    """router.weight [E, H] (+ optional bias) and the selection-only correction bias buffer."""

    def __init__(self, hidden_size, num_experts, bias, use_expert_bias, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, device=device, dtype=dtype)) if bias else None
        if use_expert_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(num_experts, device=device, dtype=torch.float32)
            )
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        # Module casts (.to(dtype), .half(), ...) move the selection bias but keep it fp32: in
        # bf16 the small updates of aux-loss-free balancing would round away.
        bias = self.e_score_correction_bias
        if bias is None:
            return super()._apply(fn, recurse)
        del self._buffers["e_score_correction_bias"]
        try:
            super()._apply(fn, recurse)
        finally:
            target = fn(bias[:0])  # what fn does to an fp32 tensor of this device
            moved = fn(bias) if target.dtype == bias.dtype else bias.to(target.device)  # no rounding
            self._buffers["e_score_correction_bias"] = moved
        return self

    def forward(self, x2d: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(x2d.dtype)
        logits = x2d.to(cdt) @ self.weight.to(cdt).T
        if self.bias is not None:
            logits = logits + self.bias.to(cdt)
        return logits


class Experts(nn.Module):
    """The routed experts of this rank: gate_up_proj [E_l, 2I, H] (gate rows first), down_proj [E_l, H, I]."""

    def __init__(self, num_local_experts, hidden_size, intermediate_size, bias, device, dtype):
        super().__init__()
        shape13 = (num_local_experts, 2 * intermediate_size, hidden_size)
        shape2 = (num_local_experts, hidden_size, intermediate_size)
        self.gate_up_proj = nn.Parameter(torch.empty(shape13, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(shape2, device=device, dtype=dtype))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(shape13[:2], device=device, dtype=dtype))
            self.down_proj_bias = nn.Parameter(torch.empty(shape2[:2], device=device, dtype=dtype))
        else:
            self.gate_up_proj_bias = None
            self.down_proj_bias = None


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through."""

    def __init__(self, hidden_size, intermediate_size, device, dtype):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _require(condition: bool, message: str, exc=ValueError) -> None:
    if not condition:
        raise exc(message)


def _as_int(name: str, value, minimum: int, hint: str = "") -> int:
    """An integral number (int, numpy integer: anything with __index__, bools excluded) >= minimum, as int."""
    try:
        if isinstance(value, bool):
            raise TypeError
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int{hint}, got {value!r} ({type(value).__name__})") from None
    bound = "positive" if minimum == 1 else f">= {minimum}"
    _require(result >= minimum, f"{name} must be {bound}{hint}, got {result}")
    return result


def _as_float(name: str, value, positive: bool) -> float:
    """A finite real number (int, float, numpy scalar; bools and strings excluded) as float: > 0 where
    positive, else >= 0."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    ok = math.isfinite(result) and (result > 0 if positive else result >= 0)
    _require(ok, f"{name} must be a finite {'positive' if positive else 'non-negative'} number, got {result}")
    return result


def _as_bool(name: str, value) -> bool:
    """A bool (or numpy bool); other truthy values ("no", 1, None) are rejected, not guessed."""
    t = type(value)
    if isinstance(value, bool) or (t.__module__ == "numpy" and t.__name__ in ("bool_", "bool")):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} ({t.__name__})")


DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class MoKMoELayer(nn.Module):
    """Mixture-of-Experts block: router -> top-k routed SwiGLU experts (+ shared expert).

    x [..., H] -> y [..., H]. The function computed is written out in reference.py (the project's
    ARCHITECTURE.md, outside this repository, is its contract, with the determinism rules).
    Beyond the documented arguments:
    router_bias: a bias on the router logits (GPT-OSS).
    aux_loss_coef / z_loss_coef: coefficients of the Switch load-balancing loss
        and the router z-loss; `layer.aux_loss` is None while both are 0.
    With `ep_group` of size P, router gradients are those of this rank's
    tokens (reduce them like any data-parallel gradient); expert gradients
    are complete for the local experts.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        use_expert_bias: bool = False,
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        expert_proj_bias: bool = False,
        activation: str = "swiglu",
        swiglu_limit: float | None = None,
        ep_group=None,
        config: MoKConfig | None = None,
        precision: str = "bf16",
        backend: str = "auto",
        device=None,
        dtype: torch.dtype = torch.bfloat16,
        router_bias: bool = False,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
    ):
        super().__init__()
        hidden_size = _as_int("hidden_size", hidden_size, 1)
        intermediate_size = _as_int("intermediate_size", intermediate_size, 1)
        num_experts = _as_int("num_experts", num_experts, 1)
        top_k = _as_int("top_k", top_k, 1)
        shared_intermediate_size = _as_int("shared_intermediate_size", shared_intermediate_size, 0,
                                           " (0 for no shared expert)")
        norm_topk_prob = _as_bool("norm_topk_prob", norm_topk_prob)
        use_expert_bias = _as_bool("use_expert_bias", use_expert_bias)
        shared_expert_gate = _as_bool("shared_expert_gate", shared_expert_gate)
        expert_proj_bias = _as_bool("expert_proj_bias", expert_proj_bias)
        router_bias = _as_bool("router_bias", router_bias)
        routed_scaling_factor = _as_float("routed_scaling_factor", routed_scaling_factor, positive=True)
        swiglu_limit = None if swiglu_limit is None else _as_float("swiglu_limit", swiglu_limit, positive=True)
        aux_loss_coef = _as_float("aux_loss_coef", aux_loss_coef, positive=False)
        z_loss_coef = _as_float("z_loss_coef", z_loss_coef, positive=False)
        _require(top_k <= num_experts, f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        _require(score_func in routing.SCORE_FUNCS, f"score_func must be one of {routing.SCORE_FUNCS}, got {score_func!r}")
        _require(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        _require((n_group is None) == (topk_group is None), "n_group and topk_group must be given together")
        if n_group is not None:
            n_group, topk_group = _as_int("n_group", n_group, 1), _as_int("topk_group", topk_group, 1)
            _require(n_group > 0 and num_experts % n_group == 0,
                     f"num_experts ({num_experts}) must be divisible by n_group ({n_group})")
            _require(0 < topk_group <= n_group, f"topk_group ({topk_group}) must be in [1, n_group={n_group}]")
            _require(top_k <= topk_group * (num_experts // n_group),
                     f"top_k ({top_k}) exceeds the experts in topk_group={topk_group} groups")
        _require(not shared_expert_gate or shared_intermediate_size > 0,
                 "shared_expert_gate needs a shared expert (shared_intermediate_size > 0)")
        _require(precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {precision!r}")
        _require(backend in BACKENDS, f"backend must be one of {BACKENDS}, got {backend!r}")
        _require(isinstance(dtype, torch.dtype) and dtype in DTYPES,
                 f"dtype must be a torch.dtype among {', '.join(str(d) for d in DTYPES)}, got {dtype!r}")
        if precision == "mxfp8":
            _require(hidden_size % 32 == 0 and intermediate_size % 32 == 0,
                     f"precision='mxfp8' needs hidden_size ({hidden_size}) and intermediate_size "
                     f"({intermediate_size}) to be multiples of the MX block size 32")
            _require(dtype in (torch.bfloat16, torch.float16, torch.float32),
                     f"precision='mxfp8' needs dtype bfloat16, float16 or float32, got {dtype}")
        _require(config is None or isinstance(config, MoKConfig), "config must be a MoKConfig", TypeError)
        ep_size, ep_rank = group_size_and_rank(ep_group)
        _require(num_experts % ep_size == 0,
                 f"num_experts ({num_experts}) must be divisible by the expert-parallel size ({ep_size})")
        cfg = config if config is not None else MoKConfig()
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            _require(ep_size == 1 or getattr(cfg, name) > 0,
                     f"MoKConfig.{name}=0 is allowed only without expert parallelism (ep_group has {ep_size} ranks)")

        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local_experts = num_experts // ep_size
        self.config = cfg
        self.precision = precision
        self.backend = backend
        self.aux_loss_coef = float(aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)

        self.router = Router(hidden_size, num_experts, router_bias, use_expert_bias, device, dtype)
        self.experts = Experts(self.num_local_experts, hidden_size, intermediate_size, expert_proj_bias, device, dtype)
        self.shared_expert = (
            SharedExpert(hidden_size, shared_intermediate_size, device, dtype) if shared_intermediate_size else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False, device=device, dtype=dtype) if shared_expert_gate else None
        )
        self.router_logits: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal init scaled by 1/sqrt(fan_in); biases (and the selection-bias buffer) zero;
        deterministic under torch.manual_seed. Also what materialises a layer built on "meta"."""
        self.router.weight.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
        if self.router.bias is not None:
            self.router.bias.zero_()
        if self.router.e_score_correction_bias is not None:
            self.router.e_score_correction_bias.zero_()
        self.experts.gate_up_proj.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
        self.experts.down_proj.normal_(0.0, 1.0 / math.sqrt(self.intermediate_size))
        for bias in (self.experts.gate_up_proj_bias, self.experts.down_proj_bias):
            if bias is not None:
                bias.zero_()

    def __getstate__(self):
        # router_logits / aux_loss of the last forward are non-leaf tensors holding its graph:
        # a copy (copy.deepcopy, pickling) starts without them, as a fresh layer does.
        state = self.__dict__.copy()
        state["router_logits"] = None
        state["aux_loss"] = None
        return state

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func}, "
                f"activation={self.activation}, ep_size={self.ep_size}, precision={self.precision}, "
                f"backend={self.backend}")

    # ------------------------------------------------------------------
    def _check_input(self, x) -> None:
        _require(isinstance(x, torch.Tensor), f"x must be a torch.Tensor, got {type(x).__name__}", TypeError)
        _require(x.dim() >= 1 and x.shape[-1] == self.hidden_size,
                 f"x must have shape [..., hidden_size={self.hidden_size}], got {tuple(x.shape)}")
        weight = self.experts.gate_up_proj
        _require(x.dtype == weight.dtype,
                 f"x dtype {x.dtype} does not match the layer's parameter dtype {weight.dtype}", TypeError)
        _require(x.device == weight.device,
                 f"x is on device {x.device} but the layer's parameters are on {weight.device}")
        _require(x.is_contiguous(), f"x must be contiguous (got strides {x.stride()}); call x.contiguous()")

    def _choose_backend(self, x: torch.Tensor) -> str:
        """'cuda', 'torch' (portable) or 'reference' for this input; backend='cuda' raises where the kernels
        cannot run; 'auto' takes the portable backend there and says once per reason why."""
        if self.backend in ("reference", "torch"):
            return self.backend
        reason = self._cuda_unsupported_reason(x)
        if reason is None:
            return "cuda"
        if self.backend == "cuda":
            raise RuntimeError(f"backend='cuda' cannot run this layer: {reason}")
        if reason not in _LOGGED_FALLBACKS and not torch.compiler.is_compiling():  # Dynamo cannot trace logging
            _LOGGED_FALLBACKS.add(reason)
            level = logging.INFO if not x.is_cuda else logging.WARNING
            logger.log(level, "mok_nn: using the portable backend (backend='torch'): %s", reason)
        return "torch"

    def _cuda_unsupported_reason(self, x: torch.Tensor) -> str | None:
        if not x.is_cuda:
            return f"input is on {x.device.type}, the fused kernels need a CUDA device"
        if self.precision == "mxfp8":
            return "precision='mxfp8' has no fused kernels yet"
        try:
            from . import cuda_backend
        except ImportError as err:
            return f"the CUDA backend is unavailable ({err})"
        if self.ep_size > 1:
            from . import cuda_ep

            why = cuda_ep.unsupported_reason(self)
            if why is not None:
                return why
        return cuda_backend.unsupported_reason(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x2d = x.reshape(-1, self.hidden_size)
        with autocast_off(x.device.type):  # fp32 logits and routing (ARCHITECTURE.md) under autocast too
            logits = self.router(x2d)
            topk_ids, topk_weights, scores = routing.route(
                logits, self.top_k, self.score_func, self.norm_topk_prob, self.n_group, self.topk_group,
                self.routed_scaling_factor, self.router.e_score_correction_bias,
            )
            self.aux_loss = self._aux_loss(logits, scores, topk_ids)
        self.router_logits = logits

        backend = self._choose_backend(x)
        e = self.experts
        if torch.compiler.is_compiling() and self.ep_size == 1 and self.precision == "bf16":
            # Under torch.compile the experts go through the custom ops, which Dynamo traces as
            # opaque nodes (same formulas and bits as MoKFunction, tested). Macrobatch passes: one
            # op call per pass, unrolled for the traced token count; autograd sums the passes'
            # expert gradients in its own order (MoKFunction's bits for up to two passes).
            size = self.config.macrobatch_size
            bounds = [(0, x2d.shape[0])]
            if size is not None and x2d.shape[0] > size:
                bounds = pass_bounds(x2d.shape[0], size)
            outs = [ops.routed_experts(
                x2d[s:t], topk_ids[s:t], topk_weights[s:t], e.gate_up_proj, e.down_proj, e.gate_up_proj_bias,
                e.down_proj_bias, self.activation, self.swiglu_limit, backend,
            ) for s, t in bounds]
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
        else:
            workspace = functional.get_workspace(
                hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                num_experts=self.num_experts, top_k=self.top_k, ep_group=self.ep_group, device=x.device,
                dtype=x.dtype, backend=backend, activation=self.activation, swiglu_limit=self.swiglu_limit,
                config=self.config, precision=self.precision,
            )
            y = MoKFunction.apply(
                x2d, topk_weights, e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias, topk_ids,
                workspace,
            )
        if self.shared_expert is not None:
            shared = self.shared_expert(x2d)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x2d)) * shared
            y = y + shared
        return y.view(x.shape)

    def _aux_loss(self, logits, scores, topk_ids):
        if self.aux_loss_coef == 0.0 and self.z_loss_coef == 0.0:
            return None
        loss = logits.new_zeros(())
        if self.aux_loss_coef:
            loss = loss + self.aux_loss_coef * routing.load_balancing_loss(scores, topk_ids, self.score_func)
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * routing.router_z_loss(logits)
        return loss
