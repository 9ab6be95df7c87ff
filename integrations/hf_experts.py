"""mok_nn as a transformers experts implementation: `experts_implementation="mok"`.

transformers 5.x computes the routed experts of an MoE block through a
registry (`transformers.integrations.moe.ExpertsInterface`): the block's own
router picks the top-k experts and weights, then the experts module calls the
function registered under `config._experts_implementation` with
`(experts_module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`.
`register()` adds mok_nn's routed experts there, so

    AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok")
    model.set_experts_implementation("mok")

run every registry-served experts module on mok_nn, with the model's router,
modules, parameters and state dict unchanged.

Supported experts modules: gated experts (`has_gate`) without a post-expert
norm, with a silu gate (`silu(gate) * up`) in the concatenated layout
(gate_up_proj [E, 2I, H], down_proj [E, H, I]: Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V3, ...), or GPT-OSS's clamped SwiGLU (interleaved, transposed, with
biases; converted on each call, a copy of the expert weights that autograd
differentiates through).  Others raise ValueError naming the reason.

Expert parallelism: transformers' EP (`DistributedConfig(ep_size=...)`) moves
the tokens itself and calls the experts with this rank's experts and local
expert ids, marking routes to other ranks with an id >= num_experts and weight
0; such routes are computed on local expert 0 with weight 0 (no contribution,
no gradient), as transformers' "batched_mm" does.
"""

from __future__ import annotations

import torch
from torch import nn

from .routed import BACKENDS, routed_experts

__all__ = ["register", "make_experts_forward", "experts_layout"]

_OAI_ALPHA = 1.702


def _is_silu(act) -> bool:
    return type(act).__name__ in ("SiLUActivation", "SiLU") or getattr(act, "__name__", "") == "silu"


def experts_layout(experts: nn.Module) -> tuple[str, float | None]:
    """(activation, swiglu_limit) of a transformers experts module, in mok_nn's
    terms; ValueError where mok_nn cannot compute it."""
    name = type(experts).__name__
    if not getattr(experts, "has_gate", True):
        raise ValueError(f"{name}: experts without a gate projection are not supported by mok_nn")
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{name}: a post-expert norm is not supported by mok_nn")
    from transformers.integrations.moe import _default_apply_gate

    if type(experts)._apply_gate is _default_apply_gate:
        if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
            raise ValueError(f"{name}: only the [gate; up] layout is supported with a plain SwiGLU")
        if not _is_silu(getattr(experts, "act_fn", None)):
            raise ValueError(f"{name}: activation {type(getattr(experts, 'act_fn', None)).__name__}; "
                             "mok_nn's experts are silu-gated")
        return "swiglu", None
    # the one custom gate mok_nn computes: GPT-OSS's clamped SwiGLU on interleaved, transposed weights
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    gpt_oss = (getattr(experts, "is_transposed", False) and not getattr(experts, "is_concatenated", True)
               and alpha is not None and abs(float(alpha) - _OAI_ALPHA) < 1e-6 and limit is not None)
    if not gpt_oss:
        raise ValueError(f"{name}: its own _apply_gate is not one mok_nn computes")
    return "swiglu_oai", float(limit)


def _mok_tensors(experts: nn.Module, activation: str):
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I], gate_up_bias, down_bias) in
    mok_nn's layout; differentiable views or copies of the module's tensors."""
    if activation == "swiglu":
        bias = getattr(experts, "has_bias", False)
        return (experts.gate_up_proj, experts.down_proj,
                experts.gate_up_proj_bias if bias else None, experts.down_proj_bias if bias else None)
    # GPT-OSS: gate_up_proj [E, H, 2I] with gate / up at even / odd columns, down_proj [E, I, H]
    w = experts.gate_up_proj
    gate_up = torch.cat([w[..., ::2], w[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    b = experts.gate_up_proj_bias
    gate_up_bias = torch.cat([b[..., ::2], b[..., 1::2]], dim=-1)
    return gate_up, experts.down_proj.transpose(1, 2).contiguous(), gate_up_bias, experts.down_proj_bias


def make_experts_forward(backend: str = "auto", config=None):
    """An experts function for transformers' registry running mok_nn on `backend`
    ("auto", "cuda", or a portable backend of mok_nn.functional) with `config`
    (a MoKConfig, or None for the defaults)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def mok_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
        activation, limit = experts_layout(self)
        gate_up, down, gate_up_bias, down_bias = _mok_tensors(self, activation)
        if getattr(self, "_is_expert_parallel", False):
            off_rank = top_k_index >= self.num_experts      # routes to another rank's experts
            top_k_index = top_k_index.masked_fill(off_rank, 0)
            top_k_weights = top_k_weights.masked_fill(off_rank, 0.0)
        return routed_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                              activation=activation, swiglu_limit=limit, backend=backend, config=config)

    mok_experts_forward.__qualname__ = mok_experts_forward.__name__ = f"mok_experts_forward_{backend}"
    return mok_experts_forward


def register(name: str = "mok", *, backend: str = "auto", config=None) -> str:
    """Register mok_nn's routed experts in transformers' experts registry under
    `name` (for `experts_implementation=name`), and return the name.
    Registering again under a name replaces its backend and config."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, make_experts_forward(backend, config))
    return name
