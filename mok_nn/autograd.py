"""MoKFunction: the routed experts as one torch.autograd.Function.

The backward is written out (see the formulas in reference.py), not taken by
autograd through the forward, so the fused kernels implement the very same
formulas and the reference path is their oracle. The router and the shared
expert stay outside, in ordinary autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import distributed, reference


@dataclass(frozen=True)
class ExpertOptions:
    """Non-tensor arguments of MoKFunction."""

    num_experts: int  # global expert count E
    activation: str = "swiglu"
    swiglu_limit: float | None = None
    ep_group: object = None
    backend: str = "reference"  # "reference" or "cuda": who runs the experts

    @property
    def ep_size(self) -> int:
        return distributed.group_size_and_rank(self.ep_group)[0]


def _cuda_backend():
    from . import cuda_backend  # imported lazily: needs the built kernels

    return cuda_backend


class MoKFunction(torch.autograd.Function):
    """y = sum_j w_tj * expert_{ids_tj}(x_t), with gradients for x, w and the expert parameters.

    apply(x [T, H], topk_weights [T, k], gate_up_proj [E_l, 2I, H], down_proj [E_l, H, I],
          gate_up_bias [E_l, 2I] | None, down_bias [E_l, H] | None, topk_ids [T, k] int64,
          options: ExpertOptions) -> y [T, H] in x.dtype
    """

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, topk_ids, options):
        args = (gate_up_proj, down_proj, gate_up_bias, down_bias, options.activation, options.swiglu_limit)
        if options.ep_size > 1:
            y, saved = distributed.ep_experts_forward(
                x, topk_ids, topk_weights, *args, options.num_experts, options.ep_group
            )
        elif options.backend == "cuda":
            y, saved = _cuda_backend().experts_forward(x, topk_ids, topk_weights, *args)
        else:
            y, saved = reference.experts_forward(x, topk_ids, topk_weights, *args)
        ctx.saved = saved
        ctx.options = options
        ctx.save_for_backward(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias = ctx.saved_tensors
        options = ctx.options
        args = (gate_up_proj, down_proj, gate_up_bias, down_bias, options.activation, options.swiglu_limit)
        grad_y = grad_y.contiguous()
        if options.ep_size > 1:
            dx, d_topk, grads = distributed.ep_experts_backward(grad_y, ctx.saved, topk_ids, topk_weights, *args)
        elif options.backend == "cuda":
            dx, d_topk, grads = _cuda_backend().experts_backward(
                grad_y, ctx.saved, x, topk_ids, topk_weights, *args
            )
        else:
            dx, d_topk, grads = reference.experts_backward(grad_y, ctx.saved, x, topk_ids, topk_weights, *args)
        return (
            dx, d_topk, grads.gate_up_proj, grads.down_proj, grads.gate_up_bias, grads.down_bias, None, None,
        )
