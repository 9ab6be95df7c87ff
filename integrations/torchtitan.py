"""Run torchtitan's MoE routed experts on mok_nn.

torchtitan (0.3, `torchtitan.models.common.moe`) builds an MoE block as

    MoE: router (TokenChoiceTopKRouter) -> routed_experts (RoutedExperts:
         token_dispatcher + inner_experts GroupedExperts) (+ shared_experts)

`swap_moe(model)` changes, in place, the class of every `RoutedExperts` of the
model to a subclass whose forward runs dispatch, the experts and the combine
on mok_nn with the ids and scores torchtitan's router chose.  Everything else
is torchtitan's own and unchanged: the router, the shared experts, the
load-balancing state of `MoE.forward` (`tokens_per_expert_E`, `expert_bias_E`
and the optimizer hook that updates it), parameter names and layouts
(`routed_experts.inner_experts.w1_EFD` / `w2_EDF` / `w3_EFD`), so checkpoints
load unchanged, and `init_states` / `parallelize` of the module.

The experts compute in bf16 as GroupedExperts does (`compute_dtype`), summing
the top-k outputs in fp32 (torchtitan adds them in bf16).  Per forward the
gate and up weights are concatenated into mok_nn's [gate; up] layout (a copy,
differentiated through).

Supported: the EP=1 token dispatcher (`LocalTokenDispatcher`) with plain
`GroupedExperts`.  Expert-parallel dispatchers (all-to-all, DeepEP, ...) and
other expert modules (e.g. low-precision `_grouped_mm` variants) are left as
they are; `swap_moe` raises `SwapError` naming them where nothing can be swapped.
"""

from __future__ import annotations

import torch
from torch import nn

from .routed import BACKENDS, routed_experts

__all__ = ["swap_moe", "SwapError", "is_swapped"]


class SwapError(ValueError):
    """A model or one of its MoE blocks cannot run on mok_nn."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
    """RoutedExperts.forward on mok_nn: the routed output (B, L, D) in x's dtype."""
    e = self.inner_experts
    dtype = self.mok_compute_dtype
    gate_up = torch.cat([_local(e.w1_EFD), _local(e.w3_EFD)], dim=1).to(dtype)   # [E, 2F, D]: gate rows, up rows
    down = _local(e.w2_EDF).to(dtype)                                            # [E, D, F]
    k = topk_expert_ids_BLK.shape[-1]
    y = routed_experts(x_BLD.reshape(-1, x_BLD.shape[-1]), topk_expert_ids_BLK.reshape(-1, k),
                       topk_scores_BLK.reshape(-1, k), gate_up, down.contiguous(),
                       backend=self.mok_backend, config=self.mok_config)
    return y.view(x_BLD.shape)


_CLASSES: dict[type, type] = {}


def _mok_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"MoK{base.__name__}", (base,), {"forward": _forward, "__module__": __name__})
    return _CLASSES[base]


def is_swapped(module: nn.Module) -> bool:
    return type(module) in _CLASSES.values()


def _unsupported_reason(routed: nn.Module) -> str | None:
    dispatcher = getattr(routed, "token_dispatcher", None)
    inner = getattr(routed, "inner_experts", None)
    if type(dispatcher).__name__ != "LocalTokenDispatcher":
        return f"token dispatcher {type(dispatcher).__name__} (only the EP=1 LocalTokenDispatcher is supported)"
    if type(inner).__name__ != "GroupedExperts" or "_grouped_mm" in vars(inner):
        return f"experts module {type(inner).__name__} (only torchtitan's bf16 GroupedExperts is supported)"
    return None


def swap_moe(model: nn.Module, *, backend: str = "auto", config=None,
             compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Run the routed experts of every torchtitan MoE block of `model` on mok_nn,
    in place; returns the model.

    backend: "auto" (mok_nn's fused kernels where they run, its portable path
      elsewhere), "cuda", or a portable backend of mok_nn.functional.
    config: a MoKConfig, or None for the defaults.
    compute_dtype: the dtype of the expert GEMMs (torchtitan's GroupedExperts: bf16).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    found, skipped = 0, []
    for name, module in model.named_modules():
        routed = getattr(module, "routed_experts", None)
        if type(module).__name__ != "MoE" or routed is None:
            continue
        found += 1
        reason = None if is_swapped(routed) else _unsupported_reason(routed)
        if reason:
            skipped.append(f"  {name or '<root>'}: {reason}")
            continue
        if not is_swapped(routed):
            routed.__class__ = _mok_class(type(routed))
        routed.mok_backend, routed.mok_config, routed.mok_compute_dtype = backend, config, compute_dtype
    if not found:
        raise SwapError(f"{type(model).__name__} has no torchtitan MoE blocks")
    if len(skipped) == found:
        raise SwapError("no MoE block of this model can run on mok_nn:\n" + "\n".join(skipped))
    if skipped:
        import logging
        logging.getLogger(__name__).warning("mok_nn: MoE blocks left on torchtitan's path:\n%s", "\n".join(skipped))
    return model
