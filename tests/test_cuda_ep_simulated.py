"""The expert-parallel forward/backward of cuda_ep, simulated on the CPU.

P threads play the ranks; their "symmetric buffers" are plain CPU tensors every
thread can address, the barrier is a threading.Barrier, and the kernels are
replaced by torch ops (MOK_GEMM / MOK_ACT / MOK_EP_COPY=torch and a torch
combine). What is tested is cuda_ep's own logic: exchange, schedule, pull and
push indices, slot layout, weight and gradient plumbing, against the reference
experts of the whole batch in fp64-accumulated bf16.
"""

import threading
from types import SimpleNamespace

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep, reference
from mok_nn.config import MoKConfig
from mok_nn.functional import ExpertParams
from mok_nn.kernels import loader


class _ThreadBuffers(cuda_ep.SymmBuffers):
    def __init__(self, raws, rank, tc, hidden, top_k, barrier):
        super().__init__(raws, rank, tc, hidden, top_k, torch.device("cpu"))
        self._barrier = barrier

    def barrier(self):
        self.epoch += 1
        self._barrier.wait(timeout=60)


def patch_cpu_kernels(monkeypatch):
    """The EP path on the CPU: torch GEMMs, activation and combine; each step's error flags
    recorded into ws.ep_state["seen"] instead of a pinned copy."""
    monkeypatch.setenv("MOK_GEMM", "torch")
    monkeypatch.setenv("MOK_ACT", "torch")
    monkeypatch.setattr(cb, "check_supported", lambda *a: None)
    monkeypatch.setattr(cb, "combine", cb.combine_torch)
    monkeypatch.setattr(cuda_ep, "_record_errors", lambda ws, flags, what: ws.ep_state["seen"].append(flags))


class SpecChecked:
    """A CPU stub library whose every launch is first checked against the kernel's registry spec
    (loader.check_launch_args: argument count, dtypes, ranks, fixed extents and strides, alignment, scalar
    kinds), as the real library's launch checks them, so the host wiring cannot pass the stub what the
    kernel would reject."""

    def __init__(self, lib):
        self.lib = lib

    def launch(self, name, *args, stream):
        loader.check_launch_args(name, args, on_device=False)
        return self.lib.launch(name, *args, stream=stream)

    def __getattr__(self, attr):
        return getattr(self.lib, attr)


def install_stub_library(monkeypatch, lib, on_buffers):
    """patch_cpu_kernels, plus `lib` (a stub carrying out some kernels' contracts on CPU tensors) as
    the kernel library; on_buffers(bufs) runs for every new symmetric buffer (to register its sections
    with the stub by address)."""
    patch_cpu_kernels(monkeypatch)
    monkeypatch.setattr(cb, "_lib", lambda: SpecChecked(lib))
    monkeypatch.setattr(cb, "_stream", lambda: 0)
    real_init = cuda_ep.SymmBuffers.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        self._num_sms = 3  # no device to ask
        on_buffers(self)

    monkeypatch.setattr(cuda_ep.SymmBuffers, "__init__", init)


@pytest.fixture
def cpu_kernels(monkeypatch):
    patch_cpu_kernels(monkeypatch)
    monkeypatch.setenv("MOK_EP_COPY", "torch")


def _run_ranks(fn, ep_size):
    out, errs = [None] * ep_size, []

    def body(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(ep_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out

def _problem(g, tokens, H, I, E, K, bias, bias_scale):
    """Expert weights (biases scaled by bias_scale, or None) and per-rank x, dy, top-k ids and weights."""
    W13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    W2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    b13 = (torch.randn(E, 2 * I, generator=g) * bias_scale).bfloat16() if bias else None
    b2 = (torch.randn(E, H, generator=g) * bias_scale).bfloat16() if bias else None
    xs = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    dys = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    ids = [torch.topk(torch.randn(t, E, generator=g), K, dim=1).indices for t in tokens]
    ws_ = [torch.rand(t, K, generator=g) for t in tokens]
    return W13, W2, b13, b2, xs, dys, ids, ws_


def _shared_buffers(ep_size, tc, H, K):
    """The ranks' simulated symmetric buffers (zeroed CPU tensors) and their barrier."""
    _, nbytes = cuda_ep.buffer_layout(ep_size, tc, H, K)
    return [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(ep_size)], threading.Barrier(ep_size)


def _rank_workspace(raws, r, tc, E, H, K, barrier, activation="swiglu", limit=None):
    """Rank r's workspace stand-in over the simulated symmetric buffers raws (one per rank)."""
    return SimpleNamespace(num_experts=E, hidden_size=H, top_k=K, config=MoKConfig(), activation=activation,
                           swiglu_limit=limit, device=torch.device("cpu"), buffers={},
                           ep_state={"bufs": _ThreadBuffers(raws, r, tc, H, K, barrier), "pending": [], "seen": []})


def _simulated_ep(ep_size, W13, W2, b13, b2, xs, dys, ids, ws_, activation, limit, consume_saved=False):
    """cuda_ep forward + backward on ep_size threads sharing CPU 'symmetric' buffers; per rank
    (y, dx, d topk-weights, grads). Every rank's step must finish without an error flag."""
    E, H = W13.shape[0], W13.shape[2]
    K, e_l, tc = ids[0].shape[1], E // ep_size, max(x.shape[0] for x in xs)
    raws, barrier = _shared_buffers(ep_size, tc, H, K)

    def rank_fn(r):
        sl = slice(r * e_l, (r + 1) * e_l)
        params = ExpertParams(W13[sl], W2[sl], None if b13 is None else b13[sl], None if b2 is None else b2[sl])
        ws = _rank_workspace(raws, r, tc, E, H, K, barrier, activation, limit)
        y, saved = cuda_ep.forward(xs[r], ids[r], ws_[r], params, None, ws)
        dx, dw, grads = cuda_ep.backward(dys[r], saved, xs[r], ids[r], ws_[r], params, ws,
                                         consume_saved=consume_saved)
        assert all(int(f.sum()) == 0 for f in ws.ep_state["seen"]) and len(ws.ep_state["seen"]) == 2
        return y, dx, dw, grads

    return _run_ranks(rank_fn, ep_size)



@pytest.mark.parametrize("ep_size,tokens,bias,activation,limit", [
    (2, [37, 20], False, "swiglu", None),
    (2, [5, 1], True, "swiglu_oai", 7.0),
])
def test_simulated_ep_matches_reference(cpu_kernels, ep_size, tokens, bias, activation, limit):
    H, I, E, K = 32, 16, 8, 2
    e_l = E // ep_size
    g = torch.Generator().manual_seed(sum(tokens))
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, tokens, H, I, E, K, bias, bias_scale=0.1)
    got = _simulated_ep(ep_size, W13, W2, b13, b2, xs, dys, ids, ws_, activation, limit)

    # oracle: the reference experts on the whole batch, all experts local
    x, dy = torch.cat(xs), torch.cat(dys)
    y_ref, saved = reference.experts_forward(x, torch.cat(ids), torch.cat(ws_), W13, W2, b13, b2, activation, limit)
    dx_ref, dw_ref, g_ref = reference.experts_backward(dy, saved, x, torch.cat(ids), torch.cat(ws_), W13, W2, b13, b2,
                                                       activation, limit)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    lo = 0
    for r, t in enumerate(tokens):
        y, dx, dw, grads = got[r]
        sl = slice(r * e_l, (r + 1) * e_l)
        assert rel(y, y_ref[lo:lo + t]) < 2e-2
        assert rel(dx, dx_ref[lo:lo + t]) < 2e-2
        assert rel(dw, dw_ref[lo:lo + t]) < 2e-2
        assert rel(grads.gate_up_proj, g_ref.gate_up_proj[sl]) < 2e-2
        assert rel(grads.down_proj, g_ref.down_proj[sl]) < 2e-2
        if bias:
            assert rel(grads.gate_up_bias, g_ref.gate_up_bias[sl]) < 2e-2
            assert rel(grads.down_bias, g_ref.down_bias[sl]) < 2e-2
        lo += t


def test_simulated_ep_consumed_gate_up_keeps_the_bits(cpu_kernels, monkeypatch):
    """cuda_ep.backward(consume_saved=True) (autograd keeps no graph): each rank's dgrad writes d gate_up over the
    saved gate_up (dgrad_down_act in place), with the bits of the backward that keeps it."""
    from mok_nn import cuda_backend as cb

    g = torch.Generator().manual_seed(12)
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, [37, 20], 32, 16, 8, 2, True, bias_scale=0.1)
    seen, real = [], cb.dgrad_down_act

    def spy(*args, in_place=False):
        seen.append(in_place)
        return real(*args, in_place=in_place)

    monkeypatch.setattr(cb, "dgrad_down_act", spy)
    kept = _simulated_ep(2, W13, W2, b13, b2, xs, dys, ids, ws_, "swiglu", None)
    consumed = _simulated_ep(2, W13, W2, b13, b2, xs, dys, ids, ws_, "swiglu", None, consume_saved=True)
    assert seen == [False, False, True, True]
    for (y0, dx0, dw0, g0), (y1, dx1, dw1, g1) in zip(kept, consumed):
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
        for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
            assert torch.equal(getattr(g0, name), getattr(g1, name)), name


def test_simulated_batch_above_capacity_flags_every_rank(cpu_kernels):
    """A rank with more tokens than the capacity: both ranks finish the step (no hang), every
    output is NaN, and both see the same count in the flags (from which the workspace grows)."""
    H, I, E, K, ep_size, tc = 32, 16, 8, 2, 2, 6
    tokens = [9, 4]  # rank 0 above tc
    e_l = E // ep_size
    g = torch.Generator().manual_seed(5)
    W13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    W2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    xs = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    ids = [torch.topk(torch.randn(t, E, generator=g), K, dim=1).indices for t in tokens]
    ws_ = [torch.rand(t, K, generator=g) for t in tokens]
    raws, barrier = _shared_buffers(ep_size, tc, H, K)

    def rank_fn(r):
        sl = slice(r * e_l, (r + 1) * e_l)
        ws = _rank_workspace(raws, r, tc, E, H, K, barrier)
        params = ExpertParams(W13[sl], W2[sl], None, None)
        y, saved = cuda_ep.forward(xs[r], ids[r], ws_[r], params, None, ws)
        dx, dw, _ = cuda_ep.backward(torch.ones_like(y), saved, xs[r], ids[r], ws_[r], params, ws)
        return y, dx, dw, ws.ep_state["seen"]

    for r, (y, dx, dw, seen) in enumerate(_run_ranks(rank_fn, ep_size)):
        assert y.shape == (tokens[r], H) and dx.shape == (tokens[r], H) and dw.shape == (tokens[r], K)
        assert bool(torch.isnan(y).all()) and bool(torch.isnan(dx).all()) and bool(torch.isnan(dw).all())
        assert [f.tolist() for f in seen] == [[0, 0, 9], [0, 0, 9]]


def test_check_errors_too_many_tokens_sets_growth():
    class _Done:
        def synchronize(self):
            pass

    # (flags, then the arrival marker _record_errors copies behind them)
    st = {"pending": [(torch.tensor([0, 0, 9, 1], dtype=torch.int32).numpy(), _Done(), "forward")],
          "bufs": SimpleNamespace(tokens_cap=6, timeout_s=1.0)}
    ws = SimpleNamespace(ep_state=st, config=MoKConfig())
    with pytest.raises(cuda_ep.EPError, match="9 tokens, above the workspace's token capacity 6"):
        cuda_ep.check_errors(ws)
    assert st["grow_to"] == 9 and st["pending"] == []
    cuda_ep.check_errors(ws)  # reported once


def test_check_errors_waits_for_the_marker():
    """The non-blocking poll reads the flags only once their arrival marker is set (no event query);
    the blocking one waits for the event, after which the marker is there."""
    class _Event:
        def __init__(self, host):
            self.host = host

        def synchronize(self):
            self.host[3] = 1  # the copies behind the event are done

        def query(self):
            raise AssertionError("the non-blocking poll must not query the event")

    host = torch.tensor([1, 0, 0, 0], dtype=torch.int32)  # an overflow, marker not yet arrived
    st = {"pending": [(host.numpy(), _Event(host), "forward")],  # (_record_errors keeps a numpy view)
          "bufs": SimpleNamespace(tokens_cap=6, timeout_s=1.0), "capacity": 128}
    ws = SimpleNamespace(ep_state=st, config=MoKConfig())
    cuda_ep.check_errors(ws, block=False)  # not arrived: kept, nothing raised
    assert len(st["pending"]) == 1
    with pytest.raises(cuda_ep.EPError, match="overflowed the expert buffers"):
        cuda_ep.check_errors(ws, block=True)
    assert st["pending"] == []


# top-k 2 of 8 experts at P = 2: the needed rows pulled, one row per slot summed on the source ('slot');
# top-k 6: the rows pushed by the publish (scatter's stand-in off the GPU), the combine and d x pre-reduced
# per rank ('rank': k > 2P)
SUMS_TOP_K = {"slot": 2, "rank": 6}


@pytest.mark.parametrize("sums", ["slot", "rank"])
@pytest.mark.parametrize("tokens,bias,activation,limit", [
    ([37, 20], False, "swiglu", None),
    ([37, 1], False, "swiglu", 7.0),
    ([300, 301], True, "swiglu_oai", 7.0),
])
def test_simulated_ep_bitwise_equals_single_gpu_logic(cpu_kernels, tokens, bias, activation, limit, sums):
    """Given one routing, cuda_ep's plumbing (exchange, row order, biases, d w slots) gives the bits of
    cuda_backend's EP = 1 logic on the concatenated batch, both on the same torch stand-ins for the
    kernels; with the combine and d x summed from one row per slot and pre-reduced per rank
    (combine_sums, by top-k). (On the GPU, tests/gpu/ep_cuda_check.py checks the same with the real
    kernels.)"""
    H, I, E, K, P = 64, 32, 8, SUMS_TOP_K[sums], 2
    assert cuda_ep.combine_sums(E, P, K) == sums
    e_l = E // P
    g = torch.Generator().manual_seed(11 + sum(tokens))
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, tokens, H, I, E, K, bias, bias_scale=0.5)
    got = _simulated_ep(P, W13, W2, b13, b2, xs, dys, ids, ws_, activation, limit)
    x, dy, idc, wc = torch.cat(xs), torch.cat(dys), torch.cat(ids), torch.cat(ws_)
    y1, s1 = cb.experts_forward(x, idc, wc, W13, W2, b13, b2, activation, limit)
    dx1, dw1, g1 = cb.experts_backward(dy, s1, x, idc, wc, W13, W2, b13, b2, activation, limit)
    lo = 0
    for r, t in enumerate(tokens):
        y, dx, dw, grads = got[r]
        sl = slice(r * e_l, (r + 1) * e_l)
        pairs = {"y": (y, y1[lo:lo + t]), "dx": (dx, dx1[lo:lo + t]), "dw": (dw, dw1[lo:lo + t]),
                 "dW13": (grads.gate_up_proj, g1.gate_up_proj[sl]), "dW2": (grads.down_proj, g1.down_proj[sl])}
        if bias:
            pairs.update(db13=(grads.gate_up_bias, g1.gate_up_bias[sl]), db2=(grads.down_bias, g1.down_bias[sl]))
        assert {k: torch.equal(a, b) for k, (a, b) in pairs.items()} == {k: True for k in pairs}, r
        lo += t


@pytest.mark.parametrize("sums", ["rank", "slot"])
def test_two_layers_sharing_a_workspace(cpu_kernels, sums):
    """Two layers with the same shapes share one workspace (one symmetric buffer). Forward A,
    forward B, backward B, backward A, as in training: A's backward gives the bits of A alone
    (forward A, backward A), although B's forward published its own routing into the shared ids
    section in between (the per-rank d x sums read the forward's copy, EPSaved.ids_all)."""
    H, I, E, K, P, tokens = 64, 32, 8, SUMS_TOP_K[sums], 2, [37, 20]
    assert cuda_ep.combine_sums(E, P, K) == sums
    A = _problem(torch.Generator().manual_seed(1), tokens, H, I, E, K, False, 0.0)
    B = _problem(torch.Generator().manual_seed(2), tokens, H, I, E, K, False, 0.0)
    e_l, tc = E // P, max(tokens)

    def run(two):
        raws, barrier = _shared_buffers(P, tc, H, K)

        def rank_fn(r):
            sl = slice(r * e_l, (r + 1) * e_l)
            ws = _rank_workspace(raws, r, tc, E, H, K, barrier)
            pa, pb = (ExpertParams(L[0][sl], L[1][sl], None, None) for L in (A, B))
            ya, sa = cuda_ep.forward(A[4][r], A[6][r], A[7][r], pa, None, ws)
            if two:
                _, sb = cuda_ep.forward(B[4][r], B[6][r], B[7][r], pb, None, ws)
                cuda_ep.backward(B[5][r], sb, B[4][r], B[6][r], B[7][r], pb, ws)
            dx, dw, grads = cuda_ep.backward(A[5][r], sa, A[4][r], A[6][r], A[7][r], pa, ws)
            return ya, dx, dw, grads.gate_up_proj, grads.down_proj

        return _run_ranks(rank_fn, P)

    alone, interleaved = run(False), run(True)
    for r in range(P):
        assert [torch.equal(a, b) for a, b in zip(alone[r], interleaved[r])] == [True] * 5, r


def test_token_rows_modes_give_the_same_bits(cpu_kernels, monkeypatch):
    """token_rows_mode 'push' (every rank's rows stored into every rank's tokens section by its publish), 'all'
    (every peer token row pulled, before the schedule) and 'needed' (after it) feed the GEMMs the same rows:
    every output of both ranks bitwise equal. (The rule picks 'needed' at this shape; 'all' above 32 ranks,
    'push' where scatter cannot run.)"""
    g = torch.Generator().manual_seed(11)
    problem = _problem(g, [9, 14], 32, 16, 8, 2, False, 0.0)
    assert cuda_ep.token_rows_mode(8, 2, 2) == "needed"
    runs = {}
    for mode in ("needed", "all", "push"):
        monkeypatch.setattr(cuda_ep, "token_rows_mode", lambda num_experts, ep_size, top_k, mode=mode: mode)
        runs[mode] = _simulated_ep(2, *problem, "swiglu", None)
    for mode in ("all", "push"):
        for got, want in zip(runs[mode], runs["needed"]):
            y, dx, dw, grads = got
            y2, dx2, dw2, grads2 = want
            assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2), mode
            assert torch.equal(grads.gate_up_proj, grads2.gate_up_proj), mode
            assert torch.equal(grads.down_proj, grads2.down_proj), mode


def test_token_rows_rule():
    """Where nearly every token has an expert on each rank, the gather reads the peers' rows from their
    sections (scatter; up to 32 ranks, else every row pulled), else only the needed rows are pulled; the d y
    rows go the same way (scatter, else pulled)."""
    assert cuda_ep.token_rows_mode(128, 2, 8) == cuda_ep.token_rows_mode(256, 2, 8) == "scatter"  # 0.996
    assert cuda_ep.token_rows_mode(64, 64, 60) == "all"  # 0.94 over 64 ranks
    assert cuda_ep.token_rows_mode(8, 2, 2) == "needed"  # mixtral: 0.79
    assert cuda_ep.token_rows_mode(16, 8, 1) == "needed"  # top-1 over 8 ranks: 0.125
    assert cuda_ep.dy_rows_mode(128, 2, 8) == "scatter" and cuda_ep.dy_rows_mode(8, 2, 2) == "pull"  # qwen3, mixtral
    assert cuda_ep.dy_rows_mode(64, 64, 60) == "pull"  # token rows pulled after the barrier (above 32 ranks)


def test_kept_copy_only_of_the_last_replay():
    """EPSchedule.kept() of a graphed schedule copies the graph's buffer: refused once a later replay has
    overwritten it (the schedule would be another call's)."""
    stub = SimpleNamespace(replays=2)
    with pytest.raises(RuntimeError, match="after a later replay"):
        cuda_ep._GraphedSchedule._copy(stub, 5, 1)


def test_check_errors_keeps_finished_steps_until_the_next_record():
    """A finished step's pinned flags and event are not freed by the poll at the start of a call (freeing
    them costs driver calls before the call's first launch) but kept in 'retired', which the next
    _record_errors, after the call's launches, clears."""
    class _Event:
        def synchronize(self):
            pass

    host = torch.tensor([0, 0, 0, 1], dtype=torch.int32).numpy()  # no error, marker arrived
    ev = _Event()
    st = {"pending": [(host, ev, "forward")]}
    ws = SimpleNamespace(ep_state=st, config=MoKConfig())
    cuda_ep.check_errors(ws, block=False)
    assert st["pending"] == [] and len(st["retired"]) == 1 and st["retired"][0][1] is ev
