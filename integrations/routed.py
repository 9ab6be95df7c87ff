"""mok_nn's routed experts on routing computed elsewhere.

The adapters that keep their framework's router (transformers' experts
registry, torchtitan) hand mok_nn the chosen expert ids and their weights;
this module runs the experts, dispatch and combine on mok_nn (`MoKFunction`
over the functional layer), forward and backward:

    y = routed_experts(x [T, H], topk_ids [T, k], topk_weights [T, k],
                       gate_up_proj [E, 2I, H], down_proj [E, H, I], backend="auto")

Layouts are mok_nn's (gate rows first, then up rows); the adapters convert.
"""

from __future__ import annotations

import torch

from mok_nn import functional, ops
from mok_nn.autograd import MoKFunction
from mok_nn.reference import compute_dtype

__all__ = ["BACKENDS", "choose_backend", "routed_experts"]

BACKENDS = ops.BACKENDS


def choose_backend(requested: str, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, activation: str) -> str:
    """The backend that runs these operands (mok_nn.ops.resolve_backend): requested, or for "auto" the fused
    kernels where they can run and the portable backend elsewhere. requested="cuda" raises RuntimeError where
    the kernels cannot run."""
    return ops.resolve_backend(requested, x, topk_ids, gate_up_proj, down_proj, activation)


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, *,
                   activation: str = "swiglu", swiglu_limit: float | None = None, backend: str = "auto",
                   config=None) -> torch.Tensor:
    """y_t = sum_j w_tj * expert_{ids_tj}(x_t), differentiable in x, the weights
    and the expert tensors.  x is computed in the experts' dtype and y returned
    in x's; the weights are combined in fp32 (exact for bf16 weights); expert
    ids must lie in [0, gate_up_proj.shape[0])."""
    dtype = gate_up_proj.dtype
    x2d = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    ids = topk_ids.reshape(x2d.shape[0], -1).to(torch.int64).contiguous()
    weights = topk_weights.reshape(ids.shape).to(compute_dtype(dtype)).contiguous()
    which = choose_backend(backend, x2d, ids, gate_up_proj, down_proj, activation)
    workspace = functional.get_workspace(
        hidden_size=x2d.shape[1], intermediate_size=down_proj.shape[2], num_experts=gate_up_proj.shape[0],
        top_k=ids.shape[1], device=x2d.device, dtype=dtype, backend=which, activation=activation,
        swiglu_limit=swiglu_limit, config=config)
    y = MoKFunction.apply(x2d, weights, gate_up_proj, down_proj, gate_up_bias, down_bias, ids, workspace)
    return y.to(x.dtype).view(x.shape)
