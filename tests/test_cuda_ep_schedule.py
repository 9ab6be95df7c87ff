"""The expert-parallel schedule (cuda_ep.make_ep_schedule) is torch ops: check it on the CPU
against a plain-Python construction, and the creation-time shape check across ranks (gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import gloo_rank
from mok_nn import cuda_ep
from mok_nn.kernels.registry import TILE_M


def _ids_all(ep_size, tc, tokens, top_k, num_experts, gen, skew=False):
    ids = torch.full((ep_size, tc, top_k), -1, dtype=torch.int64)
    for s in range(ep_size):
        logits = torch.randn(tokens[s], num_experts, generator=gen)
        if skew:  # crowd the first experts, leave others empty
            logits[:, : num_experts // 4] += 20
        ids[s, : tokens[s]] = torch.topk(logits, top_k, dim=1).indices
    return ids


def _expected(ids_all, rank, e_l):
    """rows of each local expert, in (source rank, token, j) order, as (s, t, j) triples."""
    ep_size, tc, top_k = ids_all.shape
    per = [[] for _ in range(e_l)]
    for s in range(ep_size):
        for t in range(tc):
            for j in range(top_k):
                e = int(ids_all[s, t, j])
                if e >= 0 and e // e_l == rank:
                    per[e - rank * e_l].append((s, t, j))
    return per


@pytest.mark.parametrize("ep_size,tokens,tc,top_k,num_experts,skew", [
    (2, [37, 20], 40, 2, 8, False),
    (2, [1, 1], 1, 1, 4, False),
    (4, [50, 3, 0, 64], 64, 4, 16, True),
])
def test_ep_schedule_matches_python(ep_size, tokens, tc, top_k, num_experts, skew):
    gen = torch.Generator().manual_seed(sum(tokens) + ep_size)
    ids_all = _ids_all(ep_size, tc, tokens, top_k, num_experts, gen, skew)
    e_l = num_experts // ep_size
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, float(ep_size))  # never overflows
    for rank in range(ep_size):
        eps = cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap)
        s = eps.sched
        assert not bool(eps.overflow)
        assert s.capacity == cap and cap % TILE_M == 0
        per = _expected(ids_all, rank, e_l)
        start = 0
        want_token = [ep_size * tc] * cap
        want_src, want_slot, want_gslot = [-1] * cap, [-1] * cap, [ep_size * tc * top_k] * cap
        want_te = [-1] * (cap // TILE_M)
        for e, rows in enumerate(per):
            for i, (src, t, j) in enumerate(rows):
                want_token[start + i] = src * tc + t
                want_src[start + i] = src
                want_slot[start + i] = t * top_k + j
                want_gslot[start + i] = (src * tc + t) * top_k + j
            padded = -(-len(rows) // TILE_M) * TILE_M
            for tile in range(start // TILE_M, (start + padded) // TILE_M):
                want_te[tile] = e
            start += padded
            assert int(s.seg_end[e]) == start
            assert int(s.seg_rows[e]) == len(rows)
        assert s.row_token.tolist() == want_token
        assert eps.row_src.tolist() == want_src
        assert eps.row_slot.tolist() == want_slot
        assert eps.row_gslot.tolist() == want_gslot
        assert s.tile_expert.tolist() == want_te
        assert s.expert_of_rows()[:start].tolist() == [
            e for e, rows in enumerate(per) for _ in range(-(-len(rows) // TILE_M) * TILE_M)
        ]
        assert s.pos.tolist() == torch.arange(tokens[rank] * top_k).view(tokens[rank], top_k).tolist()
        assert eps.sched.seg_rows.dtype == torch.int32 and eps.sched.seg_rows.tolist() == [len(rows) for rows in per]
        # pull: exactly the peers' tokens with at least one expert here, never own tokens
        for src in range(ep_size):
            want = [src * tc + t if src != rank and any(int(e) // e_l == rank for e in ids_all[src, t] if e >= 0)
                    else -1 for t in range(tc)]
            assert eps.pull_src[src].tolist() == want
            # push (the torch copies' split by rank): the rows of that source, identity-indexed
            assert cuda_ep.push_split(eps.row_src, ep_size)[src].tolist() == [i if want_src[i] == src else -1 for i in range(cap)]


def test_ep_schedule_overflow_flag_seen_by_every_rank():
    gen = torch.Generator().manual_seed(3)
    ep_size, tc, top_k, num_experts = 2, 300, 2, 8
    ids_all = _ids_all(ep_size, tc, [tc, tc], top_k, num_experts, gen)
    ids_all[:, :, 0] = 0  # every token's first choice: expert 0 on rank 0
    ids_all[:, :, 1] = 1
    e_l = num_experts // ep_size
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, 1.0)
    assert cap < ep_size * tc * top_k  # rank 0 must receive all 1200 rows: too many
    for rank in range(ep_size):  # rank 1 computes nothing but still sees the overflow
        eps = cuda_ep.make_ep_schedule(ids_all, tc, rank, e_l, cap)
        assert bool(eps.overflow)
        assert int(eps.sched.seg_end.max()) <= cap  # segments clamped: nothing indexes past the buffers
        ends = eps.sched.seg_end.long()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])  # as the weight-gradient kernel reads them
        assert torch.all(starts + eps.sched.seg_rows <= ends)  # kept rows only: nothing read past a segment
        assert int(eps.sched.row_token.max()) <= ep_size * tc
        seg = eps.sched.seg_end.long()
        seg_len = seg - torch.cat([seg.new_zeros(1), seg[:-1]])
        assert bool((eps.sched.seg_rows.long() <= seg_len).all())  # the wgrad kernel never reads past a segment
    cap2 = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, 2.0)
    assert not bool(cuda_ep.make_ep_schedule(ids_all, tc, 0, e_l, cap2).overflow)


def test_capacity_formula():
    # balanced load Tc*k, times the multiplier, plus tile padding per local expert; capped at the worst case
    assert cuda_ep.schedule_capacity(1024, 8, 64, 2, 1.0) == 1024 * 8 + 64 * TILE_M
    assert cuda_ep.schedule_capacity(1024, 8, 64, 2, 2.0) == 2 * 1024 * 8 + 64 * TILE_M
    assert cuda_ep.schedule_capacity(1024, 8, 64, 2, 8.0) == 2 * 1024 * 8 + 64 * TILE_M
    assert cuda_ep.schedule_capacity(1, 1, 1, 2, 1.0) == TILE_M


def test_check_group_shapes_message():
    cuda_ep.check_group_shapes([1, 2], [[1, 2], [1, 2]], ["a", "b"])
    with pytest.raises(ValueError, match=r"b: \[2, 3\]"):
        cuda_ep.check_group_shapes([1, 2], [[1, 2], [1, 3]], ["a", "b"])


def _worker(rank, world, tmpdir, q):
    with gloo_rank(rank, world, tmpdir):
        from mok_nn import functional

        try:
            functional.get_workspace(hidden_size=64 + 8 * rank, intermediate_size=32, num_experts=4, top_k=2,
                                     ep_group=dist.group.WORLD, device="cpu", backend="cuda")
            q.put((rank, "no error"))
        except ValueError as err:
            q.put((rank, str(err)))


def test_workspace_rejects_shapes_differing_across_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path), q)) for r in range(2)]
    for p in procs:
        p.start()
    msgs = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r in range(2):  # every rank raises, none hangs
        assert "hidden_size: [64, 72]" in msgs[r], msgs[r]


@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("ep_size,rank", [(2, 0), (4, 3)])
def test_bucket_keys(spread, ep_size, rank):
    """Each id's bucket, against the rule written out here per id: this rank's experts first (g - rank*E_l), then
    (spread) the other experts in rank order from rank + 1 and -1 last, or (not spread) one bucket for all
    of those. Ids outside [-1, E) raise instead of wrapping to another expert or to the no-token bucket."""
    e_l = 3
    num_experts = ep_size * e_l
    ids = torch.arange(-1, num_experts).repeat(3)[torch.randperm(3 * (num_experts + 1))]
    got = cuda_ep.bucket_keys(ids, num_experts, rank, e_l, spread)
    for g, key in zip(ids.tolist(), got.tolist()):
        if g >= 0 and rank * e_l <= g < (rank + 1) * e_l:
            want = g - rank * e_l
        elif g >= 0 and spread:
            want = (g - rank * e_l) % num_experts
        else:
            want = num_experts if spread else e_l
        assert key == want, (g, key, want)
    for bad in (num_experts, num_experts + 5, -2, -num_experts - 1):
        with pytest.raises(IndexError):
            cuda_ep.bucket_keys(torch.tensor([0, bad, -1]), num_experts, rank, e_l, spread)


def test_ep_forward_raises_on_expert_id_out_of_range():
    """Through make_ep_schedule (the EP forward's schedule): an id equal to E, or below -1, raises (on CUDA:
    torch's device-side index assert) instead of being taken as no token or as another expert."""
    gen = torch.Generator().manual_seed(3)
    ids_all = _ids_all(2, 16, [16, 9], 2, 8, gen)
    cuda_ep.make_ep_schedule(ids_all, 16, 0, 4, 256)  # valid: fine
    for bad in (8, -2):
        bad_ids = ids_all.clone()
        bad_ids[1, 3, 1] = bad
        with pytest.raises(IndexError):
            cuda_ep.make_ep_schedule(bad_ids, 16, 0, 4, 256)


def test_push_split_gives_the_kernel_push_slots():
    """The torch copies' push (SymmBuffers.push_rows with MOK_EP_COPY=torch: push_split's rows of each rank into
    its slots at row_slot) stores what mok_ep_push_peers' contract stores (row r into slots[row_slot[r]] of rank
    row_src[r]), every slot of a source's tokens written once."""
    ep_size, tokens, tc, top_k, num_experts, hidden = 2, [300, 301], 301, 8, 16, 8
    gen = torch.Generator().manual_seed(3)
    ids_all = _ids_all(ep_size, tc, tokens, top_k, num_experts, gen)
    e_l = num_experts // ep_size
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, float(ep_size))
    split = [torch.zeros(tc * top_k, hidden, dtype=torch.bfloat16) for _ in range(ep_size)]
    contract = [torch.zeros(tc * top_k, hidden, dtype=torch.bfloat16) for _ in range(ep_size)]
    written = [torch.zeros(tc * top_k, dtype=torch.int64) for _ in range(ep_size)]
    for rank in range(ep_size):
        eps = cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap)
        out = torch.randn(cap, hidden, generator=gen).to(torch.bfloat16)
        push_src = cuda_ep.push_split(eps.row_src, ep_size)
        for p in range(ep_size):
            cuda_ep.SymmBuffers.copy_rows_torch(out, push_src[p], split[p], eps.row_slot)
        for r in range(cap):
            if int(eps.row_src[r]) >= 0:
                contract[int(eps.row_src[r])][int(eps.row_slot[r])] = out[r]
                written[int(eps.row_src[r])][int(eps.row_slot[r])] += 1
    for p in range(ep_size):
        assert torch.equal(split[p].view(torch.int16), contract[p].view(torch.int16))
        n = tokens[p] * top_k
        assert bool((written[p][:n] == 1).all()) and bool((written[p][n:] == 0).all())
