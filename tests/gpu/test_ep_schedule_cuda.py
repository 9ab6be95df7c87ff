"""cuda_ep.make_ep_schedule on a CUDA device (the single-GPU schedule kernel, mok_schedule_mc, over
relabelled buckets, then mok_ep_schedule_outputs) gives the bits of the two earlier constructions kept in
tests/test_cuda_ep_schedule_equiv.py (run on the GPU too), and of itself on the CPU (the torch ops that
mok_ep_schedule_outputs replaces); cuda_ep.ep_schedule (its CUDA graph) the eager bits. One GPU,
simulated ranks; qwen3-sized and small random routings, overflow, empty ranks, few tokens (n < E_l),
spread buckets (E + 1 <= 512) and the shared other-rank bucket (E = 512). About 30 s."""


import pytest
import torch

from mok_nn import cuda_ep

import layer_runs  # tests/gpu is on sys.path (pytest rootdir insertion, or the script's folder)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

equiv = layer_runs.load_cpu_test("test_cuda_ep_schedule_equiv")


def _check(ids_all, tokens, e_l, cap, where):
    """The CUDA make_ep_schedule (its outputs by mok_ep_schedule_outputs) against the two oracles on the GPU
    and itself on the CPU (the torch ops)."""
    ep_size, tc, _ = ids_all.shape
    ids_gpu = ids_all.cuda()
    for rank in range(ep_size):
        eps = cuda_ep.make_ep_schedule(ids_gpu, tokens[rank], rank, e_l, cap)
        new = equiv._fields(eps)
        cpu = equiv._fields(cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap))
        oracles = {"sorted": equiv._make_ep_schedule_sorted, "old": equiv._make_ep_schedule_old}
        for label, fn in oracles.items():
            want = equiv._fields(fn(ids_gpu, tokens[rank], rank, e_l, cap))
            for name in want:
                assert new[name].is_cuda and new[name].dtype == want[name].dtype, (where, rank, name)
                assert torch.equal(new[name], want[name]), (where, rank, name, f"vs {label} on the GPU")
                assert torch.equal(new[name].cpu(), cpu[name]), (where, rank, name, "vs new on the CPU")


@pytest.mark.parametrize("ep_size,tc,top_k,e_l,mult,trials", [
    (2, 8192, 8, 64, 2.0, 2),   # qwen3-30b-a3b at EP=2, the benchmark shape
    (2, 8192, 8, 64, 1.0, 2),
    (4, 2048, 8, 32, 0.1, 2),   # overflows
    (8, 1024, 8, 64, 2.0, 1),   # E = 512: one bucket for the other ranks' experts
    (2, 300, 2, 4, 1.0, 10),
    (4, 100, 4, 3, 4.0, 10),
    (2, 2, 1, 64, 2.0, 5),      # n = 4 slots < E_l: the EP capacity exceeds the schedule's own
])
def test_cuda_schedule_bitwise(ep_size, tc, top_k, e_l, mult, trials):
    gen = torch.Generator().manual_seed(tc + ep_size)
    for trial in range(trials):
        ids_all, tokens = equiv._random_ids(gen, ep_size, tc, top_k, e_l * ep_size)
        cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, mult)
        _check(ids_all, tokens, e_l, cap, (trial, ep_size, tc, top_k, e_l, mult))


@pytest.mark.parametrize("kind", equiv.ROUTINGS)
def test_cuda_schedule_skewed_routings(kind):
    """All slots on one expert / on one rank's experts / no tokens at all, P = 2, 4, 8."""
    gen = torch.Generator().manual_seed(len(kind))
    for ep_size, top_k, e_l in ((2, 8, 64), (4, 4, 8), (8, 2, 1), (8, 8, 64)):
        tc = int(torch.randint(1, 301, (1,), generator=gen))
        ids_all, tokens = equiv._routing(gen, kind, ep_size, tc, top_k, e_l)
        for mult in (0.5, 2.0):
            cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, mult)
            _check(ids_all, tokens, e_l, cap, (kind, ep_size, tc, top_k, e_l, mult))


@pytest.mark.parametrize("ep_size,tc,top_k,e_l,mult", [
    (2, 8192, 8, 64, 2.0),   # qwen3-30b-a3b at EP=2
    (4, 2048, 8, 32, 0.1),   # overflows
    (8, 1024, 8, 64, 2.0),   # E = 512: the shared other-rank bucket
    (2, 2, 1, 64, 2.0),      # n < E_l
])
def test_graphed_schedule_bitwise(ep_size, tc, top_k, e_l, mult):
    """cuda_ep.ep_schedule (a CUDA graph replay) gives the eager make_ep_schedule's bits in every field,
    for new routings written into the same ids buffer (the graph reads it in place) and other token
    counts of this rank (one graph for all). A call's schedule holds views of the graph's buffer, valid
    until the next replay; its kept() copy (what the forward saves for its backward) is left untouched
    by later replays, with the same bits."""
    cuda_ep._SCHED_GRAPHS.clear()
    gen = torch.Generator().manual_seed(tc + 7 * ep_size)
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, mult)
    ids_buf = torch.empty(ep_size, tc, top_k, dtype=torch.int64, device="cuda")  # stands for the ids section
    rank = ep_size - 1
    kept = []
    for trial in range(3):
        ids_all, tokens = equiv._random_ids(gen, ep_size, tc, top_k, e_l * ep_size)
        tokens[rank] = [tc, 1, tc // 2 + 1][trial]  # one graph serves every token count (pos is built per call)
        ids_buf.copy_(ids_all)
        got = cuda_ep.ep_schedule(ids_buf, tokens[rank], rank, e_l, cap)
        want = equiv._fields(cuda_ep.make_ep_schedule(ids_buf, tokens[rank], rank, e_l, cap))
        fields = equiv._fields(got)
        for name in want:
            assert fields[name].dtype == want[name].dtype and torch.equal(fields[name], want[name]), (trial, name)
        assert torch.equal(got.sched.gemm_seg_rows(), cuda_ep.cb.padded_seg_rows(want["seg_end"])), trial
        copy = got.kept()
        assert copy is not got and copy.sched.row_token.data_ptr() != got.sched.row_token.data_ptr()
        kept.append(({k: v.clone() for k, v in fields.items()}, copy))
    assert len(cuda_ep._SCHED_GRAPHS) == 1  # captured once, replayed after, whatever the token count
    for trial, (snapshot, copy) in enumerate(kept):  # later replays did not write into the kept copies
        fields = equiv._fields(copy)
        for name in snapshot:
            assert torch.equal(fields[name], snapshot[name]), (trial, name, "overwritten by a later replay")


@pytest.mark.parametrize("kind", ["all", "needed"])
def test_graphed_schedule_captures_the_pull(kind, monkeypatch):
    """The forward's pull captured in the schedule graph (ep_schedule(..., pull=(kind, fn)), the kernel copies):
    two ranks simulated on one GPU (their buffers local tensors, each peer's tokens section filled with fresh
    rows before every call, the pulled rows poisoned), three replays of one graph with new routings and rows.
    After each call the local section holds every peer row ('all') or exactly the rows the schedule's pull_src
    names ('needed', the rest still NaN), read from the peer's section as it was at that replay; and the
    schedule has the eager make_ep_schedule's bits."""
    monkeypatch.delenv("MOK_EP_COPY", raising=False)
    cuda_ep._SCHED_GRAPHS.clear()
    P, tc, k, e_l, H, rank = 2, 300, 4, 8, 64, 1
    dev = torch.device("cuda")
    _, nbytes = cuda_ep.buffer_layout(P, tc, H, k)
    raws = [torch.zeros(nbytes, dtype=torch.uint8, device=dev) for _ in range(P)]
    bufs = cuda_ep.SymmBuffers(raws, rank, tc, H, k, dev)
    cap = cuda_ep.schedule_capacity(tc, k, e_l, P, 2.0)
    if kind == "all":
        pull = ("all", lambda: bufs.pull_rows("tokens", cuda_ep._pull_table(P, tc, rank, dev)))
    else:
        pull = ("needed", lambda eps: bufs.pull_rows("tokens", eps.pull_src))
    gen = torch.Generator().manual_seed(31)
    local = bufs.local("tokens")
    for trial in range(3):
        ids_all, tokens = equiv._random_ids(gen, P, tc, k, e_l * P)
        while tokens[1 - rank] == 0:  # the peer must have rows to pull
            ids_all, tokens = equiv._random_ids(gen, P, tc, k, e_l * P)
        bufs.local("ids").copy_(ids_all)
        rows = [torch.randn(tc, H, generator=gen).to(torch.bfloat16).to(dev) for _ in range(P)]
        for p in range(P):  # each rank's own rows in its own section (its publish)
            bufs.peer(p, "tokens")[p * tc:(p + 1) * tc].copy_(rows[p])
        peer = 1 - rank
        local[peer * tc:(peer + 1) * tc].fill_(float("nan"))  # what the pull must write
        eps = cuda_ep.ep_schedule(bufs.local("ids"), tokens[rank], rank, e_l, cap, pull)
        torch.cuda.synchronize()
        want = equiv._fields(cuda_ep.make_ep_schedule(bufs.local("ids"), tokens[rank], rank, e_l, cap))
        got = equiv._fields(eps)
        for name in want:
            assert torch.equal(got[name], want[name]), (trial, name)
        pulled = local[peer * tc:(peer + 1) * tc]
        need = eps.pull_src[peer] >= 0 if kind == "needed" else torch.ones(tc, dtype=torch.bool, device=dev)
        assert 0 < int(need.sum()), trial
        assert torch.equal(pulled[need].view(torch.int16), rows[peer][need].view(torch.int16)), trial
        assert pulled[~need].isnan().all(), (trial, "a row the schedule does not need was pulled")
    assert len(cuda_ep._SCHED_GRAPHS) == 1  # one graph, replayed
