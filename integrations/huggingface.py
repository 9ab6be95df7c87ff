"""Patch the MoE blocks of a transformers model with mok_nn.

`patch_model(model)` replaces, in place, every supported MoE block by a
`MoKHFBlock`: a thin module that owns a `MoKMoELayer` (the weights carried
over) and keeps what the surrounding model code relies on:

- the block's return value (GPT-OSS returns `(hidden, router_scores)`),
- router-logit capture for `output_router_logits` (and so the aux loss):
  transformers collects router logits with forward hooks; the block passes
  the layer's logits through a small probe module that carries such a hook,
- state-dict keys and tensor layouts: `state_dict()` of a patched model has
  exactly the keys, shapes and values of the original one, and
  `load_state_dict` takes an original state dict, so `save_pretrained` /
  `from_pretrained` + `patch_model` round trips work.

Supported (transformers 5.x, fused 3-D experts): Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V3, GPT-OSS. Other blocks are left as they are, with a log line
saying why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["patch_model", "MoKHFBlock", "SUPPORTED_BLOCKS", "PatchError"]


class PatchError(ValueError):
    """A model or an explicit target cannot be patched."""


# --------------------------------------------------------------------------
# Weight layouts.  mok_nn: gate_up_proj [E, 2I, H] with rows [gate | up],
# down_proj [E, H, I].  GPT-OSS stores gate_up_proj [E, H, 2I] with gate and
# up interleaved along 2I (gate at even, up at odd columns), its bias [E, 2I]
# interleaved likewise, and down_proj [E, I, H].
# --------------------------------------------------------------------------

def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] along `dim` (>= 0) -> [g0, g1, ..., u0, u1, ...]."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `deinterleave`: [gate | up] halves -> alternating gate, up."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


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
    """One tensor of a block: its name in the layer, in the HF block, and the layout maps."""
    mok: str
    hf: str
    to_mok: Callable[[torch.Tensor], torch.Tensor] = _identity
    to_hf: Callable[[torch.Tensor], torch.Tensor] = _identity
    expert_dim: bool = False      # leading dim indexes experts (sharded under EP)


# --------------------------------------------------------------------------
# Block families
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Family:
    name: str
    router_attr: str                 # router submodule of the HF block
    shared_attr: str | None = None   # shared expert MLP (gate_proj/up_proj/down_proj)
    shared_gate_attr: str | None = None
    returns_scores: bool = False     # block returns (hidden, router_scores)
    gpt_oss: bool = False


_FAMILIES = {
    "MixtralSparseMoeBlock": _Family("mixtral", "gate"),
    "Qwen2MoeSparseMoeBlock": _Family("qwen2_moe", "gate", "shared_expert", "shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": _Family("qwen3_moe", "gate"),
    "OlmoeSparseMoeBlock": _Family("olmoe", "gate"),
    "DeepseekV3MoE": _Family("deepseek_v3", "gate", "shared_experts"),
    "GptOssMLP": _Family("gpt_oss", "router", returns_scores=True, gpt_oss=True),
}
SUPPORTED_BLOCKS = tuple(_FAMILIES)


def _expert_keys(fam: _Family) -> list[_Key]:
    if fam.gpt_oss:
        return [
            _Key("experts.gate_up_proj", "experts.gate_up_proj", _gpt_oss_gate_up_to_mok,
                 _gpt_oss_gate_up_to_hf, True),
            _Key("experts.gate_up_proj_bias", "experts.gate_up_proj_bias", _gpt_oss_bias_to_mok,
                 _gpt_oss_bias_to_hf, True),
            _Key("experts.down_proj", "experts.down_proj", _transpose_12, _transpose_12, True),
            _Key("experts.down_proj_bias", "experts.down_proj_bias", expert_dim=True),
        ]
    return [_Key("experts.gate_up_proj", "experts.gate_up_proj", expert_dim=True),
            _Key("experts.down_proj", "experts.down_proj", expert_dim=True)]


def _keys(fam: _Family) -> list[_Key]:
    r = fam.router_attr
    keys = [_Key("router.weight", f"{r}.weight"), *_expert_keys(fam)]
    if fam.name == "deepseek_v3":
        keys.append(_Key("router.e_score_correction_bias", f"{r}.e_score_correction_bias"))
    if fam.gpt_oss:
        keys.append(_Key("router.bias", f"{r}.bias"))
    if fam.shared_attr:
        keys += [_Key(f"shared_expert.{p}.weight", f"{fam.shared_attr}.{p}.weight")
                 for p in ("gate_proj", "up_proj", "down_proj")]
    if fam.shared_gate_attr:
        keys.append(_Key("shared_expert_gate.weight", f"{fam.shared_gate_attr}.weight"))
    return keys


def _unsupported_reason(block: nn.Module, fam: _Family) -> str | None:
    """Why this block's configuration cannot be expressed by MoKMoELayer, or None."""
    experts = getattr(block, "experts", None)
    router = getattr(block, fam.router_attr, None)
    if isinstance(experts, nn.ModuleList):
        return "experts stored as a ModuleList (transformers 4.x layout); only the fused 3-D layout of transformers 5.x is supported"
    if experts is None or router is None or not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return "unexpected block structure (no fused experts.gate_up_proj or no router)"
    cfg = getattr(experts, "config", None)
    act = getattr(cfg, "hidden_act", "silu")
    if not fam.gpt_oss and act not in ("silu", "swish"):
        return f"hidden_act={act!r} (only silu-gated experts are supported)"
    if getattr(block, "jitter_noise", 0.0):
        return f"router_jitter_noise={block.jitter_noise} (input jitter is not supported)"
    if fam.gpt_oss and abs(float(getattr(experts, "alpha", 1.702)) - 1.702) > 1e-6:
        return f"swiglu_alpha={experts.alpha} (the GPT-OSS activation is fixed at alpha=1.702)"
    if fam.name == "deepseek_v3":
        e, g = router.num_experts, router.num_group
        if g and (e % g or e // g < 2):
            return f"n_group={g} does not split {e} experts into groups of >= 2"
    if fam.shared_attr:
        mlp = getattr(block, fam.shared_attr, None)
        if mlp is None or getattr(getattr(mlp, "act_fn", None), "__class__", None).__name__ not in (
                "SiLUActivation", "SiLU"):
            return "shared expert is not a silu-gated MLP"
    return None


def _layer_kwargs(block: nn.Module, fam: _Family) -> dict:
    """MoKMoELayer constructor arguments describing this HF block."""
    experts, router = block.experts, getattr(block, fam.router_attr)
    num_experts, h = experts.gate_up_proj.shape[0], router.weight.shape[1]
    inter = experts.down_proj.shape[1] if fam.gpt_oss else experts.down_proj.shape[2]
    kw = dict(hidden_size=h, intermediate_size=inter, num_experts=num_experts, top_k=router.top_k,
              score_func="softmax", norm_topk_prob=True)
    if fam.name in ("qwen2_moe", "qwen3_moe", "olmoe"):
        kw["norm_topk_prob"] = bool(router.norm_topk_prob)
    if fam.name == "deepseek_v3":
        kw.update(score_func="sigmoid", norm_topk_prob=bool(router.norm_topk_prob),
                  n_group=router.num_group, topk_group=router.topk_group,
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
    """Identity on the router logits.  transformers records router logits with a
    forward hook on the router module; the patched block has no such module,
    so this probe carries the hook instead."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _install_router_logits_hook(probe: nn.Module) -> bool:
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


# --------------------------------------------------------------------------
# The patched block
# --------------------------------------------------------------------------

class MoKHFBlock(nn.Module):
    """A transformers MoE block computed by a `MoKMoELayer` (`self.moe`).

    State dict: keys, shapes and layout of the original block (hooks translate
    to and from the layer's own names)."""

    def __init__(self, moe: nn.Module, family: _Family, original_class: str,
                 ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        self.moe = moe
        self.router_logits_probe = RouterLogitsProbe()
        self.family = family
        self.original_class = original_class
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self._keys = [k for k in _keys(family) if _has_tensor(moe, k.mok)]
        self._register_state_dict_hook(MoKHFBlock._to_hf_hook)
        self._register_load_state_dict_pre_hook(self._from_hf_hook, with_module=False)

    # -- forward -----------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor):
        y = self.moe(hidden_states.contiguous())
        logits = self.router_logits_probe(self.moe.router_logits)
        if self.family.returns_scores:
            # GPT-OSS also returns the top-k routing weights [T, k] (unused by its decoder layer)
            with torch.no_grad():
                top = torch.topk(logits.float(), self.moe.top_k, dim=-1).values
                scores = torch.softmax(top, dim=-1)
            return y, scores.to(y.dtype)
        return y

    # -- state dict translation ----------------------------------------------
    def hf_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t) -> dict:
        """{HF name: fn(tensor) in HF layout} for this block's layer tensors (e.g. fn=lambda p: p.grad)."""
        out = {}
        for k in self._keys:
            t = fn(_get_tensor(self.moe, k.mok))
            out[k.hf] = None if t is None else k.to_hf(t)
        return out

    @staticmethod
    def _to_hf_hook(module, state_dict, prefix, local_metadata):
        for k in module._keys:
            src = prefix + "moe." + k.mok
            if src in state_dict:
                state_dict[prefix + k.hf] = k.to_hf(state_dict.pop(src))
        return state_dict

    def _from_hf_hook(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for k in self._keys:
            src = prefix + k.hf
            if src not in state_dict:
                continue
            t = k.to_mok(state_dict.pop(src))
            if k.expert_dim and self.ep_size > 1:
                local = _get_tensor(self.moe, k.mok).shape[0]
                if t.shape[0] == local * self.ep_size:     # a full checkpoint: keep this rank's shard
                    t = t[self.ep_rank * local:(self.ep_rank + 1) * local]
            state_dict[prefix + "moe." + k.mok] = t

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


def _patch_block(block: nn.Module, fam: _Family, *, precision, config, ep_group, backend):
    from mok_nn import MoKMoELayer

    experts = block.experts
    kwargs = dict(_layer_kwargs(block, fam), precision=precision, backend=backend,
                  ep_group=ep_group, dtype=experts.gate_up_proj.dtype,
                  device=experts.gate_up_proj.device)
    if config is not None:
        kwargs["config"] = config
    layer = MoKMoELayer(**kwargs)

    rank, size = _ep_rank_size(ep_group)
    for k in _keys(fam):
        if not _has_tensor(layer, k.mok):
            raise PatchError(f"MoKMoELayer has no tensor {k.mok!r}, needed for {type(block).__name__}")
        target, src = _get_tensor(layer, k.mok), _get_tensor(block, k.hf)
        shard = k.expert_dim and size > 1
        if k.to_mok is _identity and not shard:
            value = src  # same layout: share the original tensor (no copy; requires_grad kept)
        else:
            value = k.to_mok(src.detach())
            if shard:
                local = target.shape[0]
                value = value[rank * local:(rank + 1) * local].clone()
            if isinstance(target, nn.Parameter):
                value = nn.Parameter(value, requires_grad=src.requires_grad)
        if tuple(value.shape) != tuple(target.shape):
            raise PatchError(f"{type(block).__name__}.{k.hf}: shape {tuple(value.shape)} does not map "
                             f"onto MoKMoELayer {k.mok} {tuple(target.shape)}")
        mod_name, _, attr = k.mok.rpartition(".")
        mod = layer.get_submodule(mod_name) if mod_name else layer
        if isinstance(target, nn.Parameter):
            setattr(mod, attr, value)
        else:
            mod._buffers[attr] = value.detach()
    layer.train(block.training)
    return MoKHFBlock(layer, fam, type(block).__name__, rank, size)


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------

def _looks_like_moe(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return ("moe" in name or "sparse" in name or "mixture" in name) and hasattr(module, "experts")


def patch_model(model: nn.Module, *, precision: str = "bf16", config=None, ep_group=None,
                backend: str = "auto", targets: Iterable[str] | None = None) -> nn.Module:
    """Replace, in place, the supported MoE blocks of a transformers model by
    MoKMoELayer-backed blocks and return the model.

    precision, config, ep_group, backend: passed to every MoKMoELayer.
    targets: module names (as in `model.named_modules()`) or block class names to
      patch; each must name at least one supported, patchable block, else
      PatchError.  None: every supported block; unsupported MoE blocks are left
      as they are and logged.
    Raises PatchError when nothing can be patched.
    """
    if precision == "mxfp8":
        raise NotImplementedError(
            "precision='mxfp8' for patched transformers models is not implemented yet "
            "(it needs mok_nn.mxfp8 / mok_nn.checkpoint)")
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
        reason = _unsupported_reason(module, fam)
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

    capture_ok = True
    for name, module, fam in plan:
        new = _patch_block(module, fam, precision=precision, config=config,
                           ep_group=ep_group, backend=backend)
        capture_ok &= _install_router_logits_hook(new.router_logits_probe)
        if name:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        else:
            raise PatchError("the model itself is an MoE block; patch the model that contains it")
        logger.info("mok_nn: patched %s (%s)", name, type(module).__name__)
    if not capture_ok:
        logger.warning("mok_nn: this transformers version has no output-capturing hook; "
                       "output_router_logits will not see the patched blocks")
    if ep_group is not None and _ep_rank_size(ep_group)[1] > 1:
        logger.warning("mok_nn: with ep_group, state_dict() holds this rank's experts only; "
                       "gather them before save_pretrained")
    return model
