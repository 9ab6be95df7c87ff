"""Host logic of the overlapped EP forward (cuda_ep.dispatch_plan and friends), on the CPU.

The dispatch kernel's contract (kernels/ep_overlap.py) is replayed in Python tile by tile,
in the order and with the dependencies the kernel allows, and must give exactly the GEMM rows
of the sequential path (pull into the tokens section, then index_select by row_token).
"""

import pytest
import torch

from mok_nn import cuda_ep
from mok_nn.config import MoKConfig
from mok_nn.kernels.registry import TILE_M

from test_cuda_ep_schedule import _ids_all
from test_cuda_ep_schedule_equiv import ROUTINGS, _routing, _some_ranks


def _first_row_of_token(row_token: torch.Tensor) -> torch.Tensor:
    """[M] int64: for each row, the lowest row index holding the same token (stable sort, no atomics)."""
    m = row_token.numel()
    order = torch.sort(row_token, stable=True).indices  # equal tokens keep ascending row order
    s = row_token[order]
    rows = torch.arange(m, device=row_token.device)
    starts = torch.ones(m, dtype=torch.bool, device=row_token.device)
    starts[1:] = s[1:] != s[:-1]
    group_first = torch.cummax(torch.where(starts, rows, 0), 0).values  # sorted position of each group's start
    first = torch.empty_like(order)
    first[order] = order[group_first]  # order is a permutation: every index written once
    return first


def _dispatch_plan_sorted(row_token: torch.Tensor, ep_size: int, tokens_cap: int, rank: int):
    """cuda_ep.dispatch_plan as of commit ca28148 (verbatim but for the names): the first row of each
    token by a stable sort of row_token and a cummax scan. (row_peer [M] int32, row_src [M] int64).

    row_peer: source rank of the row (its tokens section, row row_src = row_token), -1 for padding
    (zero row), -2 for a later row of a remote token already pulled by row row_src (its first row):
    each remote token row crosses NVLink once; local rows are copied from the local section.
    """
    pad = row_token >= ep_size * tokens_cap
    peer = torch.where(pad, -1, row_token // tokens_cap)
    rows = torch.arange(row_token.numel(), device=row_token.device)
    first = _first_row_of_token(row_token)
    dup = (peer >= 0) & (peer != rank) & (first != rows)
    row_peer = torch.where(dup, -2, peer).to(torch.int32)
    row_src = torch.where(dup, first, torch.where(pad, 0, row_token))
    return row_peer, row_src


def _replay_dispatch(row_peer, row_src, tile_expert, sections, hidden):
    """mok_ep_dispatch_rows in Python; asserts every read is of data the kernel has by then."""
    m = row_peer.numel()
    dst = torch.full((m, hidden), float("nan"), dtype=torch.bfloat16)
    done = torch.zeros(m, dtype=torch.bool)
    published = set()
    for tile in range(m // TILE_M):
        if int(tile_expert[tile]) < 0:
            continue
        rows = range(tile * TILE_M, (tile + 1) * TILE_M)
        for r in rows:  # phase 1: pulls, local copies, zero rows
            p = int(row_peer[r])
            if p >= 0:
                dst[r] = sections[p][int(row_src[r])]
                done[r] = True
            elif p == -1:
                dst[r] = 0
                done[r] = True
        for r in rows:  # phase 2: duplicates of rows of this tile or of a published earlier tile
            if int(row_peer[r]) == -2:
                f = int(row_src[r])
                assert f < r and bool(done[f]), (r, f)
                assert f // TILE_M == tile or f // TILE_M in published, (r, f)
                dst[r] = dst[f]
                done[r] = True
        published.add(tile)
    return dst


@pytest.mark.parametrize("ep_size,tokens,tc,top_k,num_experts,skew", [
    (2, [37, 20], 40, 2, 8, False),
    (2, [300, 301], 301, 8, 16, False),  # several tiles per expert, tokens repeated across tiles
    (4, [50, 3, 0, 64], 64, 4, 16, True),
])
def test_dispatch_plan_gives_the_sequential_rows(ep_size, tokens, tc, top_k, num_experts, skew):
    hidden = 16
    gen = torch.Generator().manual_seed(7 * sum(tokens) + ep_size)
    ids_all = _ids_all(ep_size, tc, tokens, top_k, num_experts, gen, skew)
    e_l = num_experts // ep_size
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, float(ep_size))
    # every rank's tokens section as that rank holds it: own rows filled, the zero row last
    x = [torch.randn(tokens[s], hidden, generator=gen).to(torch.bfloat16) for s in range(ep_size)]
    sections = []
    for s in range(ep_size):
        sec = torch.zeros(ep_size * tc + 1, hidden, dtype=torch.bfloat16)
        sec[s * tc:s * tc + tokens[s]] = x[s]
        sections.append(sec)
    for rank in range(ep_size):
        eps = cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap)
        sched = eps.sched
        # the sequential path: pull every needed peer row into the local section, then gather
        local = sections[rank].clone()
        for s in range(ep_size):
            if s != rank:
                need = eps.pull_src[s][eps.pull_src[s] >= 0]
                local[need] = sections[s][need]
        want = local.index_select(0, sched.row_token)

        row_peer, row_src = cuda_ep.dispatch_plan(eps, rank)
        assert row_peer.dtype == torch.int32 and row_src.dtype == torch.int64
        got = _replay_dispatch(row_peer, row_src, sched.tile_expert, sections, hidden)
        used = torch.repeat_interleave(sched.tile_expert >= 0, TILE_M)
        assert torch.equal(got[used].view(torch.int16), want[used].view(torch.int16))

        # each remote token row crosses the link once; local and padding rows never do
        pulled = row_src[(row_peer >= 0) & (row_peer != rank)]
        assert pulled.unique().numel() == pulled.numel()
        remote_tokens = sched.row_token[(sched.row_token < ep_size * tc) & (sched.row_token // tc != rank)]
        assert set(pulled.tolist()) == set(remote_tokens.tolist())
        assert bool((row_peer[sched.row_token == ep_size * tc] == -1).all())


def test_first_row_of_token():
    """The oracle's own check: the lowest row holding each row's token."""
    row_token = torch.tensor([5, 3, 5, 9, 3, 3, 9, 5, 0])
    want = torch.tensor([0, 1, 0, 3, 1, 1, 3, 0, 8])
    assert torch.equal(_first_row_of_token(row_token), want)
    r = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(1))
    first = _first_row_of_token(r)
    for i in range(r.numel()):
        assert int(first[i]) == int((r == r[i]).nonzero()[0])


@pytest.mark.parametrize("spread", [True, False])
def test_dispatch_plan_bitwise_equals_sorted_construction(spread, monkeypatch):
    """dispatch_plan (first row of a token = min over its slots' rows) gives the bits of the sort +
    cummax construction on many random routings, every rank, overflow included."""
    if not spread:
        monkeypatch.setattr(cuda_ep, "spread_buckets", lambda num_experts: False)
    gen = torch.Generator().manual_seed(11 + spread)
    dups = 0
    for trial in range(48):
        ep_size = (2, 4, 8)[trial % 3]
        top_k = (1, 2, 4, 8)[trial // 3 % 4]
        e_l = (1, 2, 8, 64)[trial // 12 % 4]
        kind = ROUTINGS[trial % 4] if trial % 5 else "random"
        tc = int(torch.randint(1, 301, (1,), generator=gen))
        ids_all, tokens = _routing(gen, kind, ep_size, tc, top_k, e_l)
        cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, [0.1, 0.5, 1.0, 2.0, float(ep_size)][trial % 5])
        for rank in _some_ranks(gen, ep_size):
            eps = cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap)
            want = _dispatch_plan_sorted(eps.sched.row_token, ep_size, tc, rank)
            got = cuda_ep.dispatch_plan(eps, rank)
            for a, b in zip(want, got):
                assert a.dtype == b.dtype and torch.equal(a, b), (trial, kind, ep_size, tc, top_k, e_l, rank)
            dups += int((got[0] == -2).sum())
    assert dups > 0


def test_split_sms():
    assert cuda_ep.split_sms(132, 16) == (16, 116)
    assert cuda_ep.split_sms(132, 0) == (1, 131)  # the dispatch needs at least one CTA
    assert cuda_ep.split_sms(132, 128) == (128, 4)
    assert cuda_ep.split_sms(8, 100) == (7, 1)  # the GEMM keeps at least one


def test_fwd_mode(monkeypatch):
    monkeypatch.delenv("MOK_EP_FWD", raising=False)
    monkeypatch.delenv("MOK_GEMM", raising=False)
    assert cuda_ep.fwd_mode(MoKConfig(fwd_num_comm_sms=16)) == "sequential"  # overlap is opt-in
    monkeypatch.setenv("MOK_EP_FWD", "sequential")
    assert cuda_ep.fwd_mode(MoKConfig(fwd_num_comm_sms=16)) == "sequential"
    monkeypatch.setenv("MOK_EP_FWD", "overlap")
    assert cuda_ep.fwd_mode(MoKConfig(fwd_num_comm_sms=16)) == "overlap"
    assert cuda_ep.fwd_mode(MoKConfig(fwd_num_comm_sms=0)) == "sequential"
    monkeypatch.setenv("MOK_GEMM", "torch")  # torch._grouped_mm has no readiness hook
    assert cuda_ep.fwd_mode(MoKConfig(fwd_num_comm_sms=16)) == "sequential"
    monkeypatch.setenv("MOK_EP_FWD", "fast")
    with pytest.raises(ValueError, match="MOK_EP_FWD"):
        cuda_ep.fwd_mode(MoKConfig())


def test_combine_mode(monkeypatch):
    monkeypatch.delenv("MOK_EP_FWD", raising=False)
    monkeypatch.delenv("MOK_EP_COMBINE", raising=False)
    monkeypatch.delenv("MOK_GEMM", raising=False)
    cfg = MoKConfig(fwd_num_comm_sms=16)
    monkeypatch.setenv("MOK_EP_FWD", "overlap")
    assert cuda_ep.combine_mode(cfg, down_bias=False) == "overlap"
    assert cuda_ep.combine_mode(cfg, down_bias=True) == "sequential"  # the bias is added after the GEMM
    monkeypatch.setenv("MOK_EP_COMBINE", "sequential")
    assert cuda_ep.combine_mode(cfg, down_bias=False) == "sequential"
    monkeypatch.delenv("MOK_EP_COMBINE")
    monkeypatch.setenv("MOK_EP_FWD", "sequential")  # only inside the overlapped forward
    assert cuda_ep.combine_mode(cfg, down_bias=False) == "sequential"
    monkeypatch.setenv("MOK_EP_FWD", "overlap")
    monkeypatch.setenv("MOK_EP_COMBINE", "later")
    with pytest.raises(ValueError, match="MOK_EP_COMBINE"):
        cuda_ep.combine_mode(cfg, down_bias=False)


def test_push_plan_gives_the_sequential_slots():
    """mok_ep_push_rows sends row r to slots[row_src[r]][row_slot[r]]: the slots of the sequential
    push (copy_rows of push_src[p] rows into peer p's slots at row_slot), every slot written once."""
    ep_size, tokens, tc, top_k, num_experts, hidden = 2, [300, 301], 301, 8, 16, 8
    gen = torch.Generator().manual_seed(3)
    ids_all = _ids_all(ep_size, tc, tokens, top_k, num_experts, gen)
    e_l = num_experts // ep_size
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, float(ep_size))
    seq = [torch.zeros(tc * top_k, hidden, dtype=torch.bfloat16) for _ in range(ep_size)]
    push = [torch.zeros(tc * top_k, hidden, dtype=torch.bfloat16) for _ in range(ep_size)]
    written = [torch.zeros(tc * top_k, dtype=torch.int64) for _ in range(ep_size)]
    for rank in range(ep_size):
        eps = cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap)
        out = torch.randn(cap, hidden, generator=gen).to(torch.bfloat16)
        for p in range(ep_size):
            ok = eps.push_src[p] >= 0
            seq[p][eps.row_slot[ok]] = out[eps.push_src[p][ok]]
        row_rank = eps.row_src.to(torch.int32)
        for tile in range(cap // TILE_M):
            if int(eps.sched.tile_expert[tile]) < 0:
                continue
            for r in range(tile * TILE_M, (tile + 1) * TILE_M):
                if int(row_rank[r]) >= 0:
                    push[int(row_rank[r])][int(eps.row_slot[r])] = out[r]
                    written[int(row_rank[r])][int(eps.row_slot[r])] += 1
    for p in range(ep_size):
        assert torch.equal(push[p].view(torch.int16), seq[p].view(torch.int16))
        n = tokens[p] * top_k
        assert bool((written[p][:n] == 1).all()) and bool((written[p][n:] == 0).all())


class _Stream:
    """Stands in for a torch.cuda.Stream: records wait_stream in the shared log."""

    def __init__(self, name, log):
        self.name, self.cuda_stream, self._log = name, name, log

    def wait_stream(self, other):
        self._log.append(("wait", self.name, other.name))


def test_overlapped_pairs_launch_the_waiting_kernel_last(monkeypatch):
    """In each overlapped pair the kernel that spins on flags is launched after the kernel that sets
    them, and the comm stream's wait on main is recorded before both (so they can overlap).

    Why the order matters: a launch may block the host until every running kernel has finished (the
    first launch of a kernel loads its module under CUDA lazy loading; CUDA_LAUNCH_BLOCKING=1 and
    kernel-serialising tools do it on every launch). With the waiting kernel launched first, that
    launch of the setter waits for the waiter, which waits for the setter: a deadlock, bounded only
    by the readiness timeout (docs/ep.md, "Overlapped forward: why it times out")."""
    from types import SimpleNamespace

    from mok_nn import cuda_backend as cb

    log = []
    launches = SimpleNamespace(launch=lambda name, *a, stream: log.append(("launch", name, stream)))
    monkeypatch.setattr(cb, "_lib", lambda: launches)
    monkeypatch.setattr(cuda_ep, "_comm_setup", lambda ws, dev: (_Stream("comm", log), _Stream("main", log), 16, 116))
    eps, ws, bufs, w13, w2, cap, hidden, inter = _overlap_pair_inputs(seed=5)

    def order(what):
        return [(e[0], e[1] if e[0] == "launch" else f"{e[1]}<-{e[2]}") for e in what]

    cuda_ep._dispatch_gate_up(ws, bufs, eps, w13)
    gemm = cb.gemm_kernel(False, torch.bfloat16, k=hidden, pingpong=False) + "_ready"
    assert order(log) == [("wait", "comm<-main"), ("launch", "mok_ep_dispatch_rows"), ("launch", gemm),
                          ("wait", "main<-comm")]
    assert [e[2] for e in log if e[0] == "launch"] == ["comm", "main"]

    log.clear()
    cuda_ep._down_push(ws, bufs, eps, torch.zeros(cap, inter, dtype=torch.bfloat16), w2)
    gemm = cb.gemm_kernel(False, torch.bfloat16, k=inter, pingpong=False) + "_done"
    assert order(log) == [("wait", "comm<-main"), ("launch", gemm), ("launch", "mok_ep_push_rows"),
                          ("wait", "main<-comm")]
    assert [e[2] for e in log if e[0] == "launch"] == ["main", "comm"]


def _overlap_pair_inputs(seed):
    """Rank 0 of 2 (37 and 20 tokens, top-2 of 8 experts, hidden 64, intermediate 32): its EP schedule,
    a stand-in workspace and symmetric buffer, zero expert weights (launches are only logged)."""
    from types import SimpleNamespace

    ep_size, tokens, tc, top_k, num_experts, hidden, inter = 2, [37, 20], 40, 2, 8, 64, 32
    ids_all = _ids_all(ep_size, tc, tokens, top_k, num_experts, torch.Generator().manual_seed(seed))
    e_l = num_experts // ep_size
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, 2.0)
    eps = cuda_ep.make_ep_schedule(ids_all, tokens[0], 0, e_l, cap)
    ws = SimpleNamespace(ep_state={}, config=MoKConfig(fwd_num_comm_sms=16))
    bufs = SimpleNamespace(hidden=hidden, ep_size=ep_size, tokens_cap=tc, rank=0, timeout_s=1.0,
                           err=torch.zeros(1, dtype=torch.int32),
                           section_addrs=lambda name: torch.zeros(ep_size, dtype=torch.int64))
    w13 = torch.zeros(e_l, 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.zeros(e_l, hidden, inter, dtype=torch.bfloat16)
    return eps, ws, bufs, w13, w2, cap, hidden, inter


@pytest.mark.parametrize("mode", ["static", "dynamic", "dispatch"])
def test_ov_tiles_mode_launches(mode, monkeypatch):
    """MOK_EP_OV_TILES: dynamic launches the _dyn GEMMs on every SM (comm + GEMM CTAs) with the tile
    counter zeroed before each launch ([0, comm CTAs] for the ready GEMM, [0] for the done GEMM);
    dispatch does so for the gate/up GEMM only; static keeps the _ready / _done GEMMs on the GEMM CTAs."""
    from types import SimpleNamespace

    from mok_nn import cuda_backend as cb

    monkeypatch.setenv("MOK_EP_OV_TILES", mode)
    log = []

    def launch(name, *args, stream):
        # what the kernel would see at its launch: the counter's values, the grid (num_ctas)
        ctr = [a.clone().tolist() for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32
               and a.numel() <= 2 and a is not bufs.err]
        log.append((name, stream, args, ctr))

    monkeypatch.setattr(cb, "_lib", lambda: SimpleNamespace(launch=launch))
    monkeypatch.setattr(cuda_ep, "_comm_setup", lambda ws, dev: (_Stream("comm", []), _Stream("main", []), 16, 116))
    eps, ws, bufs, w13, w2, cap, hidden, inter = _overlap_pair_inputs(seed=6)
    h = torch.zeros(cap, inter, dtype=torch.bfloat16)
    for step in range(2):  # the second call finds the counters dirty from the first
        for key in ("ready_ctr", "done_ctr"):
            if ws.ep_state.get(key) is not None:
                ws.ep_state[key][0] = 123  # as a GEMM's claims leave it
        log.clear()
        cuda_ep._dispatch_gate_up(ws, bufs, eps, w13)
        cuda_ep._down_push(ws, bufs, eps, h, w2)
        (g1, s1, a1, c1), (p1, _, _, _) = log[1], log[0]
        (g2, s2, a2, c2), (p2, _, _, _) = log[2], log[3]
        assert (p1, p2) == ("mok_ep_dispatch_rows", "mok_ep_push_rows")
        assert (s1, s2) == ("main", "main")
        ready_dyn = mode in ("dynamic", "dispatch")
        done_dyn = mode == "dynamic"
        base1 = cb.gemm_kernel(False, torch.bfloat16, k=hidden, pingpong=False) + "_ready"
        base2 = cb.gemm_kernel(False, torch.bfloat16, k=inter, pingpong=False) + "_done"
        assert g1 == base1 + ("_dyn" if ready_dyn else "")
        assert g2 == base2 + ("_dyn" if done_dyn else "")
        if ready_dyn:
            assert a1[-2] == 132 and a1[-1] is ws.ep_state["ready_ctr"]
            assert c1[-1] == [0, 16]  # zeroed claims, comm CTAs, at the launch
        else:
            assert a1[-1] == 116
        if done_dyn:
            assert a2[-2] == 132 and a2[-1] is ws.ep_state["done_ctr"] and c2[-1] == [0]
        else:
            assert a2[-1] == 116
        # the dyn GEMMs' argument lists match their registry specs (num_ctas, then tile_counter)
        from mok_nn.kernels.registry import SPECS_BY_NAME
        for name, args in ((g1, a1), (g2, a2)):
            assert len(args) == len(SPECS_BY_NAME[name].args)

