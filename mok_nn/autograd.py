"""MoKFunction: the routed experts as one torch.autograd.Function.

The backward is written out (see the formulas in reference.py), not taken by
autograd through the forward, so the fused kernels implement the very same
formulas and the reference path is their oracle. The router and the shared
expert stay outside, in ordinary autograd.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from . import functional
from .functional import ExpertParams, Workspace


def autocast_off(device_type: str):
    """A context without autocast on device_type: mok_nn computes in its parameter dtype (fp32
    accumulation) whatever the caller's autocast, as its explicit backward does."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta): nothing to turn off
        enabled = False
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def _split_saved(saved):
    """(tensors, rebuild): the tensor fields of a backend's saved-for-backward dataclass, and a
    function that puts them back. The tensors go through ctx.save_for_backward, so saved-tensor
    hooks (activation checkpointing, CPU offload) apply to the large expert activations."""
    if not dataclasses.is_dataclass(saved):
        return [], lambda tensors: saved
    fields = [f.name for f in dataclasses.fields(saved)]
    names = [n for n in fields if isinstance(getattr(saved, n), torch.Tensor)]
    others = {n: getattr(saved, n) for n in fields if n not in names}
    cls = type(saved)
    return [getattr(saved, n) for n in names], lambda tensors: cls(**others, **dict(zip(names, tensors)))


class MoKFunction(torch.autograd.Function):
    """y = sum_j w_tj * expert_{ids_tj}(x_t), with gradients for x, w and the expert parameters.

    apply(x [T, H], topk_weights [T, k], gate_up_proj [E_l, 2I, H], down_proj [E_l, H, I],
          gate_up_bias [E_l, 2I] | None, down_bias [E_l, H] | None, topk_ids [T, k] int64,
          workspace: functional.Workspace) -> y [T, H] in x.dtype
    """

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, topk_ids,
                workspace: Workspace):
        params = ExpertParams(gate_up_proj, down_proj, gate_up_bias, down_bias)
        with autocast_off(x.device.type):
            schedule = functional.build_schedule(topk_ids, workspace)
            y, saved = functional.forward(x, topk_ids, topk_weights, params, schedule, workspace)
        saved_tensors, ctx.rebuild_saved = _split_saved(saved)
        ctx.workspace = workspace
        ctx.save_for_backward(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                              *saved_tensors)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, *saved = ctx.saved_tensors
        params = ExpertParams(gate_up_proj, down_proj, gate_up_bias, down_bias)
        with autocast_off(grad_y.device.type):  # a backward called inside an autocast region
            dx, d_topk, grads = functional.backward(
                grad_y.contiguous(), ctx.rebuild_saved(saved), x, topk_ids, topk_weights, params, ctx.workspace
            )
        return dx, d_topk, grads.gate_up_proj, grads.down_proj, grads.gate_up_bias, grads.down_bias, None, None
