"""cuda_ep.make_ep_schedule (the single-GPU schedule over relabelled buckets) gives, bit for bit,
every output of two earlier constructions kept below as oracles: the global sort + per-row gather
of commit ca28148 and the sort-by-local-key + scatter of commit 77e2e79. Many random routings:
P = 2, 4, 8; uneven, empty and -1-only ranks; k = 1..8; 1..64 experts per rank; crowded, empty and
non-local experts; capacity overflow; spread and shared other-rank buckets (cuda_ep.spread_buckets)."""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep
from mok_nn.kernels.registry import TILE_M


def _eps(sched, row_src, row_slot, row_gslot, pull_src, push_src, overflow):
    """An EPSchedule of an oracle, holding the oracle's own push_src (compared with cuda_ep.push_split's)."""
    eps = cuda_ep.EPSchedule(sched, row_gslot, pull_src)
    # where functools.cached_property keeps its values: the oracle's own, nothing derived
    eps.__dict__.update(row_src=row_src, row_slot=row_slot, overflow=overflow, push_src=push_src)
    return eps


def _make_ep_schedule_sorted(ids_all, num_tokens, rank, experts_per_rank, capacity):
    """make_ep_schedule as of commit ca28148 (verbatim but for the name, module prefixes, _eps): one
    stable sort of all slots by global expert, searchsorted run boundaries, a gather per row.
    """
    ep_size, tc, top_k = ids_all.shape
    dev = ids_all.device
    e_l = experts_per_rank
    num_experts = e_l * ep_size
    n = ep_size * tc * top_k
    flat = ids_all.reshape(-1)
    # Few distinct keys: a narrow dtype makes the GPU radix sort take fewer passes (same order).
    key = flat.to(torch.int16) if num_experts < 2**15 else flat
    sorted_key, order = torch.sort(key, stable=True)  # -1 (no token) first, then by expert, slot order
    # [g]: sorted position of expert g's first slot (queries of the key's dtype: no conversion of the keys)
    run_start = torch.searchsorted(sorted_key, cuda_ep._cached("arange", num_experts + 1, dev, key.dtype))
    gcounts = run_start[1:] - run_start[:-1]  # routed slots of every expert (run_start[E] = n)
    # Every rank's load, from the same ids: an overflow anywhere is known everywhere.
    gpadded = (gcounts + (TILE_M - 1)) // TILE_M * TILE_M
    gcum = gpadded.view(ep_size, e_l).cumsum(dim=1)  # segment ends of every rank
    overflow = (gcum[:, -1] > capacity).any()

    lo = rank * e_l
    counts, padded, cum = gcounts[lo:lo + e_l], gpadded[lo:lo + e_l], gcum[rank]
    seg_end = cum.clamp(max=capacity)  # only past the capacity (overflow, flagged)
    seg_start = (cum - padded).clamp_(max=capacity)
    # routed rows kept per local expert (fewer only where the capacity cut them: overflow, flagged)
    seg_rows = torch.minimum(counts, seg_end - seg_start)

    rows = cuda_ep._cached("arange", max(capacity, n, ep_size * tc), dev)[:capacity]
    row_expert = torch.searchsorted(seg_end, rows, right=True)  # e_l past the last segment
    # Rows past the last segment look at the last expert: their offset exceeds its seg_rows.
    per = torch.stack([seg_start, seg_rows, run_start[lo:lo + e_l]], dim=1)[row_expert.clamp(max=e_l - 1)]
    off = rows - per[:, 0]
    valid = off < per[:, 1]
    src = (per[:, 2] + off).clamp_(max=n - 1)  # the slot's sorted position where valid
    row_gslot = torch.where(valid, order[src], n)
    row_token = row_gslot // top_k  # s*Tc + t; padding: n // k = P*Tc, the zero row
    row_src = torch.where(valid, row_gslot // (tc * top_k), -1)
    row_slot = torch.where(valid, row_gslot % (tc * top_k), -1)

    te = row_expert[::TILE_M]
    tile_expert = torch.where(te < e_l, te, -1).to(torch.int32)
    pos = cuda_ep._cached("arange", num_tokens * top_k, dev).view(num_tokens, top_k)
    sched = cb.Schedule(pos, row_token, tile_expert, seg_end.to(torch.int32), seg_rows.to(torch.int32), row_expert)

    need = (flat // e_l == rank).view(ep_size, tc, top_k).any(dim=2)  # -1 // e_l = -1: never
    need[rank] = False  # own rows are already local
    pull_src = torch.where(need, cuda_ep._cached("arange", ep_size * tc, dev).view(ep_size, tc), -1)
    push_src = torch.where(row_src.unsqueeze(0) == cuda_ep._cached("arange", ep_size, dev).unsqueeze(1), rows, -1)
    return _eps(sched, row_src, row_slot, row_gslot, pull_src, push_src, overflow)


def _make_ep_schedule_old(ids_all, num_tokens, rank, experts_per_rank, capacity):
    """make_ep_schedule as of commit 77e2e79 (verbatim but for the name and _eps)."""
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
    return _eps(sched, row_src, row_slot, row_gslot, pull_src, push_src, overflow)


def _fields(eps):
    """Every output, by name (row_expert: the expert of each row, derived where the schedule has none)."""
    s = eps.sched
    return {"pos": s.pos, "row_token": s.row_token, "tile_expert": s.tile_expert, "seg_end": s.seg_end,
            "seg_rows": s.seg_rows, "row_expert": s.expert_of_rows(), "row_src": eps.row_src,
            "row_slot": eps.row_slot, "row_gslot": eps.row_gslot, "pull_src": eps.pull_src,
            "push_src": _push_src(eps), "overflow": eps.overflow}


def _push_src(eps):
    """The oracle's own push_src, or the split by rank the torch copies build (cuda_ep.push_split)."""
    return eps.__dict__["push_src"] if "push_src" in eps.__dict__ else cuda_ep.push_split(eps.row_src,
                                                                                         eps.pull_src.shape[0])


def _assert_same(want, got, where):
    for name in want:
        a, b = want[name], got[name]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (where, name)


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


ROUTINGS = ("random", "one_expert", "one_rank", "no_tokens")


def _some_ranks(gen, ep_size):
    """The first, the last and one random rank (a lean CPU test)."""
    return sorted({0, ep_size - 1, int(torch.randint(0, ep_size, (1,), generator=gen))})


def _routing(gen, kind, ep_size, tc, top_k, e_l):
    """ids [P, Tc, k] (-1 tails: token counts 1..Tc, different per rank) and the token counts.
    random: top-k of skewed logits (with repeats where k > E); one_expert: every slot on one expert;
    one_rank: every slot on one rank's experts (none local elsewhere); no_tokens: all -1."""
    num_experts = e_l * ep_size
    tokens = [int(torch.randint(1, tc + 1, (1,), generator=gen)) for _ in range(ep_size)]
    tokens[int(torch.randint(0, ep_size, (1,), generator=gen))] = tc  # Tc is some rank's count
    ids = torch.full((ep_size, tc, top_k), -1, dtype=torch.int64)
    for s in range(ep_size):
        t = tokens[s]
        if kind == "random" and top_k <= num_experts:
            logits = torch.randn(t, num_experts, generator=gen)
            hot = torch.rand(num_experts, generator=gen) < 0.2
            logits[:, hot] += float(torch.rand(1, generator=gen)) * 30  # crowd a few, starve others
            ids[s, :t] = torch.topk(logits, top_k, dim=1).indices
        elif kind == "random":
            ids[s, :t] = torch.randint(0, num_experts, (t, top_k), generator=gen)
        elif kind == "one_expert":
            ids[s, :t] = int(torch.randint(0, num_experts, (1,), generator=gen))
        elif kind == "one_rank":
            q = int(torch.randint(0, ep_size, (1,), generator=gen))
            ids[s, :t] = q * e_l + torch.randint(0, e_l, (t, top_k), generator=gen)
    if kind == "no_tokens":
        tokens = [0] * ep_size
    return ids, tokens


@pytest.mark.parametrize("spread", [True, False])
def test_schedule_bitwise_equals_sorted_construction(spread, monkeypatch):
    """>= 100 random routings per bucket layout (60 for the shared one), up to 3 ranks each, every
    output field, dtype and shape."""
    if not spread:  # one bucket for all other ranks' experts (what E + 1 > SCHEDULE_MAX_EXPERTS gets)
        monkeypatch.setattr(cuda_ep, "spread_buckets", lambda num_experts: False)
    gen = torch.Generator().manual_seed(7 + spread)
    hits = {"overflow": 0, "no_local": 0, "tiny": 0}
    for trial in range(105 if spread else 60):
        ep_size = (2, 4, 8)[trial % 3]
        top_k = (1, 2, 4, 8)[trial // 3 % 4]
        e_l = (1, 2, 8, 64)[trial // 12 % 4]
        kind = ROUTINGS[trial % 4] if trial % 5 else "random"
        tc = int(torch.randint(1, 4 if trial % 7 == 0 else 301, (1,), generator=gen))  # few: n < E_l
        ids_all, tokens = _routing(gen, kind, ep_size, tc, top_k, e_l)
        mult = [0.1, 0.5, 1.0, 2.0, float(ep_size)][trial % 5]  # the small ones overflow
        cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, mult)
        buckets = e_l * ep_size + 1 if cuda_ep.spread_buckets(e_l * ep_size) else e_l + 1
        hits["tiny"] += cb.schedule_capacity(ep_size * tc * top_k, 1, buckets) < cap  # the EP capacity is the larger
        for rank in _some_ranks(gen, ep_size):
            want = _fields(_make_ep_schedule_sorted(ids_all, tokens[rank], rank, e_l, cap))
            got = _fields(cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap))
            _assert_same(want, got, (trial, kind, ep_size, tc, top_k, e_l, mult, rank))
            hits["overflow"] += bool(want["overflow"])
            hits["no_local"] += int(want["seg_rows"].sum()) == 0
    assert all(v > 0 for v in hits.values()), hits  # the hard cases were hit


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
            _assert_same(old, new, (trial, rank))
            checked["overflow"] += bool(old["overflow"])
            checked["empty_rank"] += tokens[rank] == 0
    assert checked["overflow"] > 0 and checked["empty_rank"] > 0  # the hard cases were hit
