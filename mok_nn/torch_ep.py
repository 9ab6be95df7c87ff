"""The portable backend's expert-parallel exchange without a host read (the bounded exchange).

Where MoKConfig.schedule_capacity_multiplier bounds the rows one rank may send another, the rows travel in
blocks of a fixed size, so that no split size is read on the host; torch_backend.build_schedule takes this
plan (BoundedPlan) where it applies, else the reference's DispatchPlan (split sizes read on the host).
docs/portable.md, "Expert parallelism".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import distributed
from .distributed import EPError

# Each rank sends every peer a block of exactly C rows (exchange_capacity), its rows for that peer's experts
# first (sorted by global expert, then slot: the send order of the host-split path) and padding after them,
# so every all_to_all_single has equal, static splits. The per-peer counts travel as data, in the same
# all-to-all as the local expert ids of the block's rows, with each sender's largest count, token count and a
# bad-id count: every rank computes the same error flag from them. The receiver sorts the P*C received ids
# stably (padding has id E_l, past every expert), so each local expert sees its rows by (source rank, slot),
# the row order of the host-split path (and of one process): the same bits. The results go back in the same
# blocks. A sender with more than C rows for a peer (overflow) or an id outside [0, E) flags the call on
# every rank: its outputs are NaN (poison) and the next call on the workspace, or check_errors, raises EPError.


def exchange_capacity(tokens_cap: int, top_k: int, experts_per_rank: int, ep_size: int, multiplier: float) -> int:
    """C, the rows each rank sends each peer per call: its share of multiplier x the balanced load,
    ceil(multiplier * Tc * k / P) (P*C rows received per rank: cuda_ep.schedule_capacity's multiplier x Tc*k,
    without the GEMM-tile padding), never more than the worst case, Tc * min(k, E_l) (a token routes at most
    min(k, E_l) slots to one rank's experts: where C reaches it no routing of Tc tokens can overflow)."""
    worst = tokens_cap * min(top_k, experts_per_rank)
    return min(math.ceil(multiplier * tokens_cap * top_k / ep_size), worst)


@dataclass
class BoundedPlan:
    """The bounded exchange of one call (see above). world / capacity: P and C (host ints);
    order: [T*k] slot ids sorted by global expert (stable), the send order; send_src: [P*C] the send-order row
    each block row takes (T*k: a zero row, padding); slot_buf: [T*k] each send-order row's place in the blocks;
    local_ids: [P*C] received local expert ids, sorted (E_l: padding, last); local_order: [P*C] the received
    row of each sorted row; local_inverse: its inverse; bad: [] bool, the call is flagged; flags: [4] int64
    (overflow, largest per-peer count, largest token count, bad ids) over the group."""

    world: int
    capacity: int
    order: torch.Tensor
    send_src: torch.Tensor
    slot_buf: torch.Tensor
    local_ids: torch.Tensor
    local_order: torch.Tensor
    local_inverse: torch.Tensor
    bad: torch.Tensor
    flags: torch.Tensor
    group: object

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        splits = [self.capacity] * self.world
        return distributed.all_to_all(t, splits, splits, self.group)

    def dispatch(self, rows_in_send_order: torch.Tensor) -> torch.Tensor:
        """Per-slot values in send order [T*k, ...] -> the local expert rows [P*C, ...], grouped by local expert
        (padding rows last, zero)."""
        t = rows_in_send_order
        t = torch.cat([t, t.new_zeros((1,) + tuple(t.shape[1:]))])  # row T*k: the padding's zero row
        return self._exchange(t.index_select(0, self.send_src)).index_select(0, self.local_order)

    def undispatch_to_slots(self, rows_grouped: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """Local expert rows [P*C, ...] -> per-slot values in slot order t*k + j, back from their expert ranks
        (inverse: the inverse of order)."""
        back = self._exchange(rows_grouped.index_select(0, self.local_inverse))
        return back.index_select(0, self.slot_buf.index_select(0, inverse))

    def poison(self, t: torch.Tensor) -> torch.Tensor:
        """t, or NaN everywhere where the call is flagged (a select: -0.0 stays -0.0, the bits are the host-split
        path's)."""
        return torch.where(self.bad, float("nan"), t)


def _check_signature_and_token_capacity(num_tokens: int, group, signature: dict | None, device) -> int:
    """The first bounded call on a workspace: the largest token count of the group's ranks (one all-to-all, read
    on the host) and the ranks' signature (distributed.exchange_counts raises ValueError on a mismatch)."""
    world, _ = distributed.group_size_and_rank(group)
    counts = torch.full((world,), num_tokens, dtype=torch.int64, device=device)
    return max(int(v) for v in distributed.exchange_counts(counts, group, signature).tolist())


def build_bounded_plan(topk_ids: torch.Tensor, num_experts: int, group, multiplier: float, ep_state: dict,
                       signature: dict | None = None) -> BoundedPlan:
    """The bounded exchange's plan: the send blocks, one all-to-all of the ids and counts (as data), the receiver's
    grouping by local expert. Reads nothing on the host, but for the workspace's first call (the token capacity
    Tc and the signature check, _check_signature_and_token_capacity) and after an EPError that grew Tc."""
    from .torch_backend import inverse_permutation  # (torch_backend imports this module)

    check_errors(ep_state, block=False)  # a flagged earlier call raises here (on CPU: the previous call)
    world, _ = distributed.group_size_and_rank(group)
    num_tokens, top_k = topk_ids.shape
    dev = topk_ids.device
    if ep_state.get("tokens_cap") is None:
        ep_state["tokens_cap"] = max(1, _check_signature_and_token_capacity(num_tokens, group, signature, dev))
    if ep_state.get("grow_to", 0) > ep_state["tokens_cap"]:
        ep_state["tokens_cap"] = ep_state.pop("grow_to")  # every rank raised the same EPError: all grow here
    e_l = num_experts // world
    tc = ep_state["tokens_cap"]
    cap = exchange_capacity(tc, top_k, e_l, world, multiplier)
    ep_state["capacity"] = cap
    n = num_tokens * top_k
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    ranks = torch.arange(world + 1, device=dev, dtype=sorted_ids.dtype)
    bounds = torch.searchsorted(sorted_ids, ranks * e_l)  # [P+1] first send-order row of each peer's experts
    counts = bounds[1:] - bounds[:-1]  # rows for each peer
    bad_ids = n - (bounds[-1] - bounds[0])  # ids outside [0, E)
    slot = torch.arange(cap, device=dev)
    valid = slot < counts[:, None]  # [P, C]
    send_src = torch.where(valid, bounds[:-1, None] + slot, n).reshape(-1)
    ids_ext = torch.cat([sorted_ids, sorted_ids.new_full((1,), e_l)])
    send_ids = torch.where(valid, ids_ext.index_select(0, send_src).view(world, cap) - ranks[:-1, None] * e_l, e_l)
    header = torch.stack([counts, counts.max().expand(world), counts.new_full((world,), num_tokens),
                          bad_ids.expand(world)], dim=1)  # [P, 4]: the same last three to every peer
    meta = torch.cat([send_ids, header], dim=1)  # [P, C + 4] int64
    recv = torch.empty_like(meta)
    torch.distributed.all_to_all_single(recv, meta, group=group)
    hdr = recv[:, cap:]
    most = hdr[:, 1].max()
    flags = torch.stack([(most > cap).to(most.dtype), most, hdr[:, 2].max(), hdr[:, 3].max()])
    bad = (flags[0] + flags[3]) > 0
    local_ids, local_order = torch.sort(recv[:, :cap].reshape(-1), stable=True)  # (expert, source, slot)
    dest = sorted_ids.div(e_l, rounding_mode="floor").clamp_(0, world - 1)
    pos = torch.arange(n, device=dev) - bounds.index_select(0, dest)
    slot_buf = (dest * cap + pos).clamp_(0, max(world * cap - 1, 0))  # past C (overflow): any row, poisoned
    _record_flags(ep_state, flags)
    return BoundedPlan(world, cap, order, send_src, slot_buf, local_ids, local_order,
                       inverse_permutation(local_order), bad, flags, group)


def _record_flags(ep_state: dict, flags: torch.Tensor) -> None:
    """Keep the call's flags for check_errors. On CPU the tensor itself; on CUDA a pinned copy behind the call's
    work and an event (cuda_ep._record_errors' pattern: polled without a synchronisation)."""
    if flags.device.type == "cpu":
        ep_state.setdefault("pending", []).append((flags.numpy(), None))
        return
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    ep_state.setdefault("pending", []).append((host.numpy(), ev))


def check_errors(ep_state: dict, block: bool = True) -> None:
    """Raise EPError for a finished bounded-exchange call of this workspace (its EP state) that was flagged.
    block=False looks only at calls the device has finished (on CPU: all). Every rank sees the same flags, so
    ranks that check at the same point raise together."""
    keep = []
    for i, (host, ev) in enumerate(ep_state.get("pending", [])):
        if ev is not None and not block and not ev.query():
            keep.append((host, ev))
            continue
        if ev is not None:
            ev.synchronize()
        overflow, most, tokens, bad_ids = (int(v) for v in host)
        if overflow or bad_ids:
            ep_state["pending"] = []
            if bad_ids:
                raise EPError(f"mok_nn expert parallelism (backend='torch'): {bad_ids} routed slot(s) had an expert "
                              f"id outside [0, num_experts); the call's outputs are NaN")
            cap, tc = ep_state.get("capacity"), ep_state.get("tokens_cap")
            if tokens > (tc or 0):
                ep_state["grow_to"] = max(ep_state.get("grow_to", 0), tokens)
            raise EPError(
                f"mok_nn expert parallelism (backend='torch'): a rank routed {most} rows to one peer rank, above the "
                f"exchange capacity of {cap} rows per peer (ceil(schedule_capacity_multiplier * Tc * top_k / "
                f"ep_size) with the token capacity Tc = {tc}; the call's largest token count was {tokens}). Its "
                f"outputs and gradients are NaN; no row was dropped silently. Raise "
                f"MoKConfig.schedule_capacity_multiplier, or set it to None for exact split sizes read on the host "
                f"(one device-to-host copy per call)."
                + (f" The next call on every rank grows Tc to {tokens} tokens." if tokens > (tc or 0) else ""))
    ep_state["pending"] = keep
