"""cuda_ep.make_ep_schedule (one global sort + per-row gather) gives, bit for bit, every output of the
earlier sort-by-local-key + scatter construction (kept below as the oracle), on many random routings:
uneven and empty ranks, empty and crowded experts, capacity overflow, P = 2 and 4."""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep
from mok_nn.kernels.registry import TILE_M


def _make_ep_schedule_old(ids_all, num_tokens, rank, experts_per_rank, capacity):
    """make_ep_schedule as of commit 77e2e79 (verbatim but for the name)."""
    ep_size, tc, top_k = ids_all.shape
    dev = ids_all.device
    n = ep_size * tc * top_k
    flat = ids_all.reshape(-1)
    local = flat - rank * experts_per_rank
    is_local = (flat >= 0) & (local >= 0) & (local < experts_per_rank)
    key = torch.where(is_local, local, experts_per_rank)
    one = torch.ones_like(key)
    counts = torch.zeros(experts_per_rank + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, one)
    counts[experts_per_rank] = 0
    padded = (counts + (TILE_M - 1)) // TILE_M * TILE_M
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    row = seg_start[sorted_key] + torch.arange(n, device=dev) - cnt_start[sorted_key]
    keep = (sorted_key < experts_per_rank) & (row < capacity)
    row = torch.where(keep, row, capacity + torch.arange(n, device=dev))
    num_experts = experts_per_rank * ep_size
    gkey = torch.where(flat >= 0, flat, num_experts)
    gcounts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, gkey, torch.ones_like(gkey))
    gpadded = ((gcounts[:num_experts] + (TILE_M - 1)) // TILE_M * TILE_M).view(ep_size, experts_per_rank)
    overflow = (gpadded.sum(dim=1) > capacity).any()
    src = order // (tc * top_k)
    slot = order % (tc * top_k)
    row_token = torch.full((capacity + n,), ep_size * tc, dtype=torch.int64, device=dev)
    row_token[row] = src * tc + slot // top_k
    row_src = torch.full((capacity + n,), -1, dtype=torch.int64, device=dev)
    row_src[row] = src
    row_slot = torch.full((capacity + n,), -1, dtype=torch.int64, device=dev)
    row_slot[row] = slot
    row_gslot = torch.full((capacity + n,), n, dtype=torch.int64, device=dev)
    row_gslot[row] = order
    row_token, row_src, row_slot, row_gslot = (t[:capacity] for t in (row_token, row_src, row_slot, row_gslot))
    seg_end_l = seg_end[:experts_per_rank].clamp(max=capacity)
    tile_start = torch.arange(0, capacity, TILE_M, device=dev)
    te = torch.searchsorted(seg_end_l, tile_start, right=True)
    tile_expert = torch.where(te < experts_per_rank, te, -1).to(torch.int32)
    row_expert = torch.searchsorted(seg_end_l, torch.arange(capacity, device=dev), right=True)
    pos = torch.arange(num_tokens * top_k, device=dev).view(num_tokens, top_k)
    seg_start_l = torch.cat([seg_end_l.new_zeros(1), seg_end_l[:-1]])
    seg_rows = torch.minimum(counts[:experts_per_rank], seg_end_l - seg_start_l).to(torch.int32)
    sched = cb.Schedule(pos, row_token, tile_expert, seg_end_l.to(torch.int32), seg_rows, row_expert)
    need = is_local.view(ep_size, tc, top_k).any(dim=2)
    need[rank] = False
    tok = torch.arange(ep_size * tc, device=dev).view(ep_size, tc)
    pull_src = torch.where(need, tok, -1)
    rows = torch.arange(capacity, device=dev)
    push_src = torch.where(row_src.unsqueeze(0) == torch.arange(ep_size, device=dev).unsqueeze(1), rows, -1)
    return cuda_ep.EPSchedule(sched, row_src, row_slot, row_gslot, pull_src, push_src, overflow)


def _fields(eps):
    s = eps.sched
    return {"pos": s.pos, "row_token": s.row_token, "tile_expert": s.tile_expert, "seg_end": s.seg_end,
            "seg_rows": s.seg_rows, "row_expert": s.row_expert, "row_src": eps.row_src, "row_slot": eps.row_slot,
            "row_gslot": eps.row_gslot, "pull_src": eps.pull_src, "push_src": eps.push_src,
            "overflow": eps.overflow}


def _random_ids(gen, ep_size, tc, top_k, num_experts):
    """Uneven token counts (some ranks empty or full), experts crowded or empty at random."""
    ids = torch.full((ep_size, tc, top_k), -1, dtype=torch.int64)
    tokens = []
    for s in range(ep_size):
        t = int(torch.randint(0, tc + 1, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.7 else tc
        logits = torch.randn(t, num_experts, generator=gen)
        hot = torch.rand(num_experts, generator=gen) < 0.2
        logits[:, hot] += float(torch.rand(1, generator=gen)) * 30  # crowd a few, starve others
        ids[s, :t] = torch.topk(logits, top_k, dim=1).indices
        tokens.append(t)
    return ids, tokens


@pytest.mark.parametrize("ep_size", [2, 4])
def test_schedule_bitwise_equals_previous_construction(ep_size):
    gen = torch.Generator().manual_seed(100 + ep_size)
    checked = {"overflow": 0, "empty_rank": 0}
    for trial in range(60):
        e_l = int(torch.randint(1, 9, (1,), generator=gen))
        top_k = int(torch.randint(1, min(4, e_l * ep_size) + 1, (1,), generator=gen))
        tc = int(torch.randint(1, 200 if trial % 3 else 1500, (1,), generator=gen))
        ids_all, tokens = _random_ids(gen, ep_size, tc, top_k, e_l * ep_size)
        mult = [0.1, 1.0, 2.0, float(ep_size)][trial % 4]  # small multipliers overflow
        cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, mult)
        for rank in range(ep_size):
            old = _fields(_make_ep_schedule_old(ids_all, tokens[rank], rank, e_l, cap))
            new = _fields(cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap))
            for name in old:
                a, b = old[name], new[name]
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (trial, rank, name)
            checked["overflow"] += bool(old["overflow"])
            checked["empty_rank"] += tokens[rank] == 0
    assert checked["overflow"] > 0 and checked["empty_rank"] > 0  # the hard cases were hit
