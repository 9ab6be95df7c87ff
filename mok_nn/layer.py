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
from . import functional, mxfp8, ops
from .autograd import MoKFunction, autocast_off, macrobatch_passes, pass_bounds
from .config import MoKConfig
from .distributed import group_size_and_rank
from .reference import ACTIVATIONS

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
        return routing.router_logits(x2d, self.weight, self.bias)


def _plain_router(router: nn.Module) -> bool:
    """Whether router is a Router whose call is its forward: no module hooks (forward or backward), its own or
    global, that calling it would run."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    global_hooks = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                    "_global_backward_pre_hooks")
    return (type(router) is Router and "forward" not in router.__dict__
            and not any(getattr(router, h, None) for h in hooks)
            and not any(getattr(nn.modules.module, h, None) for h in global_hooks))


_MX_WEIGHTS = ("gate_up_proj", "down_proj")
_MX_BUFFERS = ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale")
MXFP8_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what mxfp8.quantize takes


def _frozen_message(name: str) -> str:
    return (f"experts.{name} holds MXFP8-only frozen expert weights (float8_e4m3fn data with E8M0 scales in "
            f"experts.{name}_scale, no copy in the layer dtype): they get no gradient and cannot be trained. "
            f"Call layer.dequantize_experts_() to get trainable {name} parameters in the layer dtype back "
            "(docs/mxfp8.md, 'MXFP8-only expert weights').")


class MXFP8Weight(torch.Tensor):
    """The float8_e4m3fn data of an MXFP8-only expert weight (a buffer of Experts). It refuses to require
    gradients (``requires_grad_(True)``, ``.requires_grad = True``) with an error saying why; everything else
    is a plain tensor (operations on it return plain tensors)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(t: torch.Tensor, name: str = "gate_up_proj") -> "MXFP8Weight":
        if t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"MXFP8 expert weight data must be float8_e4m3fn, got {t.dtype}")
        w = torch.Tensor._make_subclass(MXFP8Weight, t.detach(), False)  # shares t's storage
        w._mok_name = name
        return w

    def _refuse(self):
        raise RuntimeError(_frozen_message(getattr(self, "_mok_name", "gate_up_proj / down_proj")))

    def requires_grad_(self, requires_grad: bool = True):
        if requires_grad:
            self._refuse()
        return self

    @property
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if value:
            self._refuse()
        torch._C.TensorBase.requires_grad.__set__(self, False)

    def __deepcopy__(self, memo):
        out = MXFP8Weight.wrap(self.detach().clone(), getattr(self, "_mok_name", "gate_up_proj"))
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        return MXFP8Weight.wrap, (torch.Tensor(self.detach()), getattr(self, "_mok_name", "gate_up_proj"))


class Experts(nn.Module):
    """The routed experts of this rank: gate_up_proj [E_l, 2I, H] (gate rows first), down_proj [E_l, H, I].

    Held either as parameters in the layer dtype, or as MXFP8 only (``mxfp8_only``, frozen: ``quantize_()``,
    ``MoKMoELayer(mxfp8_experts=True)``, ``checkpoint.load_experts_into_layer``): then the buffers
    ``gate_up_proj`` / ``down_proj`` hold float8_e4m3fn data (MXFP8Weight) and ``gate_up_proj_scale``
    [E_l, 2I, H/32] / ``down_proj_scale`` [E_l, H, I/32] their uint8 E8M0 scales, blocks of 32 along each
    weight's last dimension (mok_nn's checkpoint layout); the weights the layer computes with are their
    dequantised values in ``weight_dtype``. Biases stay parameters in the layer dtype either way.
    """

    def __init__(self, num_local_experts, hidden_size, intermediate_size, bias, device, dtype, mxfp8_only=False):
        super().__init__()
        self.shape13 = (num_local_experts, 2 * intermediate_size, hidden_size)
        self.shape2 = (num_local_experts, hidden_size, intermediate_size)
        self._weight_dtype = dtype
        if mxfp8_only:
            _check_mxfp8_storage(hidden_size, intermediate_size, dtype)
            self._set_storage(True, device)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(self.shape13, device=device, dtype=dtype))
            self.down_proj = nn.Parameter(torch.empty(self.shape2, device=device, dtype=dtype))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(self.shape13[:2], device=device, dtype=dtype))
            self.down_proj_bias = nn.Parameter(torch.empty(self.shape2[:2], device=device, dtype=dtype))
        else:
            self.gate_up_proj_bias = None
            self.down_proj_bias = None

    # -- what the weights are held as
    @property
    def mxfp8_only(self) -> bool:
        """Whether the weights are held as MXFP8 only (frozen buffers, no copy in the layer dtype)."""
        return "gate_up_proj" in self._buffers

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the layer computes in: the parameters', or the one MXFP8-only weights dequantise to."""
        return self._weight_dtype if self.mxfp8_only else self.gate_up_proj.dtype

    def quantized_weights(self) -> tuple[mxfp8.MXFP8Tensor, mxfp8.MXFP8Tensor]:
        """(gate_up_proj, down_proj) as MXFP8Tensors (views of the buffers) of an MXFP8-only Experts."""
        if not self.mxfp8_only:
            raise RuntimeError("the expert weights are parameters, not MXFP8: call quantize_() first")
        return (mxfp8.MXFP8Tensor(self.gate_up_proj, self.gate_up_proj_scale, 2),
                mxfp8.MXFP8Tensor(self.down_proj, self.down_proj_scale, 2))

    def dequantized_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """W_q = dequantize(stored) of (gate_up_proj, down_proj) in ``dtype`` (default weight_dtype), new tensors."""
        dtype = dtype or self.weight_dtype
        return tuple(mxfp8.dequantize(t, dtype) for t in self.quantized_weights())

    def _set_storage(self, mxfp8_only: bool, device) -> None:
        """Replace the weights by fresh storage of the given kind (zeros / uninitialised; values not converted)."""
        if "gate_up_proj" in self._parameters:
            self._weight_dtype = self._parameters["gate_up_proj"].dtype
        for name in _MX_BUFFERS:
            self._buffers.pop(name, None)
            self._parameters.pop(name, None)
        for name, shape in (("gate_up_proj", self.shape13), ("down_proj", self.shape2)):
            if mxfp8_only:
                data = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
                scale = torch.zeros(*shape[:-1], shape[-1] // 32, dtype=torch.uint8, device=device)
                self.register_buffer(name, MXFP8Weight.wrap(data, name))
                self.register_buffer(name + "_scale", scale)
            else:
                empty = torch.empty(shape, dtype=self._weight_dtype, device=device)
                self.register_parameter(name, nn.Parameter(empty))

    @torch.no_grad()
    def set_mxfp8_(self, gate_up_proj: mxfp8.MXFP8Tensor, down_proj: mxfp8.MXFP8Tensor) -> "Experts":
        """Hold these MXFP8 weights (row-wise, blocks of 32, this rank's experts) as the only copy: the bits
        are copied into the buffers (made MXFP8-only first where the weights were parameters)."""
        for name, t, shape in (("gate_up_proj", gate_up_proj, self.shape13), ("down_proj", down_proj, self.shape2)):
            if not isinstance(t, mxfp8.MXFP8Tensor) or t.axis != 2 or t.block_size != 32 or tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected an MXFP8Tensor of shape {shape} quantised along its last "
                                 f"dimension in blocks of 32, got {t!r:.200}")
        if not self.mxfp8_only:
            _check_mxfp8_storage(self.shape13[2], self.shape2[2], self.weight_dtype)
            self._set_storage(True, self.gate_up_proj.device)
        for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            self._buffers[name].copy_(t.data)
            self._buffers[name + "_scale"].copy_(t.scale)
        return self

    @torch.no_grad()
    def quantize_(self, scale_mode: str = "rceil") -> "Experts":
        """Quantise the weight parameters to MXFP8 (along their last dimension, blocks of 32, ``scale_mode``)
        and hold only that: the parameters are dropped (their memory freed once nothing else, e.g. an
        optimizer, refers to them). A no-op where the weights are MXFP8-only already."""
        if self.mxfp8_only:
            return self
        if scale_mode not in mxfp8.SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {mxfp8.SCALE_MODES}, got {scale_mode!r}")
        w13, w2 = self.gate_up_proj, self.down_proj
        _check_mxfp8_storage(self.shape13[2], self.shape2[2], w13.dtype)
        q13, q2 = mxfp8.quantize_experts(w13, scale_mode), mxfp8.quantize_experts(w2, scale_mode)
        self._weight_dtype = w13.dtype
        del self.gate_up_proj, self.down_proj, w13, w2
        for name, q in (("gate_up_proj", q13), ("down_proj", q2)):
            self.register_buffer(name, MXFP8Weight.wrap(q.data, name))
            self.register_buffer(name + "_scale", q.scale)
        return self

    @torch.no_grad()
    def dequantize_(self) -> "Experts":
        """Turn MXFP8-only weights back into trainable parameters holding W_q = dequantize(stored) in
        weight_dtype. A no-op where the weights are parameters already."""
        if not self.mxfp8_only:
            return self
        w13, w2 = self.dequantized_weights()
        for name in _MX_BUFFERS:
            del self._buffers[name]
        self.gate_up_proj = nn.Parameter(w13)
        self.down_proj = nn.Parameter(w2)
        return self

    def check_frozen(self) -> None:
        """RuntimeError where MXFP8-only data was made to require gradients past MXFP8Weight's checks."""
        for name in _MX_WEIGHTS:
            t = self._buffers.get(name)
            if t is not None and torch._C.TensorBase.requires_grad.__get__(t):
                raise RuntimeError(_frozen_message(name))

    # -- module plumbing
    def _apply(self, fn, recurse=True):
        # Module casts (.to(dtype), .half(), ...) must not turn the E4M3 data (a floating dtype) into the layer
        # dtype: the buffers only move device; the dtype the weights dequantise to follows the cast.
        if not self.mxfp8_only:
            return super()._apply(fn, recurse)
        held = {name: self._buffers.pop(name) for name in _MX_BUFFERS}
        try:
            super()._apply(fn, recurse)
        finally:
            probe = fn(torch.empty(0, dtype=self._weight_dtype, device=held["gate_up_proj"].device))
            for name, t in held.items():
                if t.device != probe.device:
                    t = torch.empty_like(t, device=probe.device) if t.is_meta else t.to(probe.device)
                self._buffers[name] = MXFP8Weight.wrap(t, name) if name in _MX_WEIGHTS else t
            if probe.is_floating_point():
                self._weight_dtype = probe.dtype
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        wrong = []
        for name in _MX_WEIGHTS:
            t = state_dict.get(prefix + name)
            if t is None or not isinstance(t, torch.Tensor):
                continue
            is_fp8 = t.dtype == torch.float8_e4m3fn
            if self.mxfp8_only and not is_fp8:
                wrong.append(f"{prefix}{name} is {t.dtype}, but this layer holds MXFP8-only expert weights "
                             "(float8_e4m3fn data + uint8 E8M0 scales): load it into a layer with parameters and "
                             "call layer.quantize_experts_(), or call layer.dequantize_experts_() first")
            elif not self.mxfp8_only and is_fp8:
                wrong.append(f"{prefix}{name} holds MXFP8 data (float8_e4m3fn), but this layer's expert weights are "
                             f"{self.weight_dtype} parameters: build the layer with mxfp8_experts=True (or call "
                             "layer.quantize_experts_() first), or use mok_nn.checkpoint.load_experts_into_layer, "
                             "which dequantises")
        if wrong:
            error_msgs.extend(wrong)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name in _MX_WEIGHTS:  # load_state_dict(assign=True) puts plain tensors in
            t = self._buffers.get(name)
            if t is not None and not isinstance(t, MXFP8Weight):
                self._buffers[name] = MXFP8Weight.wrap(t, name)


def _check_mxfp8_storage(hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
    if hidden_size % 32 or intermediate_size % 32:
        raise ValueError(f"MXFP8 expert weights need hidden_size ({hidden_size}) and intermediate_size "
                         f"({intermediate_size}) to be multiples of the MX block size 32")
    if dtype not in MXFP8_DTYPES:
        raise TypeError(f"MXFP8 expert weights need a layer dtype among bfloat16, float16, float32, got {dtype}")


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
    mxfp8_experts: hold the routed expert weights as MXFP8 only (frozen, no copy in
        `dtype`; `quantize_experts_()` converts a layer, `dequantize_experts_()` back;
        docs/mxfp8.md "MXFP8-only expert weights").
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
        mxfp8_experts: bool = False,
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
        mxfp8_experts = _as_bool("mxfp8_experts", mxfp8_experts)
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
        self._cuda_verdict = None  # (what _choose_backend's "cuda" depends on, "cuda") of the last call that took it
        self.aux_loss_coef = float(aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)

        self.router = Router(hidden_size, num_experts, router_bias, use_expert_bias, device, dtype)
        self.experts = Experts(self.num_local_experts, hidden_size, intermediate_size, expert_proj_bias, device, dtype,
                               mxfp8_only=mxfp8_experts)
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
        e = self.experts
        if e.mxfp8_only:  # the same draws, quantised ("rceil") one expert at a time: no full copy in the layer dtype
            for name, std in (("gate_up_proj", 1.0 / math.sqrt(self.hidden_size)),
                              ("down_proj", 1.0 / math.sqrt(self.intermediate_size))):
                data, scale = e._buffers[name], e._buffers[name + "_scale"]
                if data.is_meta:
                    continue
                for i in range(data.shape[0]):
                    w = torch.empty(data.shape[1:], dtype=e.weight_dtype, device=data.device).normal_(0.0, std)
                    q = mxfp8.quantize(w)
                    data[i].copy_(q.data)
                    scale[i].copy_(q.scale)
        else:
            e.gate_up_proj.normal_(0.0, 1.0 / math.sqrt(self.hidden_size))
            e.down_proj.normal_(0.0, 1.0 / math.sqrt(self.intermediate_size))
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
                f"backend={self.backend}" + (", mxfp8_experts=True" if self.experts.mxfp8_only else ""))

    def quantize_experts_(self, scale_mode: str = "rceil") -> "MoKMoELayer":
        """Hold the routed expert weights as MXFP8 only, from now on frozen: quantise gate_up_proj / down_proj
        once (along their last dimension, blocks of 32, ``scale_mode`` "rceil" or "floor") and drop the
        parameters (build optimizers after this call: one holding them keeps their memory alive). The layer then
        computes with W_q = dequantize(stored); d x and the router still train, the expert weights get no
        gradient (biases stay trainable parameters). Returns the layer."""
        self.experts.quantize_(scale_mode)
        return self

    def dequantize_experts_(self) -> "MoKMoELayer":
        """Make MXFP8-only expert weights trainable parameters again, holding W_q = dequantize(stored) in the
        layer dtype. Returns the layer."""
        self.experts.dequantize_()
        return self

    # ------------------------------------------------------------------
    def _check_input(self, x) -> None:
        weight = self.experts.gate_up_proj
        if (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == self.hidden_size
                and x.dtype == self.experts.weight_dtype and x.device == weight.device and x.is_contiguous()):
            return  # (the checks below once more, for their messages, only where one fails)
        _require(isinstance(x, torch.Tensor), f"x must be a torch.Tensor, got {type(x).__name__}", TypeError)
        _require(x.dim() >= 1 and x.shape[-1] == self.hidden_size,
                 f"x must have shape [..., hidden_size={self.hidden_size}], got {tuple(x.shape)}")
        weight = self.experts.gate_up_proj
        _require(x.dtype == self.experts.weight_dtype,
                 f"x dtype {x.dtype} does not match the layer's parameter dtype {self.experts.weight_dtype}",
                 TypeError)
        _require(x.device == weight.device,
                 f"x is on device {x.device} but the layer's parameters are on {weight.device}")
        _require(x.is_contiguous(), f"x must be contiguous (got strides {x.stride()}); call x.contiguous()")

    def _choose_backend(self, x: torch.Tensor) -> str:
        """'cuda', 'torch' (portable) or 'reference' for this input; backend='cuda' raises where the kernels
        cannot run; 'auto' takes the portable backend there and says once per reason why."""
        if self.backend in ("reference", "torch"):
            return self.backend
        # the fused path's verdict depends on these alone; kept for the next call with the same ones
        e = self.experts
        key = (x.device, x.dtype, x.shape[-1], e.mxfp8_only, e.gate_up_proj.dtype, e.gate_up_proj.shape,
               e.down_proj.dtype, e.down_proj.shape, self.precision, self.ep_size, self.activation, self.top_k)
        compiling = torch.compiler.is_compiling()
        verdict = getattr(self, "_cuda_verdict", None)  # (absent in a layer pickled by an older mok_nn)
        if not compiling and verdict is not None and verdict[0] == key:
            return verdict[1]
        reason = self._cuda_unsupported_reason(x)
        if reason is None:
            if not compiling:
                self._cuda_verdict = (key, "cuda")
            return "cuda"
        if self.backend == "cuda":
            raise RuntimeError(f"backend='cuda' cannot run this layer: {reason}")
        if reason not in _LOGGED_FALLBACKS and not torch.compiler.is_compiling():  # Dynamo cannot trace logging
            _LOGGED_FALLBACKS.add(reason)
            level = logging.INFO if not x.is_cuda else logging.WARNING
            logger.log(level, "mok_nn: using the portable backend (backend='torch'): %s", reason)
        return "torch"

    def _local_experts(self, x: torch.Tensor, backend: str) -> str:
        """Where the portable backend's local experts run: "cuda" (the fused one-GPU kernels) where "auto" took the
        portable backend for expert parallelism alone (an EP group the EP kernels cannot take, e.g. across hosts,
        or MXFP8 over EP) and the kernels run this layer on one GPU; else "torch"."""
        if backend != "torch" or self.backend != "auto" or self.ep_size == 1 or not x.is_cuda:
            return "torch"
        from . import cuda_backend

        return "cuda" if cuda_backend.unsupported_reason(self, x) is None else "torch"

    def _cuda_unsupported_reason(self, x: torch.Tensor) -> str | None:
        if not x.is_cuda:
            return f"input is on {x.device.type}, the fused kernels need a CUDA device"
        if self.precision == "mxfp8" and self.ep_size > 1:
            return "precision='mxfp8' with expert parallelism has no CUDA path yet"
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
        backend = self._choose_backend(x)
        e = self.experts
        if e.mxfp8_only:
            e.check_frozen()
        compiled = torch.compiler.is_compiling() and self.ep_size == 1 and not e.mxfp8_only
        workspace = None if compiled else functional.get_workspace(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_experts=self.num_experts, top_k=self.top_k, ep_group=self.ep_group, device=x.device,
            dtype=x.dtype, backend=backend, activation=self.activation, swiglu_limit=self.swiglu_limit,
            config=self.config, precision=self.precision, local_experts=self._local_experts(x, backend),
        )
        with autocast_off(x.device.type):  # fp32 logits and routing (ARCHITECTURE.md) under autocast too
            opts = (self.top_k, self.score_func, self.norm_topk_prob, self.n_group, self.topk_group,
                    self.routed_scaling_factor, self.router.e_score_correction_bias)
            if _plain_router(self.router):  # logits and routing together (one kernel where route_tokens can)
                logits, topk_ids, topk_weights, scores = routing.route_tokens(
                    x2d, self.router.weight, self.router.bias, *opts)
            else:  # a router module replaced or hooked (e.g. an adapter): its own forward, then the routing
                logits = self.router(x2d)
                topk_ids, topk_weights, scores = routing.route(logits, *opts)
            schedule = self._early_schedule(topk_ids, x2d, workspace)
            self.aux_loss = self._aux_loss(logits, scores, topk_ids)
        self.router_logits = logits

        if compiled:
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
                e.down_proj_bias, self.activation, self.swiglu_limit, backend, self.precision,
            ) for s, t in bounds]
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
        else:
            # MXFP8-only weights go in as their E4M3 data and E8M0 scales: MoKFunction dequantises them for
            # each forward and backward (a transient copy in the layer dtype), and they get no gradient
            scales = (e.gate_up_proj_scale, e.down_proj_scale) if e.mxfp8_only else (None, None)
            y = MoKFunction.apply(
                x2d, topk_weights, e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias, topk_ids,
                workspace, *scales, schedule,
            )
        if self.shared_expert is not None:
            shared = self.shared_expert(x2d)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x2d)) * shared
            y = y + shared
        return y.view(x.shape)

    @staticmethod
    def _early_schedule(topk_ids: torch.Tensor, x2d: torch.Tensor, workspace):
        """The fused path's schedule (and x gathered in its order), launched right after the router: the GPU
        builds it while the host prepares the rest of the forward, where it would otherwise wait for the host
        from the router's end (a call from an idle GPU). None elsewhere (MoKFunction builds it): other
        backends, expert parallelism (built after the token exchange's all-gather), macrobatch passes, and
        torch.compile."""
        if workspace is None or workspace.backend != "cuda" or workspace.ep_size != 1 or torch.compiler.is_compiling():
            return None
        if macrobatch_passes(x2d.shape[0], workspace) is not None:
            return None
        return functional.build_schedule(topk_ids, workspace, x2d)

    def _aux_loss(self, logits, scores, topk_ids):
        if self.aux_loss_coef == 0.0 and self.z_loss_coef == 0.0:
            return None
        loss = logits.new_zeros(())
        if self.aux_loss_coef:
            loss = loss + self.aux_loss_coef * routing.load_balancing_loss(scores, topk_ids, self.score_func)
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * routing.router_z_loss(logits)
        return loss
