"""Patch the MoE blocks of a transformers model with mok_nn.

`patch_model(model)` replaces, in place, every supported MoE block by a
`MoKHFBlock`: a thin module that owns a `MoKMoELayer` (`.mok`, the weights
carried over) and keeps what the surrounding model code relies on:

- the block's return value (GPT-OSS returns `(hidden, router_scores)`; in
  transformers 4.x Mixtral/Qwen/OLMoE blocks return `(hidden, router_logits)`),
- router-logit capture for `output_router_logits` (and so the aux loss):
  transformers 5.x records router logits with forward hooks on the router;
  the patched block passes the layer's logits through a small probe module
  carrying such a hook.  transformers 4.x matches modules by class, so there
  the patched block (or GPT-OSS's probe) is an instance of the original class,
- state-dict keys and tensor layouts: `state_dict()` of a patched model has
  exactly the keys, shapes and values of the original one, and
  `load_state_dict` takes an original state dict, so `save_pretrained` /
  `from_pretrained` + `patch_model` round trips work.

Supported: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, in
transformers 5.x (fused 3-D experts) and 4.5x (ModuleList experts). Other
blocks are left as they are, with a log line saying why.

Importing this module also registers mok_nn in transformers 5.x's experts
registry (`experts_implementation="mok"`, see hf_experts.py), the other way in:
the model keeps its own blocks and router and only the routed experts run on
mok_nn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["patch_model", "MoKHFBlock", "SUPPORTED_BLOCKS", "PatchError",
           "save_mxfp8_checkpoint", "load_mxfp8_checkpoint", "register"]


class PatchError(ValueError):
    """A model or an explicit target cannot be patched."""


# --------------------------------------------------------------------------
# Weight layouts.  mok_nn: gate_up_proj [E, 2I, H] with rows [gate | up],
# down_proj [E, H, I].  GPT-OSS stores gate_up_proj [E, H, 2I] with gate and
# up interleaved along 2I (gate at even, up at odd columns), its bias [E, 2I]
# interleaved likewise, and down_proj [E, I, H].  transformers 4.x keeps one
# gated MLP per expert (gate / up / down nn.Linear weights).
# --------------------------------------------------------------------------

def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] along `dim` (>= 0) -> [g0, g1, ..., u0, u1, ...]."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `deinterleave`: [gate | up] halves -> alternating gate, up."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _gpt_oss_gate_up_to_mok(t):   # [E, H, 2I] interleaved -> [E, 2I, H] halves
    return deinterleave(t.transpose(1, 2), 1).contiguous()


def _gpt_oss_gate_up_to_hf(t):    # [E, 2I, H] halves -> [E, H, 2I] interleaved
    return interleave(t, 1).transpose(1, 2).contiguous()


def _gpt_oss_bias_to_mok(t):      # [E, 2I] interleaved -> halves
    return deinterleave(t, 1).contiguous()


def _gpt_oss_bias_to_hf(t):
    return interleave(t, 1).contiguous()


def _transpose_12(t):             # down_proj [E, I, H] <-> [E, H, I]
    return t.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class _Key:
    """One tensor of the layer and the HF tensor(s) it comes from.
    to_mok: [HF tensors] -> layer tensor; to_hf: layer tensor -> [HF tensors]."""
    mok: str
    hf: tuple[str, ...]
    to_mok: Callable[[list], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list]
    same_layout: bool = False     # one HF tensor in the layer's layout: the layer can share it
    expert_dim: bool = False      # one full [E, ...] HF tensor, sliced to the local experts under EP


def _one(mok, hf, to_mok=None, to_hf=None, expert_dim=False) -> _Key:
    if to_mok is None:
        return _Key(mok, (hf,), lambda ts: ts[0], lambda t: [t], True, expert_dim)
    return _Key(mok, (hf,), lambda ts: to_mok(ts[0]), lambda t: [to_hf(t)], False, expert_dim)


def _stacked(mok, names: list[str]) -> _Key:
    """Per-expert 2-D tensors (transformers 4.x) <-> one [E, ...] tensor."""
    return _Key(mok, tuple(names), lambda ts: torch.stack(ts), lambda t: list(t.unbind(0)))


def _stacked_gate_up(mok, gates: list[str], ups: list[str]) -> _Key:
    """Per-expert gate [I, H] and up [I, H] weights <-> gate_up_proj [E, 2I, H]."""
    n = len(gates)

    def to_mok(ts):
        return torch.stack([torch.cat([ts[i], ts[n + i]], dim=0) for i in range(n)])

    def to_hf(t):
        gate, up = t.chunk(2, dim=1)
        return list(gate.unbind(0)) + list(up.unbind(0))

    return _Key(mok, tuple(gates) + tuple(ups), to_mok, to_hf)


# --------------------------------------------------------------------------
# Block families
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Family:
    name: str
    router_attr: str                 # router submodule of the HF block
    shared_attr: str | None = None   # shared expert MLP (gate_proj/up_proj/down_proj)
    shared_gate_attr: str | None = None
    gpt_oss: bool = False


_FAMILIES = {
    "MixtralSparseMoeBlock": _Family("mixtral", "gate"),
    "Qwen2MoeSparseMoeBlock": _Family("qwen2_moe", "gate", "shared_expert", "shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": _Family("qwen3_moe", "gate"),
    "OlmoeSparseMoeBlock": _Family("olmoe", "gate"),
    "DeepseekV3MoE": _Family("deepseek_v3", "gate", "shared_experts"),
    "GptOssMLP": _Family("gpt_oss", "router", gpt_oss=True),
}
SUPPORTED_BLOCKS = tuple(_FAMILIES)


def _is_list_layout(block: nn.Module) -> bool:
    """transformers 4.x: experts as an nn.ModuleList of gated MLPs."""
    return isinstance(getattr(block, "experts", None), nn.ModuleList)


def _mlp_names(mlp: nn.Module) -> tuple[str, str, str]:
    """(gate, up, down) projection names of a gated MLP (Mixtral 4.x: w1, w3, w2)."""
    return ("w1", "w3", "w2") if hasattr(mlp, "w1") else ("gate_proj", "up_proj", "down_proj")


def _expert_keys(block: nn.Module, fam: _Family, local: range) -> list[_Key]:
    if fam.gpt_oss:
        return [
            _one("experts.gate_up_proj", "experts.gate_up_proj", _gpt_oss_gate_up_to_mok,
                 _gpt_oss_gate_up_to_hf, True),
            _one("experts.gate_up_proj_bias", "experts.gate_up_proj_bias", _gpt_oss_bias_to_mok,
                 _gpt_oss_bias_to_hf, True),
            _one("experts.down_proj", "experts.down_proj", _transpose_12, _transpose_12, True),
            _one("experts.down_proj_bias", "experts.down_proj_bias", expert_dim=True),
        ]
    if _is_list_layout(block):
        # names carry global expert indices: they select this rank's experts
        g, u, d = _mlp_names(block.experts[0])
        return [_stacked_gate_up("experts.gate_up_proj", [f"experts.{e}.{g}.weight" for e in local],
                                 [f"experts.{e}.{u}.weight" for e in local]),
                _stacked("experts.down_proj", [f"experts.{e}.{d}.weight" for e in local])]
    return [_one("experts.gate_up_proj", "experts.gate_up_proj", expert_dim=True),
            _one("experts.down_proj", "experts.down_proj", expert_dim=True)]


def _keys(block: nn.Module, fam: _Family, local: range) -> list[_Key]:
    r = fam.router_attr
    keys = [_one("router.weight", f"{r}.weight"), *_expert_keys(block, fam, local)]
    if fam.name == "deepseek_v3":
        keys.append(_one("router.e_score_correction_bias", f"{r}.e_score_correction_bias"))
    if fam.gpt_oss:
        keys.append(_one("router.bias", f"{r}.bias"))
    if fam.shared_attr:
        keys += [_one(f"shared_expert.{p}.weight", f"{fam.shared_attr}.{p}.weight")
                 for p in ("gate_proj", "up_proj", "down_proj")]
    if fam.shared_gate_attr:
        keys.append(_one("shared_expert_gate.weight", f"{fam.shared_gate_attr}.weight"))
    return keys


def _is_silu(act) -> bool:
    return type(act).__name__ in ("SiLUActivation", "SiLU") or getattr(act, "__name__", "") == "silu"


def _num_experts(block: nn.Module) -> int:
    experts = block.experts
    return len(experts) if isinstance(experts, nn.ModuleList) else experts.gate_up_proj.shape[0]


def _unsupported_reason(block: nn.Module, fam: _Family) -> str | None:
    """Why this block's configuration cannot be expressed by MoKMoELayer, or None."""
    experts = getattr(block, "experts", None)
    router = getattr(block, fam.router_attr, None)
    if router is None or experts is None:
        return "unexpected block structure (no experts or no router)"
    if isinstance(experts, nn.ModuleList):
        if fam.gpt_oss or not len(experts) or not all(hasattr(experts[0], n) for n in _mlp_names(experts[0])):
            return "unexpected per-expert MLP structure"
        act = getattr(experts[0], "act_fn", None)
        if not _is_silu(act):
            return f"hidden_act: experts use {type(act).__name__}, only silu-gated experts are supported"
    elif not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return "unexpected block structure (no experts.gate_up_proj)"
    elif not fam.gpt_oss:
        act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
        if act not in ("silu", "swish"):
            return f"hidden_act={act!r} (only silu-gated experts are supported)"
    if getattr(block, "jitter_noise", 0.0):
        return f"router_jitter_noise={block.jitter_noise} (input jitter is not supported)"
    if fam.gpt_oss and abs(float(getattr(experts, "alpha", 1.702)) - 1.702) > 1e-6:
        return f"swiglu_alpha={experts.alpha} (the GPT-OSS activation is fixed at alpha=1.702)"
    if fam.name == "deepseek_v3":
        e, g = _num_experts(block), _router_groups(router)[0]
        if g and (e % g or e // g < 2):
            return f"n_group={g} does not split {e} experts into groups of >= 2"
    if fam.shared_attr:
        mlp = getattr(block, fam.shared_attr, None)
        if mlp is None or not _is_silu(getattr(mlp, "act_fn", None)):
            return "shared expert is not a silu-gated MLP"
    return None


def _precision_reason(block: nn.Module, fam: _Family, precision: str) -> str | None:
    if precision != "mxfp8":
        return None
    kw = _layer_kwargs(block, fam)
    if kw["hidden_size"] % 32 or kw["intermediate_size"] % 32:
        return (f"precision='mxfp8' needs hidden_size ({kw['hidden_size']}) and intermediate_size "
                f"({kw['intermediate_size']}) to be multiples of the MX block size 32")
    return None


def _router_groups(router) -> tuple[int | None, int | None]:
    n_group = getattr(router, "num_group", getattr(router, "n_group", None))
    return n_group, getattr(router, "topk_group", None)


def _layer_kwargs(block: nn.Module, fam: _Family) -> dict:
    """MoKMoELayer constructor arguments describing this HF block (5.x or 4.x)."""
    experts, router = block.experts, getattr(block, fam.router_attr)
    if isinstance(experts, nn.ModuleList):
        inter = getattr(experts[0], _mlp_names(experts[0])[2]).in_features
    else:
        inter = experts.down_proj.shape[1] if fam.gpt_oss else experts.down_proj.shape[2]
    top_k = getattr(router, "top_k", None) or block.top_k
    kw = dict(hidden_size=router.weight.shape[1], intermediate_size=inter, num_experts=_num_experts(block),
              top_k=top_k, score_func="softmax", norm_topk_prob=True)
    if fam.name in ("qwen2_moe", "qwen3_moe", "olmoe"):
        kw["norm_topk_prob"] = bool(getattr(router, "norm_topk_prob", getattr(block, "norm_topk_prob", None)))
    if fam.name == "deepseek_v3":
        n_group, topk_group = _router_groups(router)
        kw.update(score_func="sigmoid", norm_topk_prob=bool(router.norm_topk_prob),
                  n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=float(router.routed_scaling_factor), use_expert_bias=True)
    if fam.gpt_oss:
        # softmax over the top-k logits == softmax over all, then top-k, renormalised
        kw.update(expert_proj_bias=True, activation="swiglu_oai", swiglu_limit=float(experts.limit),
                  router_bias=True)
    if fam.shared_attr:
        kw["shared_intermediate_size"] = getattr(block, fam.shared_attr).down_proj.in_features
        kw["shared_expert_gate"] = fam.shared_gate_attr is not None
    return kw


# --------------------------------------------------------------------------
# Router-logit capture
# --------------------------------------------------------------------------

class RouterLogitsProbe(nn.Module):
    """Identity on its inputs.  transformers records router logits with a hook on
    (5.x) or a wrapper around (4.x) the router module; the patched block has no
    such module, so this probe is called with the logits instead."""

    def __init__(self):
        nn.Module.__init__(self)      # not the router class's __init__ (see _subclass)

    def forward(self, *outputs):
        return outputs[0] if len(outputs) == 1 else outputs


_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _subclass(base: type, original: type) -> type:
    """`base` made an instance of `original` too, so transformers 4.x's
    class-based output recording (isinstance) also matches the patched module."""
    key = (base, original)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"MoK{original.__name__}", (base, original), {"__module__": __name__})
    return _CLASS_CACHE[key]


def _install_router_logits_hook(probe: nn.Module) -> bool:
    """transformers 5.x: hook the probe like a router module. False where unavailable (4.x)."""
    try:
        from transformers.utils import output_capturing as oc
    except ImportError:
        return False
    install = getattr(oc, "install_output_capuring_hook", None) or getattr(
        oc, "install_output_capturing_hook", None)
    if install is None:
        return False
    install(probe, "router_logits", 0)
    return True


def _transformers_major() -> int:
    try:
        import transformers
        return int(transformers.__version__.split(".")[0])
    except (ImportError, ValueError):
        return 5


# --------------------------------------------------------------------------
# The patched block
# --------------------------------------------------------------------------

class MoKHFBlock(nn.Module):
    """A transformers MoE block computed by a `MoKMoELayer` (`self.mok`).

    State dict: keys, shapes and layout of the original block (hooks translate
    to and from the layer's own names)."""

    def __init__(self, mok: nn.Module, family: _Family, keys: list[_Key], original_class: str,
                 returns: str, probe: nn.Module, ep_rank: int = 0, ep_size: int = 1):
        nn.Module.__init__(self)      # not the original block's __init__ (4.x subclasses)
        self.mok = mok
        self.router_logits_probe = probe
        self.family = family
        self.original_class = original_class
        self.returns = returns        # "hidden" | "hidden_logits" | "hidden_topk_scores" | "hidden_dense_scores"
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self._keys = keys
        self.register_state_dict_post_hook(MoKHFBlock._to_hf_hook)
        self.register_load_state_dict_pre_hook(MoKHFBlock._from_hf_hook)

    # -- forward -----------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor):
        # the layer computes in its parameter dtype (e.g. fp32 master weights under autocast)
        dtype = self.mok.experts.weight_dtype  # (MXFP8-only experts: the dtype they dequantise to)
        y = self.mok(hidden_states.to(dtype).contiguous()).to(hidden_states.dtype)
        logits = self.mok.router_logits
        if self.returns == "hidden_dense_scores":          # GPT-OSS, transformers 4.x
            scores = self._dense_scores(logits)
            self.router_logits_probe(scores, None)
            return y, scores
        self.router_logits_probe(logits)
        if self.returns == "hidden_logits":                # Mixtral/Qwen/OLMoE, transformers 4.x
            return y, logits
        if self.returns == "hidden_topk_scores":           # GPT-OSS, transformers 5.x: [T, k] weights
            with torch.no_grad():
                scores = torch.softmax(torch.topk(logits.float(), self.mok.top_k, dim=-1).values, dim=-1)
            return y, scores.to(y.dtype)
        return y

    def _dense_scores(self, logits):
        """[T, E] with the softmax of the top-k logits at the chosen experts, 0 elsewhere."""
        top = torch.topk(logits, self.mok.top_k, dim=-1)
        return torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, dim=-1))

    # -- state dict translation ----------------------------------------------
    def hf_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t) -> dict:
        """{HF name: fn(tensor) in HF layout} for this block's layer tensors (e.g. fn=lambda p: p.grad)."""
        out = {}
        for k in self._keys:
            t = fn(_get_tensor(self.mok, k.mok))
            out.update(zip(k.hf, [None] * len(k.hf) if t is None else k.to_hf(t)))
        return out

    @staticmethod
    def _to_hf_hook(module, state_dict, prefix, local_metadata):
        for k in module._keys:
            src = prefix + "mok." + k.mok
            if src in state_dict:
                for name, t in zip(k.hf, k.to_hf(state_dict.pop(src))):
                    state_dict[prefix + name] = t

    @staticmethod
    def _from_hf_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for k in module._keys:
            names = [prefix + n for n in k.hf]
            if not all(n in state_dict for n in names):
                continue          # left for load_state_dict to report as missing
            t = k.to_mok([state_dict.pop(n) for n in names])
            if k.expert_dim and module.ep_size > 1:
                local = _get_tensor(module.mok, k.mok).shape[0]
                if t.shape[0] == local * module.ep_size:     # a full checkpoint: keep this rank's shard
                    t = t[module.ep_rank * local:(module.ep_rank + 1) * local]
            state_dict[prefix + "mok." + k.mok] = t
        if module.ep_size > 1:      # other ranks' experts of a full 4.x checkpoint are not ours
            for n in [n for n in state_dict if n.startswith(prefix + "experts.")]:
                state_dict.pop(n)

    def extra_repr(self) -> str:
        return f"patched {self.original_class}"


def _get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(mod_name) if mod_name else module, attr)


def _has_tensor(module: nn.Module, name: str) -> bool:
    try:
        return isinstance(_get_tensor(module, name), torch.Tensor)
    except AttributeError:
        return False


# --------------------------------------------------------------------------
# Building one patched block
# --------------------------------------------------------------------------

def _ep_rank_size(ep_group) -> tuple[int, int]:
    if ep_group is None:
        return 0, 1
    import torch.distributed as dist
    return dist.get_rank(ep_group), dist.get_world_size(ep_group)


# --------------------------------------------------------------------------
# Router logits in the model's dtype (router_dtype)
# --------------------------------------------------------------------------

_ROUTER_CLASSES: dict[type, type] = {}


def _router_in_dtype(router: nn.Module, dtype: torch.dtype) -> None:
    """Make the layer's router compute its logits in `dtype` (x and W cast to it,
    as transformers' routers do in the model's dtype), then widen them to fp32
    for mok_nn's routing.  The instance keeps its parameters and state-dict keys."""
    base = type(router)
    if base not in _ROUTER_CLASSES:
        def forward(self, x2d):
            from mok_nn.reference import compute_dtype

            dt = self.logits_dtype
            bias = None if self.bias is None else self.bias.to(dt)
            return nn.functional.linear(x2d.to(dt), self.weight.to(dt), bias).to(compute_dtype(x2d.dtype))

        _ROUTER_CLASSES[base] = type(f"{base.__name__}InDtype", (base,), {"forward": forward, "__module__": __name__})
    router.__class__ = _ROUTER_CLASSES[base]
    router.logits_dtype = dtype


def _original_router_dtype(block: nn.Module, fam: _Family) -> torch.dtype:
    """The dtype the original block's router computes its logits in."""
    if fam.name == "deepseek_v3":
        return torch.float32      # DeepseekV3TopkRouter casts x and W to fp32
    return getattr(block, fam.router_attr).weight.dtype


def _patch_block(block: nn.Module, fam: _Family, tf_major: int, *, precision, config, ep_group, backend,
                 router_dtype=None):
    from mok_nn import MoKMoELayer

    router = getattr(block, fam.router_attr)
    some = next(iter(block.experts.parameters()))
    kwargs = dict(_layer_kwargs(block, fam), precision=precision, backend=backend,
                  ep_group=ep_group, dtype=some.dtype, device=some.device)
    if config is not None:
        kwargs["config"] = config
    layer = MoKMoELayer(**kwargs)

    rank, size = _ep_rank_size(ep_group)
    local = range(rank * layer.num_local_experts, (rank + 1) * layer.num_local_experts)
    keys = _keys(block, fam, local)
    for k in keys:
        if not _has_tensor(layer, k.mok):
            raise PatchError(f"MoKMoELayer has no tensor {k.mok!r}, needed for {type(block).__name__}")
        target = _get_tensor(layer, k.mok)
        srcs = [_get_tensor(block, n) for n in k.hf]
        shard = k.expert_dim and size > 1
        if k.same_layout and not shard:
            value = srcs[0]  # share the original tensor (no copy; requires_grad kept)
        else:
            value = k.to_mok([s.detach() for s in srcs])
            if shard:
                value = value[local.start:local.stop].clone()
            if isinstance(target, nn.Parameter):
                value = nn.Parameter(value, requires_grad=srcs[0].requires_grad)
        if tuple(value.shape) != tuple(target.shape):
            raise PatchError(f"{type(block).__name__}.{k.hf[0]}: shape {tuple(value.shape)} does not map "
                             f"onto MoKMoELayer {k.mok} {tuple(target.shape)}")
        mod_name, _, attr = k.mok.rpartition(".")
        mod = layer.get_submodule(mod_name) if mod_name else layer
        if isinstance(target, nn.Parameter):
            setattr(mod, attr, value)
        else:
            mod._buffers[attr] = value.detach()
    layer.train(block.training)
    if router_dtype == "model":
        router_dtype = _original_router_dtype(block, fam)
    if router_dtype is not None:  # fp32 too: x and W cast to fp32 as DeepSeek-V3's router does, not mok_nn's
        _router_in_dtype(layer.router, router_dtype)  # tensor-core fp32 sums (router.router_logits) on CUDA

    # return value and router-logit capture of this transformers version
    v4 = tf_major < 5
    if fam.gpt_oss:
        returns = "hidden_dense_scores" if v4 else "hidden_topk_scores"
    elif v4 and fam.name != "deepseek_v3":
        returns = "hidden_logits"
    else:
        returns = "hidden"
    probe = _subclass(RouterLogitsProbe, type(router))() if v4 and fam.gpt_oss else RouterLogitsProbe()
    cls = _subclass(MoKHFBlock, type(block)) if v4 else MoKHFBlock
    new = cls(layer, fam, keys, type(block).__name__, returns, probe, rank, size)
    new.train(block.training)
    return new


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------

def _looks_like_moe(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return ("moe" in name or "sparse" in name or "mixture" in name) and hasattr(module, "experts")


def patch_model(model: nn.Module, *, precision: str = "bf16", config=None, ep_group=None,
                backend: str = "auto", targets: Iterable[str] | None = None,
                router_dtype: torch.dtype | str | None = None) -> nn.Module:
    """Replace, in place, the supported MoE blocks of a transformers model by
    MoKMoELayer-backed blocks and return the model.

    precision, config, ep_group, backend: passed to every MoKMoELayer.  With
      precision="mxfp8" the layer runs the expert GEMMs on MXFP8 operands (weights
      and activations quantised in each forward); the model keeps its
      full-precision master weights, which training updates.
    targets: module names (as in `model.named_modules()`) or block class names to
      patch; each must name at least one supported, patchable block, else
      PatchError.  None: every supported block; unsupported MoE blocks are left
      as they are and logged.
    router_dtype: None (default): router logits in fp32 from the block's weights,
      mok_nn's routing (on CUDA bf16 products summed in fp32 on tensor cores, whose
      rounding can differ from an fp32 GEMM's).  "model": logits in the dtype the
      original router uses (the model's dtype for Mixtral, Qwen, OLMoE and GPT-OSS; fp32 for
      DeepSeek-V3), so a bf16 model picks exactly the experts it picked before
      patching (fp32 logits can break near ties the other way).  A torch.dtype:
      logits in that dtype.  Scores, top-k and weights stay fp32 either way.
    Raises PatchError when nothing can be patched.
    """
    if precision not in ("bf16", "mxfp8"):
        raise ValueError(f"precision must be 'bf16' or 'mxfp8', got {precision!r}")
    if not (router_dtype is None or router_dtype == "model" or isinstance(router_dtype, torch.dtype)):
        raise ValueError(f"router_dtype must be None, 'model' or a torch.dtype, got {router_dtype!r}")
    wanted = None if targets is None else list(targets)
    if wanted is not None and not wanted:
        raise PatchError("targets is empty")

    plan, skipped, already = [], [], []   # (name, module, family) / (name, class, reason) / name
    for name, module in model.named_modules():
        if any(name.startswith(a + ".") for a in already):
            continue          # inside a patched block
        if isinstance(module, MoKHFBlock):
            already.append(name)
            continue
        fam = _FAMILIES.get(type(module).__name__)
        hit = wanted is None or name in wanted or type(module).__name__ in wanted
        if fam is None:
            if hit and wanted is not None:
                skipped.append((name, type(module).__name__, "not a supported MoE block "
                                f"(supported: {', '.join(SUPPORTED_BLOCKS)})"))
            elif _looks_like_moe(module) and wanted is None:
                skipped.append((name, type(module).__name__, "unsupported MoE block class"))
            continue
        if not hit:
            continue
        reason = _unsupported_reason(module, fam) or _precision_reason(module, fam, precision)
        if reason:
            skipped.append((name, type(module).__name__, reason))
        else:
            plan.append((name, module, fam))

    if wanted is not None:
        names = {n for n, _, _ in plan} | {n for n, _, _ in skipped}
        classes = {type(m).__name__ for _, m, _ in plan} | {c for _, c, _ in skipped}
        missing = [t for t in wanted if t not in names and t not in classes and t not in already]
        bad = [s for s in skipped if s[0] in wanted or s[1] in wanted]
        if missing or bad:
            lines = [f"  {t}: no such module or block class" for t in missing]
            lines += [f"  {n} ({c}): {r}" for n, c, r in bad]
            raise PatchError("cannot patch the requested targets:\n" + "\n".join(lines))

    for name, cls, reason in skipped:
        logger.warning("mok_nn: left %s (%s) unpatched: %s", name or "<root>", cls, reason)
    if not plan and already and not skipped:
        logger.info("mok_nn: %s is already patched", type(model).__name__)
        return model
    if not plan:
        if skipped:
            raise PatchError("no MoE block of this model can be patched:\n" + "\n".join(
                f"  {n} ({c}): {r}" for n, c, r in skipped))
        raise PatchError(f"{type(model).__name__} has no MoE blocks "
                         f"(supported blocks: {', '.join(SUPPORTED_BLOCKS)})")
    if any(not n for n, _, _ in plan):
        raise PatchError("the model itself is an MoE block; patch the model that contains it")

    tf_major = _transformers_major()
    capture_ok = True
    for name, module, fam in plan:
        new = _patch_block(module, fam, tf_major, precision=precision, config=config,
                           ep_group=ep_group, backend=backend, router_dtype=router_dtype)
        if tf_major >= 5:
            capture_ok &= _install_router_logits_hook(new.router_logits_probe)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        logger.info("mok_nn: patched %s (%s)", name, type(module).__name__)
    if not capture_ok:
        logger.warning("mok_nn: this transformers version has no output-capturing hook; "
                       "output_router_logits will not see the patched blocks")
    if ep_group is not None and _ep_rank_size(ep_group)[1] > 1:
        logger.warning("mok_nn: with ep_group, state_dict() holds this rank's experts only; "
                       "gather them before save_pretrained")
    return model


# --------------------------------------------------------------------------
# MXFP8 checkpoints
# --------------------------------------------------------------------------

def _patched_blocks(model: nn.Module) -> list[tuple[str, MoKHFBlock]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoKHFBlock)]


def _hf_axis(data: torch.Tensor, scale: torch.Tensor) -> int:
    """The block axis of an MXFP8 tensor: the one dimension where the scale is shorter."""
    (axis,) = [d for d in range(data.dim()) if data.shape[d] != scale.shape[d]]
    return axis


@torch.no_grad()
def save_mxfp8_checkpoint(model: nn.Module, path, metadata: dict | None = None) -> None:
    """Write the state dict of a patched model to one safetensors file in the
    mok_nn.mxfp8 format: the routed-expert weights MXFP8 (blocks of 32 along the
    GEMM reduction dim, "rceil"; in the transformers names and layouts), every
    other tensor as it is.  `load_mxfp8_checkpoint` reads it back."""
    from mok_nn import checkpoint, mxfp8

    blocks = _patched_blocks(model)
    if not blocks:
        raise PatchError("save_mxfp8_checkpoint needs a model patched with patch_model")
    tensors = dict(model.state_dict())
    for name, block in blocks:
        for k in block._keys:
            if not k.mok.endswith(("gate_up_proj", "down_proj")):
                continue          # biases, router and shared expert stay as they are
            q = mxfp8.quantize(_get_tensor(block.mok, k.mok).detach(), axis=-1)
            for hf_name, data, scale in zip(k.hf, k.to_hf(q.data.view(torch.uint8)), k.to_hf(q.scale)):
                data = data.contiguous().view(torch.float8_e4m3fn)
                tensors[f"{name}.{hf_name}"] = mxfp8.MXFP8Tensor(data, scale.contiguous(), _hf_axis(data, scale))
    checkpoint.save_mxfp8(path, tensors, metadata)


@torch.no_grad()
def load_mxfp8_checkpoint(model: nn.Module, path_or_tensors, config=None, strict: bool = True):
    """Load a checkpoint with MXFP8 (or block-FP8) weights into a patched model.

    `path_or_tensors`: a safetensors file or directory, a raw `{name: Tensor}`
    dict, or a dict returned by `mok_nn.checkpoint.load_mxfp8_tensors` (used as
    it is; `config` is then not needed).
    Formats: those of `mok_nn.checkpoint.load_mxfp8_tensors` (mok_nn.mxfp8,
    compressed-tensors and ModelOpt MXFP8, block FP8).  Names are the model's
    state-dict names; the experts of a patched block may also be stored as
    `experts.w13_weight` / `w2_weight` or per expert (`experts.<e>.w1.weight`,
    ...).  MXFP8 tensors are dequantised exactly into the model's dtype
    (MXFP8 values are representable in bf16 and fp32), so a precision="mxfp8"
    model computes on exactly the checkpoint's values.  Block FP8 read from a
    path or raw dict goes into a precision="bf16" model as `fp8 * scale_inv`
    (fp32 product, cast once to the parameter dtype); for precision="mxfp8" it
    is requantised to MXFP8 first (lossless only for power-of-two scales), as
    in a dict returned by `load_mxfp8_tensors`.  Returns
    load_state_dict's (missing_keys, unexpected_keys)."""
    from mok_nn import checkpoint, mxfp8

    blocks = _patched_blocks(model)
    if not blocks:
        raise PatchError("load_mxfp8_checkpoint needs a model patched with patch_model")
    # block FP8 (read here) is dequantised directly unless the model computes in MXFP8
    direct = all(block.mok.precision != "mxfp8" for _, block in blocks)
    tensors = checkpoint.load_mxfp8_tensors(path_or_tensors, config, dequantize_block=direct)
    own = model.state_dict()
    for name, block in blocks:                # expert weights under another naming scheme
        prefix = name + "."
        if all(prefix + n in tensors for k in block._keys for n in k.hf if "experts." in n):
            continue
        checkpoint.load_experts_into_layer(block.mok, tensors, prefix=prefix)
        for k in block._keys:
            if k.mok in ("experts.gate_up_proj", "experts.down_proj"):
                own.update({prefix + n: None for n in (*k.hf, "mok." + k.mok)})
        for n in [n for n in tensors if n.startswith(prefix) and checkpoint.is_expert_weight(n)]:
            tensors.pop(n)
    state = {}
    for n, t in tensors.items():
        like = own.get(n)
        dtype = like.dtype if isinstance(like, torch.Tensor) else None
        state[n] = t.dequantize(dtype or torch.float32) if isinstance(t, mxfp8.MXFP8Tensor) else t
    result = model.load_state_dict(state, strict=False)
    loaded_elsewhere = {n for n, v in own.items() if v is None}
    missing = [n for n in result.missing_keys if n not in loaded_elsewhere]
    if strict and (missing or result.unexpected_keys):
        raise checkpoint.CheckpointFormatError(
            f"checkpoint does not match the model: missing {missing[:8]}, unexpected {result.unexpected_keys[:8]}")
    return missing, list(result.unexpected_keys)


# --------------------------------------------------------------------------
# experts_implementation="mok"
# --------------------------------------------------------------------------

from .hf_experts import register  # noqa: E402

try:
    register()
except ImportError:       # transformers absent, or 4.x without the experts registry
    logger.debug("mok_nn: no transformers experts registry here; experts_implementation='mok' not registered")
