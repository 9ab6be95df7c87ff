"""Expert parallelism on the reference path, over any torch.distributed group.

With a group of size P, rank r holds experts [r*E/P, (r+1)*E/P); tokens stay
on their rank. Each routed slot (t, j) is sent to the rank of its expert, the
expert rank computes the unweighted expert output and sends it back into the
source rank's slot [t*k + j], and the source sums the k slots in fixed order
with its top-k weights. The top-k weights never leave the source rank in the
forward, so the summation order, and with it every output bit, is the same
for every P (the only rank-dependent part is which process runs an expert).

Row order on an expert rank is fixed: received blocks are concatenated by
source rank, each block sorted by expert (stable), then regrouped by local
expert with a stable sort. Gradients of local experts stay local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .reference import ExpertGrouping, group_by_expert, grouped_mlp_backward, grouped_mlp_forward


def group_size_and_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_to_all(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single along dim 0; 16-bit floats travel as int16 (bit-exact, any backend)."""
    if group is None:
        return tensor
    send = tensor.contiguous()
    wire = send.view(torch.int16) if send.dtype in (torch.bfloat16, torch.float16) else send
    out = wire.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
    dist.all_to_all_single(out, wire, recv_splits, send_splits, group=group)
    return out.view(send.dtype) if wire is not send else out


@dataclass
class DispatchPlan:
    """Where each routed slot goes and where it lands on the expert rank.

    order: [T*k] slot ids sorted by global expert (stable): the send order.
    send_splits / recv_splits: rows per peer rank.
    local: grouping of the received rows by local expert.
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    local: ExpertGrouping
    group: object

    def dispatch(self, rows_in_send_order: torch.Tensor) -> torch.Tensor:
        """Send rows to their expert ranks; result grouped by local expert."""
        received = all_to_all(rows_in_send_order, self.send_splits, self.recv_splits, self.group)
        return received[self.local.order]

    def undispatch(self, rows_grouped: torch.Tensor) -> torch.Tensor:
        """Inverse of dispatch: rows back to their source ranks, in send order."""
        received_order = torch.empty_like(rows_grouped)
        received_order[self.local.order] = rows_grouped
        return all_to_all(received_order, self.recv_splits, self.send_splits, self.group)


def build_dispatch_plan(topk_ids: torch.Tensor, num_experts: int, group) -> DispatchPlan:
    world, _ = group_size_and_rank(group)
    experts_per_rank = num_experts // world
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    sorted_ids = flat[order]
    dest = sorted_ids // experts_per_rank
    send_counts = torch.bincount(dest, minlength=world) if flat.numel() else torch.zeros(world, dtype=torch.int64)
    send_counts = send_counts.to(torch.int64)
    if group is None:
        recv_counts = send_counts
    else:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    local_ids = all_to_all(sorted_ids - dest * experts_per_rank, send_splits, recv_splits, group)
    return DispatchPlan(order, send_splits, recv_splits, group_by_expert(local_ids, experts_per_rank), group)


@dataclass
class EPSaved:
    plan: DispatchPlan
    rows: torch.Tensor  # received token rows, grouped by local expert
    gate_up: torch.Tensor  # [N_local, 2I]


def ep_experts_forward(
    x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
    num_experts, group,
):
    """Routed experts with experts sharded over `group`. Returns (y, EPSaved)."""
    from .reference import combine_slots

    num_tokens, top_k = topk_ids.shape
    plan = build_dispatch_plan(topk_ids, num_experts, group)
    rows = plan.dispatch(x[plan.order // top_k])
    out, gate_up = grouped_mlp_forward(
        rows, plan.local.counts, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit
    )
    returned = plan.undispatch(out)
    slots = torch.empty_like(returned)
    slots[plan.order] = returned
    y = combine_slots(slots.view(num_tokens, top_k, slots.shape[-1]), topk_weights, x.dtype)
    return y, EPSaved(plan, rows, gate_up)


def ep_experts_backward(
    grad_y, saved: EPSaved, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
    activation, swiglu_limit,
):
    """Backward of ep_experts_forward. Returns (dx, d_topk_weights, GroupedMLPGrads of local experts)."""
    from .reference import sum_slots

    num_tokens, top_k = topk_ids.shape
    plan = saved.plan
    token_of_slot = plan.order // top_k
    dy_rows = plan.dispatch(grad_y.to(saved.rows.dtype)[token_of_slot])
    w_rows = plan.dispatch(topk_weights.reshape(-1)[plan.order].contiguous())
    grads = grouped_mlp_backward(
        saved.rows, dy_rows, w_rows, saved.gate_up, plan.local.counts, gate_up_proj, down_proj,
        gate_up_bias, down_bias, activation, swiglu_limit,
    )
    dx_back = plan.undispatch(grads.grad_rows)
    dw_back = plan.undispatch(grads.grad_weights)
    dx_slots = torch.empty_like(dx_back)
    dx_slots[plan.order] = dx_back
    d_topk = torch.empty_like(dw_back)
    d_topk[plan.order] = dw_back
    dx = sum_slots(dx_slots.view(num_tokens, top_k, dx_slots.shape[-1]), saved.rows.dtype)
    return dx, d_topk.view(num_tokens, top_k), grads
