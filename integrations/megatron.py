"""Megatron-core (0.19) integration: the routed path of an MoE layer on mok_nn.

`MoKMegatronMoELayer` is Megatron's `MoELayer` with its forward replaced: the
Megatron router (with its aux / z losses and expert-bias bookkeeping), the
expert parameters (TEGroupedMLP `experts.linear_fc1.weight{i}` or
SequentialMLP `experts.local_experts.{i}.linear_fc1.weight`, fc1 = [gate; up])
and the shared experts are Megatron's own modules, built from the same spec,
so checkpoints (plain and distributed) keep their layout.  Only dispatch,
expert MLPs and combine run on mok_nn (`MoKFunction`), over the layer's
expert-parallel group.

    from mok_nn.integrations.megatron import get_mok_moe_module_spec
    mlp = get_mok_moe_module_spec(use_te=True, num_experts=64, moe_grouped_gemm=True)
    # or, for an existing spec: to_mok_moe_spec(get_moe_module_spec(...))

The per-expert weights are stacked into [E_local, 2I, H] / [E_local, H, I]
each forward (a copy; gradients flow back to Megatron's parameters).

The rest of this module is pure PyTorch and imports without Megatron:
config translation (`check_config`, `mok_layer_kwargs`), routing conversion
(`topk_from_routing_map`), and state-dict mapping between a Megatron MoE layer
and a standalone `MoKMoELayer` (`megatron_to_mok_state_dict`,
`mok_to_megatron_state_dict`).  Megatron's MoE layer needs CUDA;
examples/megatron_check.py compares it with the patched layer on a GPU.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from mok_nn import ops

__all__ = [
    "MegatronConfigError", "check_config", "expert_activation", "mok_layer_kwargs",
    "topk_from_routing_map", "stack_expert_weights", "megatron_to_mok_state_dict",
    "mok_to_megatron_state_dict", "HAVE_MEGATRON", "MoKMegatronMoELayer",
    "get_mok_moe_module_spec", "to_mok_moe_spec", "choose_backend",
]


class MegatronConfigError(ValueError):
    """A Megatron MoE configuration that mok_nn cannot compute."""


def _get(cfg, name, default=None):
    return getattr(cfg, name, default)


def _fn_name(fn) -> str | None:
    if fn is None:
        return None
    fn = getattr(fn, "func", fn)          # functools.partial
    return getattr(fn, "__name__", type(fn).__name__)


# --------------------------------------------------------------------------
# Config translation (pure)
# --------------------------------------------------------------------------

def expert_activation(cfg) -> tuple[str, float | None]:
    """(mok activation, swiglu_limit) of Megatron's expert activation.

    silu GLU (+ optional activation_func_clamp_value) -> "swiglu";
    quick_gelu GLU with glu_linear_offset 1 (GPT-OSS) -> "swiglu_oai".
    """
    if not _get(cfg, "gated_linear_unit", False):
        raise MegatronConfigError("gated_linear_unit=False: mok_nn computes gated (SwiGLU) experts only")
    name = _fn_name(_get(cfg, "activation_func"))
    offset = float(_get(cfg, "glu_linear_offset", 0.0) or 0.0)
    limit = _get(cfg, "activation_func_clamp_value")
    limit = None if limit is None else float(limit)
    if name == "silu" and offset == 0.0:
        return "swiglu", limit
    if name == "quick_gelu" and offset == 1.0:
        return "swiglu_oai", limit
    raise MegatronConfigError(
        f"activation_func={name} with glu_linear_offset={offset}: supported are silu (offset 0) "
        "and quick_gelu (offset 1, GPT-OSS)")


def _routed_path_problems(cfg) -> list[str]:
    """Why MoKMegatronMoELayer cannot run this config (empty: it can)."""
    problems = []
    try:
        expert_activation(cfg)
    except MegatronConfigError as err:
        problems.append(str(err))
    checks = [
        (_get(cfg, "moe_expert_capacity_factor") is not None,
         "moe_expert_capacity_factor (token dropping) is not supported"),
        (_get(cfg, "moe_mlp_glu_interleave_size") is not None,
         "moe_mlp_glu_interleave_size (interleaved GLU weights) is not supported"),
        ((_get(cfg, "expert_tensor_parallel_size") or 1) > 1,
         "expert_tensor_parallel_size > 1 is not supported (experts must be whole on a rank)"),
        ((_get(cfg, "tensor_model_parallel_size") or 1) > 1,
         "tensor_model_parallel_size > 1 is not supported"),
        (bool(_get(cfg, "moe_latent_size")), "moe_latent_size (latent MoE) is not supported"),
        (bool(_get(cfg, "moe_apply_probs_on_input")), "moe_apply_probs_on_input is not supported"),
        (bool(_get(cfg, "fp8")) or bool(_get(cfg, "fp4")),
         "Megatron fp8/fp4 recipes are not supported (use mok_nn precision instead)"),
        (bool(_get(cfg, "moe_shared_expert_overlap")),
         "moe_shared_expert_overlap is not supported (the shared expert runs before the routed path)"),
    ]
    problems += [msg for bad, msg in checks if bad]
    return problems


def check_config(cfg) -> None:
    """Raise MegatronConfigError listing what MoKMegatronMoELayer cannot run."""
    problems = _routed_path_problems(cfg)
    if problems:
        raise MegatronConfigError("mok_nn cannot run this Megatron MoE config:\n  " + "\n  ".join(problems))


def mok_layer_kwargs(cfg) -> dict[str, Any]:
    """MoKMoELayer arguments computing the same function as a Megatron MoE layer
    of this TransformerConfig (router included), for a standalone layer or a
    checkpoint conversion.  Raises MegatronConfigError where Megatron's routing
    or shared expert has no MoKMoELayer equivalent (a shared expert with biases,
    or with an activation other than plain SwiGLU: Megatron's shared expert uses
    the config's activation, offset and clamp, MoKMoELayer's is silu(g) * u)."""
    check_config(cfg)
    problems = []
    num_experts, top_k = int(cfg.num_moe_experts), int(cfg.moe_router_topk)
    score = _get(cfg, "moe_router_score_function", "softmax")
    pre_softmax = bool(_get(cfg, "moe_router_pre_softmax", False))
    groups, group_topk = _get(cfg, "moe_router_num_groups"), _get(cfg, "moe_router_group_topk")
    scale = _get(cfg, "moe_router_topk_scaling_factor")
    kw = dict(hidden_size=int(cfg.hidden_size), intermediate_size=int(cfg.moe_ffn_hidden_size),
              num_experts=num_experts, top_k=top_k)
    if score == "softmax":
        # pre_softmax: softmax over all experts, top-k, no renormalisation;
        # otherwise top-k of the logits, softmax over those (== renormalised)
        kw.update(score_func="softmax", norm_topk_prob=not pre_softmax)
    elif score == "sigmoid":
        kw.update(score_func="sigmoid", norm_topk_prob=top_k > 1)
    else:
        problems.append(f"moe_router_score_function={score!r}")
    if group_topk:
        # Megatron scores a group by its top-(topk/group_topk) experts, mok_nn by its top 2
        if top_k // group_topk != 2:
            problems.append(f"group-limited routing with moe_router_topk // moe_router_group_topk = "
                            f"{top_k // group_topk} (mok_nn scores a group by its best 2 experts)")
        kw.update(n_group=int(groups), topk_group=int(group_topk))
    if scale:
        kw["routed_scaling_factor"] = float(scale)
    kw["use_expert_bias"] = bool(_get(cfg, "moe_router_enable_expert_bias", False))
    lb = _get(cfg, "moe_router_load_balancing_type", "aux_loss")
    lb = lb if isinstance(lb, (list, tuple)) else [lb]
    if any(t in ("sinkhorn", "quantile_balancing") for t in lb):
        problems.append(f"moe_router_load_balancing_type={lb}")
    if _get(cfg, "moe_input_jitter_eps") is not None:
        problems.append("moe_input_jitter_eps")
    shared = _get(cfg, "moe_shared_expert_intermediate_size")
    if shared:
        kw["shared_intermediate_size"] = int(shared)
        kw["shared_expert_gate"] = bool(_get(cfg, "moe_shared_expert_gate", False))
    bias = bool(_get(cfg, "add_bias_linear", False))
    kw["expert_proj_bias"] = bias
    kw["router_bias"] = bias
    if bias and shared:
        problems.append("add_bias_linear with a shared expert (MoKMoELayer's shared expert has no biases)")
    activation, limit = expert_activation(cfg)
    kw.update(activation=activation, swiglu_limit=limit)
    if shared and (activation != "swiglu" or limit is not None):
        # Megatron's SharedExpertMLP applies the config's activation, glu_linear_offset and
        # activation_func_clamp_value like the routed experts; MoKMoELayer's shared expert is plain silu(g) * u
        problems.append(
            f"a shared expert with activation_func={_fn_name(_get(cfg, 'activation_func'))}, glu_linear_offset="
            f"{_get(cfg, 'glu_linear_offset', 0.0)}, activation_func_clamp_value={limit} (Megatron's shared expert "
            "uses them too; MoKMoELayer's shared expert is plain silu(gate) * up without clamp)")
    if problems:
        raise MegatronConfigError("no MoKMoELayer equivalent for this Megatron MoE config:\n  "
                                  + "\n  ".join(problems))
    return kw


# --------------------------------------------------------------------------
# Routing and weights (pure)
# --------------------------------------------------------------------------

def topk_from_routing_map(probs: torch.Tensor, routing_map: torch.Tensor, top_k: int, check: str | None = None):
    """Megatron's dense routing ([T, E] probs, [T, E] bool map, exactly top_k
    True per row) -> (topk_ids int64 [T, k] ascending, topk_weights fp32 [T, k]).
    The weights are gathered from `probs`, so gradients reach the router.

    A row with another number of experts (token dropping, not supported): check="raise" raises ValueError
    (reads the counts back to the host); check="nan" gives that token NaN weights, so its output is NaN,
    without a host synchronisation. Default: "raise" on the CPU, "nan" on a GPU (every forward would wait
    for the GPU otherwise)."""
    if probs.shape != routing_map.shape or probs.dim() != 2:
        raise ValueError(f"probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} must be the same [T, E]")
    check = check or ("nan" if probs.is_cuda else "raise")
    if check not in ("raise", "nan"):
        raise ValueError(f"check must be 'raise' or 'nan', got {check!r}")
    counts = routing_map.sum(dim=-1)
    if check == "raise" and probs.shape[0] and not bool((counts == top_k).all()):
        raise ValueError(f"every token must be routed to exactly top_k={top_k} experts "
                         f"(got between {int(counts.min())} and {int(counts.max())}); token dropping is not supported")
    # a stable descending sort of the 0/1 map lists the chosen experts in ascending order
    ids = torch.sort(routing_map.to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids).float()
    if check == "nan":
        weights = torch.where((counts == top_k).unsqueeze(1), weights, float("nan"))
    return ids, weights


_TE_W = re.compile(r"^experts\.linear_fc([12])\.(weight|bias)(\d+)$")
_SEQ_W = re.compile(r"^experts\.local_experts\.(\d+)\.linear_fc([12])\.(weight|bias)$")


def _local_expert_tensors(experts) -> dict[tuple[str, str], list]:
    """{("fc1"|"fc2", "weight"|"bias"): [tensor per local expert]} of a Megatron experts module."""
    out: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    if hasattr(experts, "local_experts"):               # SequentialMLP
        for i, mlp in enumerate(experts.local_experts):
            for fc in ("fc1", "fc2"):
                lin = getattr(mlp, f"linear_{fc}")
                out.setdefault((fc, "weight"), {})[i] = lin.weight
                if getattr(lin, "bias", None) is not None:
                    out.setdefault((fc, "bias"), {})[i] = lin.bias
    elif hasattr(experts, "linear_fc1") and hasattr(experts, "linear_fc2"):   # TEGroupedMLP: weight{i}, bias{i}
        for fc in ("fc1", "fc2"):
            lin = getattr(experts, f"linear_{fc}")
            for name, p in lin.named_parameters(recurse=False):
                m = re.fullmatch(r"(weight|bias)(\d+)", name)
                if m:
                    out.setdefault((fc, m.group(1)), {})[int(m.group(2))] = p
                elif name in ("weight", "bias") and p.dim() == (3 if name == "weight" else 2):
                    out.setdefault((fc, name), {})[-1] = p     # moe_single_grouped_weight/bias: [E, ...]
    if ("fc1", "weight") not in out:
        raise TypeError(f"unrecognised Megatron experts module {type(experts).__name__}: expected "
                        "SequentialMLP (local_experts) or TEGroupedMLP (linear_fc1.weight{i})")
    return {k: [v[i] for i in sorted(v)] for k, v in out.items()}


def stack_expert_weights(experts):
    """(gate_up_proj [E_l, 2I, H], down_proj [E_l, H, I], gate_up_bias | None,
    down_bias | None) of a Megatron experts module: stacked per-expert weights
    (a differentiable copy), or TE's single grouped weight as it is (no copy)."""
    t = _local_expert_tensors(experts)

    def stack(key):
        if key not in t:
            return None
        return t[key][0] if len(t[key]) == 1 and t[key][0].dim() == (3 if key[1] == "weight" else 2) \
            else torch.stack(t[key])

    return stack(("fc1", "weight")), stack(("fc2", "weight")), stack(("fc1", "bias")), stack(("fc2", "bias"))


def megatron_to_mok_state_dict(sd: dict, prefix: str = "") -> dict:
    """State dict of one Megatron MoE layer (keys under `prefix`, non-distributed,
    TEGroupedMLP or SequentialMLP experts) -> state dict of a MoKMoELayer.
    Keys the layer has no counterpart for (e.g. TE `_extra_state`) are dropped.
    Raises ValueError naming the keys for expert tensors of both layouts
    (TEGroupedMLP and SequentialMLP keys mixed), linear_fc1 without linear_fc2
    (weights or biases) or the other way round, and different expert counts."""
    sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    out, per_expert, layouts, found = {}, {}, {}, {}
    for k, v in sub.items():
        if (m := _TE_W.match(k)):
            key, i, layout = (f"fc{m.group(1)}", m.group(2)), int(m.group(3)), "TEGroupedMLP"
        elif (m := _SEQ_W.match(k)):
            key, i, layout = (f"fc{m.group(2)}", m.group(3)), int(m.group(1)), "SequentialMLP"
        elif (m := re.fullmatch(r"experts\.linear_fc([12])\.(weight|bias)", k)) and v.dim() == (
                3 if m.group(2) == "weight" else 2):                 # TE single grouped weight / bias
            key, i, layout = (f"fc{m.group(1)}", m.group(2)), -1, "TEGroupedMLP"
        else:
            key = None
        if key is not None:                                          # a routed expert's weight / bias
            per_expert.setdefault(key, {})[i] = v
            layouts.setdefault(layout, []).append(prefix + k)
            found.setdefault(key, []).append(prefix + k)
            continue
        if k in ("router.weight", "router.bias"):
            out[k] = v
        elif k == "router.expert_bias":
            out["router.e_score_correction_bias"] = v
        elif k == "shared_experts.linear_fc1.weight":
            gate, up = v.chunk(2, dim=0)
            out["shared_expert.gate_proj.weight"], out["shared_expert.up_proj.weight"] = gate, up
        elif k == "shared_experts.linear_fc2.weight":
            out["shared_expert.down_proj.weight"] = v
        elif k == "shared_experts.gate_weight":
            out["shared_expert_gate.weight"] = v
    if len(layouts) > 1:
        raise ValueError("Megatron expert tensors of both layouts under prefix "
                         f"{prefix!r}: TEGroupedMLP keys (e.g. {layouts['TEGroupedMLP'][:2]}) and "
                         f"SequentialMLP keys (e.g. {layouts['SequentialMLP'][:2]}); one would overwrite the other")
    for kind in ("weight", "bias"):
        have = [fc for fc in ("fc1", "fc2") if (fc, kind) in found]
        if len(have) == 1:
            other = "fc2" if have[0] == "fc1" else "fc1"
            raise ValueError(f"Megatron expert {kind}s under prefix {prefix!r}: linear_{have[0]} "
                             f"(e.g. {found[(have[0], kind)][:2]}) but no linear_{other} {kind}")
    names = {("fc1", "weight"): "experts.gate_up_proj", ("fc2", "weight"): "experts.down_proj",
             ("fc1", "bias"): "experts.gate_up_proj_bias", ("fc2", "bias"): "experts.down_proj_bias"}
    for key, tensors in per_expert.items():
        if -1 in tensors:
            if len(tensors) > 1:
                raise ValueError(f"{key}: both a single grouped tensor and per-expert tensors")
            out[names[key]] = tensors[-1]
            continue
        idx = sorted(tensors)
        if idx != list(range(len(idx))):
            raise ValueError(f"expert indices of {key} are not 0..{len(idx) - 1}: {idx}")
        out[names[key]] = torch.stack([tensors[i] for i in idx])
    if "experts.gate_up_proj" not in out:
        raise ValueError(f"no Megatron expert weights under prefix {prefix!r}")
    counts = {found[key][0]: out[names[key]].shape[0] for key in per_expert}
    if len(set(counts.values())) > 1:
        raise ValueError(f"Megatron expert tensors under prefix {prefix!r} hold different numbers of experts: "
                         + ", ".join(f"{n} ({c} experts)" for n, c in counts.items()))
    return out


def mok_to_megatron_state_dict(sd: dict, prefix: str = "", layout: str = "grouped") -> dict:
    """Inverse of megatron_to_mok_state_dict. layout: "grouped" (TEGroupedMLP,
    `experts.linear_fc1.weight{i}`), "grouped_single" (TEGroupedMLP with
    moe_single_grouped_weight/bias: `experts.linear_fc1.weight` [E, 2I, H]) or
    "sequential" (SequentialMLP)."""
    if layout not in ("grouped", "grouped_single", "sequential"):
        raise ValueError(f"layout must be 'grouped', 'grouped_single' or 'sequential', got {layout!r}")
    out = {}
    per = {"experts.gate_up_proj": ("1", "weight"), "experts.down_proj": ("2", "weight"),
           "experts.gate_up_proj_bias": ("1", "bias"), "experts.down_proj_bias": ("2", "bias")}
    for k, v in sd.items():
        if k in per and layout == "grouped_single":
            fc, kind = per[k]
            out[prefix + f"experts.linear_fc{fc}.{kind}"] = v
        elif k in per:
            fc, kind = per[k]
            for i, t in enumerate(v.unbind(0)):
                name = (f"experts.linear_fc{fc}.{kind}{i}" if layout == "grouped"
                        else f"experts.local_experts.{i}.linear_fc{fc}.{kind}")
                out[prefix + name] = t
        elif k in ("router.weight", "router.bias"):
            out[prefix + k] = v
        elif k == "router.e_score_correction_bias":
            out[prefix + "router.expert_bias"] = v
        elif k == "shared_expert_gate.weight":
            out[prefix + "shared_experts.gate_weight"] = v
        elif k == "shared_expert.down_proj.weight":
            out[prefix + "shared_experts.linear_fc2.weight"] = v
    halves = [k for k in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight") if k in sd]
    if len(halves) == 1:
        raise ValueError(f"mok_to_megatron_state_dict: the shared expert has {halves[0]!r} but not its other half "
                         f"(gate_proj and up_proj together make Megatron's linear_fc1)")
    if "shared_expert.gate_proj.weight" in sd:
        out[prefix + "shared_experts.linear_fc1.weight"] = torch.cat(
            [sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]], dim=0)
    return out


# --------------------------------------------------------------------------
# The Megatron layer (only with megatron-core installed)
# --------------------------------------------------------------------------

try:
    from megatron.core.transformer.moe.moe_layer import MoELayer as _MoELayer
    HAVE_MEGATRON = True
except ImportError:  # megatron-core is optional; the pure functions above work without it
    _MoELayer = None
    HAVE_MEGATRON = False


def _require_megatron():
    if not HAVE_MEGATRON:
        raise ImportError("mok_nn.integrations.megatron needs megatron-core (0.19): pip install megatron-core")


BACKENDS = ops.BACKENDS


def choose_backend(requested: str, x: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: str, ep_size: int = 1) -> str:
    """mok_nn.ops.resolve_backend for this layer: the fused kernels where they run these inputs, else the portable
    backend; with expert parallelism (the Megatron layer's own group) the portable backend, whose exchange runs
    over torch.distributed. requested='cuda' raises instead of falling back."""
    if ep_size > 1 and requested == "cuda":
        raise RuntimeError("mok_backend='cuda' cannot run this layer: its expert parallelism runs on the portable "
                           "backend")
    if ep_size > 1 and requested == "auto":
        return "torch"
    return ops.resolve_backend(requested, x, topk_ids, gate_up, down, activation, label="mok_backend")


if HAVE_MEGATRON:

    class MoKMegatronMoELayer(_MoELayer):
        """Megatron MoELayer whose routed path (dispatch, experts, combine) runs on mok_nn.

        Extra keyword argument: mok_backend ("auto" | "cuda" | "torch" | "reference")."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                     is_mtp_layer=False, name=None, mok_backend: str = "auto"):
            check_config(config)
            if mok_backend not in BACKENDS:
                raise ValueError(f"mok_backend must be one of {BACKENDS}, got {mok_backend!r}")
            super().__init__(config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
            self.mok_backend = mok_backend
            self.mok_activation, self.mok_swiglu_limit = expert_activation(config)
            _local_expert_tensors(self.experts)       # fail now on an unknown experts module

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            from mok_nn import functional
            from mok_nn.autograd import MoKFunction

            if intermediate_tensors is not None:
                raise NotImplementedError("partial CUDA-graph capture of the MoE layer is not supported with mok_nn")
            if padding_mask is not None:
                padding_mask = padding_mask.transpose(0, 1).bool()
            shape = hidden_states.shape
            shared = self.shared_experts_compute(hidden_states) if self.use_shared_expert else None
            probs, routing_map = self.route(hidden_states, padding_mask)
            top_k = self.config.moe_router_topk
            topk_ids, topk_weights = topk_from_routing_map(probs, routing_map, top_k)
            gate_up, down, gate_up_bias, down_bias = stack_expert_weights(self.experts)
            x = hidden_states.reshape(-1, shape[-1]).contiguous()
            ep_size = self.ep_group.size()
            backend = choose_backend(self.mok_backend, x, topk_ids, gate_up, down, self.mok_activation, ep_size)
            workspace = functional.get_workspace(
                hidden_size=shape[-1], intermediate_size=down.shape[-1], num_experts=self.config.num_moe_experts,
                top_k=top_k, ep_group=self.ep_group if ep_size > 1 else None, device=x.device,
                dtype=x.dtype, backend=backend, activation=self.mok_activation,
                swiglu_limit=self.mok_swiglu_limit)
            y = MoKFunction.apply(x, topk_weights, gate_up.to(x.dtype), down.to(x.dtype), gate_up_bias, down_bias,
                                  topk_ids, workspace).view(shape)
            if shared is not None:
                y = y + shared
            return y, None

else:
    MoKMegatronMoELayer = None


def to_mok_moe_spec(builder, mok_backend: str = "auto"):
    """A Megatron MoE module spec (0.19: functools.partial(MoELayer, submodules=...))
    with MoELayer replaced by MoKMegatronMoELayer; same submodules, so the same
    parameters and checkpoint layout."""
    _require_megatron()
    if not isinstance(builder, functools.partial) or not (
            isinstance(builder.func, type) and issubclass(builder.func, _MoELayer)):
        raise TypeError(f"expected functools.partial(MoELayer, ...), got {builder!r}")
    return functools.partial(MoKMegatronMoELayer, *builder.args, **{**builder.keywords, "mok_backend": mok_backend})


def get_mok_moe_module_spec(use_te: bool | None = True, num_experts: int | None = None,
                            moe_grouped_gemm: bool | None = False, mok_backend: str = "auto"):
    """Megatron's get_moe_module_spec(...) with the routed path on mok_nn."""
    _require_megatron()
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    return to_mok_moe_spec(get_moe_module_spec(use_te=use_te, num_experts=num_experts,
                                               moe_grouped_gemm=moe_grouped_gemm), mok_backend)
