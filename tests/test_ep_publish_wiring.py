"""SymmBuffers.publish in cuda_ep, on the CPU: the mok_ep_publish launch (the kernel copies, the default)
with its arguments, and that the torch ops (MOK_EP_COPY=torch, the oracle) store what its contract says,
bit for bit; the token / d y rows scattered from the peers' sections against pushed before the barriers.

The library is a stub that carries out the kernels' documented contracts (kernels/ep_publish.py,
kernels/ep_copy.py) on the CPU tensors behind the addresses it is given, written independently of the
torch ops (element by element). The kernels themselves are checked on the GPU by tests/gpu/test_ep_publish.py
and tests/gpu/test_ep_copy.py.
"""

import threading

import pytest
import torch

from mok_nn import cuda_ep
from test_cuda_ep_simulated import _problem, _simulated_ep, install_stub_library
from test_ep_copy_wiring import _StubLib as _CopyStubLib


class _StubLib(_CopyStubLib):
    """mok_ep_publish and mok_scatter_rows_peers by their contracts, the row copies and combine halves by
    test_ep_copy_wiring's stub; every other kernel is unexpected here."""

    def __init__(self):
        super().__init__()
        self.by_pad = {}  # data_ptr of a rank's pad section -> its buffers (the barrier at the end)
        self.barriers = []  # epochs of the barriers the launches ended with
        self.num_experts = []  # the expert count each publish launch was given (its id check's bound)

    def launch(self, name, *args, stream):
        if name not in ("mok_scatter_rows_peers", "mok_ep_publish"):
            return super().launch(name, *args, stream=stream)
        with self._lock:
            self.launches.append((threading.get_ident(), name))
        if name == "mok_scatter_rows_peers":
            return self._scatter_rows_peers(*args)
        (x, ids, w, tokens, table, rank, tc, num_tokens, grid, pads, err, arrivals, epoch, timeout_us, tokens_all, push,
         num_experts) = args
        assert w.dtype == torch.float32 and ids.dtype == torch.int64
        assert table.dtype == torch.int64 and table.shape[0] == 3 and grid >= 1
        assert all(isinstance(v, int) for v in (rank, tc, num_tokens, grid, epoch, timeout_us, num_experts))
        assert pads.dtype == torch.int64 and pads.shape == (table.shape[1],) and timeout_us > 0
        assert err.dtype == arrivals.dtype == torch.int32 and int(arrivals[0]) == 0 and epoch >= 0
        assert tokens_all.dtype == torch.int64 and tokens_all.shape == pads.shape and push in (0, 1)
        assert int(tokens_all[rank]) == tokens.data_ptr()
        k = ids.shape[1]
        n = min(num_tokens, tc, x.shape[0])
        self.num_experts.append(num_experts)
        bad = (ids[:n] < 0) | (ids[:n] >= num_experts)
        if bad.any():  # the kernel prints and traps (kernels/id_check.py)
            raise RuntimeError(f"mok_ep_publish stub: expert id outside [0, {num_experts})")
        bits = w[:n].contiguous().view(torch.int32).flatten().tolist()
        for p in range(table.shape[1]):
            ids_p = self.sections[int(table[0, p])].view(-1)
            w_p = self.sections[int(table[1, p])].view(torch.int32)
            ntok_p = self.sections[int(table[2, p])]
            for t in range(tc):
                for j in range(k):
                    e = (rank * tc + t) * k + j
                    ids_p[e] = int(ids[t, j]) if t < n else -1
                    if t < n:
                        w_p[e] = bits[t * k + j]
            ntok_p[rank] = num_tokens
        for dst in [self.sections[int(a)] for a in tokens_all] if push else [tokens]:  # push: every rank's
            for t in range(n):
                dst[rank * tc + t] = x[t]
        if epoch > 0:  # the barrier the launch ends with: the simulated ranks' thread barrier
            bufs = self.by_pad[int(pads[rank])]
            assert epoch == bufs.epoch and int(pads[rank]) == bufs.local("pad").data_ptr()
            with self._lock:
                self.barriers.append(epoch)
            bufs._barrier.wait(timeout=60)


    def _scatter_rows_peers(self, local, base, slots, row_src, tiles, out, grid):
        """mok_scatter_rows_peers by its contract (kernels/ep_copy.py), from the source side as the kernel
        walks it: source row u (read from rank u // Tc's own section, by the address in base) is stored to the
        rows slots[u, j] whose row_src is u; then the rows whose row_src is no source row are zero-filled,
        except those of tiles with tile_expert < 0."""
        P = base.shape[0]
        n_src, m = slots.shape[0], out.shape[0]
        tc = n_src // P
        assert n_src == P * tc and grid >= 1 and local.data_ptr() in [int(a) for a in base]
        for u in range(n_src):
            for r in slots[u].tolist():
                if 0 <= r < m and int(row_src[r]) == u:
                    out[r] = self.sections[int(base[u // tc])][u]
        for r in range(m):
            t = r // 128
            if (t >= tiles.shape[0] or int(tiles[t]) >= 0) and not 0 <= int(row_src[r]) < n_src:
                out[r] = 0


def _register(lib, bufs):
    for views in bufs._views:
        for name in ("ids", "weights", "ntok", "tokens", "dy", "slots", "dxslots", "partials"):
            lib.sections[views[name].data_ptr()] = views[name]
    lib.by_pad[bufs.local("pad").data_ptr()] = bufs


@pytest.fixture
def stub_publish(monkeypatch):
    monkeypatch.delenv("MOK_EP_COPY", raising=False)
    monkeypatch.setattr(cuda_ep, "_on_cuda", lambda t: True)  # the stub takes CPU tensors
    lib = _StubLib()
    install_stub_library(monkeypatch, lib, lambda bufs: _register(lib, bufs))
    return lib


def _set_mode(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv("MOK_EP_COPY", raising=False)
    else:
        monkeypatch.setenv("MOK_EP_COPY", mode)


def _set_rows(monkeypatch, rows):
    """The token and d y rows of the simulated step: 'needed' (the rule at top-k 2 of 4P experts: pulled),
    'scatter' (read from the peers' sections by the gathers) or 'push' (the rule's scatter where the kernel
    cannot run: pushed before the barriers)."""
    if rows == "needed":
        return
    monkeypatch.setattr(cuda_ep, "token_rows_mode", lambda num_experts, ep_size, top_k: "scatter")
    if rows == "push":
        monkeypatch.setattr(cuda_ep, "scatter_from_ranks_ok", lambda t, top_k: False)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("rows", ["needed", "push", "scatter"])
@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_publish_modes_same_bits_and_launches(stub_publish, monkeypatch, tokens, wdtype, rows):
    """The whole simulated EP step: one mok_ep_publish per rank and forward (none in the backward, none
    with the torch copies), and every output / gradient the same bits either way; the token rows pulled
    after the schedule, pushed by the publish or read from the peers' own sections by the gather (with the
    backward's d y rows the same way: the stub carries out mok_scatter_rows_peers)."""
    _set_rows(monkeypatch, rows)
    P = len(tokens)
    H, I, E, K = 64, 32, 4 * P, 2
    assert rows != "needed" or cuda_ep.token_rows_mode(E, P, K) == "needed"
    got = {}
    for mode in ("torch", "kernel", None):
        _set_mode(monkeypatch, mode)
        stub_publish.launches.clear()
        g = torch.Generator().manual_seed(7 + P)
        W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, tokens, H, I, E, K, False, 0.0)
        ws_ = [w.to(wdtype) for w in ws_]
        got[mode] = _simulated_ep(P, W13, W2, b13, b2, xs, dys, ids, ws_, "swiglu", None)
        scatters = [n for _, n in stub_publish.launches if n == "mok_scatter_rows_peers"]
        names = [n for _, n in stub_publish.launches if n == "mok_ep_publish"]
        assert names == ([] if mode == "torch" else ["mok_ep_publish"] * P), mode
        assert stub_publish.num_experts == ([] if mode == "torch" else [E] * P), mode  # the id check's bound
        stub_publish.num_experts.clear()
        # scatter: the forward's x rows and the backward's d y rows, one launch each per rank
        assert len(scatters) == (2 * P if rows == "scatter" else 0), mode
        # the kernel's launch ends with the forward's first barrier (every rank, one epoch each)
        assert len(stub_publish.barriers) == (0 if mode == "torch" else P), mode
        stub_publish.barriers.clear()
        # one publish per rank (thread)
        assert len({tid for tid, n in stub_publish.launches if n == "mok_ep_publish"}) == len(names)
    for mode in ("kernel", None):
        for r in range(P):
            for a, b in zip(got[mode][r][:3], got["torch"][r][:3]):
                assert torch.equal(_bits(a), _bits(b)), (mode, r)
            ga, gb = got[mode][r][3], got["torch"][r][3]
            assert torch.equal(_bits(ga.gate_up_proj), _bits(gb.gate_up_proj))
            assert torch.equal(_bits(ga.down_proj), _bits(gb.down_proj))


def _poisoned_raws(P, tc, H, K, seed):
    """Every rank's buffer filled with random bytes (no section starts out as what publish writes)."""
    _, nbytes = cuda_ep.buffer_layout(P, tc, H, K)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(P)]


def _special_weights(g, T, K, dtype):
    """Fresh random weights of dtype with -0.0, inf, NaN (with a payload), a denormal and, for fp64,
    values that round when narrowed to fp32."""
    w = torch.rand(T, K, generator=g, dtype=torch.float64) * 3 - 1
    flat = w.view(-1)
    if flat.numel() >= 4:
        flat[:4] = torch.tensor([-0.0, float("inf"), 1e-40, 1 + 2.0**-30], dtype=torch.float64)
    w = w.to(dtype)
    if dtype == torch.bfloat16 and w.numel() > 5:
        w.view(-1).view(torch.int16)[5] = 0x7FC3  # NaN with payload bits
    elif dtype == torch.float32 and w.numel() > 5:
        w.view(-1).view(torch.int32)[5] = 0x7FC00123
    return w


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("P,rank", [(2, 0), (2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("tc,num_tokens", [(9, 9), (9, 4), (9, 13), (6, 0)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_publish_torch_equals_contract(stub_publish, monkeypatch, P, rank, tc, num_tokens, wdtype, push):
    """SymmBuffers.publish in torch mode and the stand-in of the kernel's contract write the same
    bytes into every rank's buffer (n == Tc, n < Tc, more tokens than Tc, no tokens; weights of
    each float dtype, with -0.0 / inf / NaN / denormals / values that round to fp32: the host converts them
    to fp32 before the launch as copy_ converts them); push: the rows
    into every rank's tokens section too (and, where there are rows, not only into the own one)."""
    H, K = 16, 3
    g = torch.Generator().manual_seed(P * 100 + tc * 10 + num_tokens)
    x = torch.randn(num_tokens, H, generator=g).bfloat16()
    ids = torch.randint(0, 50, (num_tokens, K), generator=g)
    w = _special_weights(g, num_tokens, K, wdtype)
    out = {}
    for mode in ("torch", "kernel"):
        _set_mode(monkeypatch, mode)
        stub_publish.launches.clear()
        raws = _poisoned_raws(P, tc, H, K, seed=3)
        bufs = cuda_ep.SymmBuffers(raws, rank, tc, H, K, torch.device("cpu"))
        bufs.publish(x, ids, w, num_tokens, push_rows=push)
        if push and min(num_tokens, tc):
            peer = (rank + 1) % P
            got = bufs.peer(peer, "tokens")[rank * tc:rank * tc + min(num_tokens, tc)]
            assert torch.equal(got.view(torch.int16), x[:tc].view(torch.int16)), mode
        assert [n for _, n in stub_publish.launches] == ([] if mode == "torch" else ["mok_ep_publish"])
        out[mode] = raws
    fresh = _poisoned_raws(P, tc, H, K, seed=3)
    for p in range(P):
        assert not torch.equal(out["torch"][p], fresh[p])  # something was written into every rank
        assert torch.equal(out["kernel"][p], out["torch"][p]), p


def test_publish_kernel_ok(monkeypatch):
    """publish_kernel_ok: the kernel on the GPU with the kernel copies, for rows of 16-byte vectors; else
    (off the GPU, MOK_EP_COPY=torch, other rows) the torch ops."""
    monkeypatch.delenv("MOK_EP_COPY", raising=False)
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert not cuda_ep.publish_kernel_ok(x)  # CPU
    monkeypatch.setattr(cuda_ep, "_on_cuda", lambda t: True)
    assert cuda_ep.publish_kernel_ok(x)
    wide = torch.zeros(4, 20, dtype=torch.bfloat16)
    assert not cuda_ep.publish_kernel_ok(wide[:, 4:])  # row stride 20: not 16-byte rows
    assert not cuda_ep.publish_kernel_ok(wide[:, ::2][:, :8])  # column stride 2
    assert not cuda_ep.publish_kernel_ok(x.view(-1)[1:33].view(2, 16))  # 2 bytes off alignment
    monkeypatch.setenv("MOK_EP_COPY", "torch")
    assert not cuda_ep.publish_kernel_ok(x)


def _push_and_scatter_runs(lib, monkeypatch, tokens, seed, bias, change_inputs=lambda xs, dys: None):
    """{"push": ..., "scatter": ...}: the simulated EP step (_simulated_ep) with the token and d y rows pushed
    before the barriers or read from the peers' sections (_set_rows), on the same problem (change_inputs may
    alter its xs and dys first), and per mode the threads that launched mok_scatter_rows_peers."""
    P = len(tokens)
    H, I, E, K = 64, 32, 4 * P, 2
    got, scatters = {}, {}
    for rows in ("push", "scatter"):
        with monkeypatch.context() as m:
            _set_rows(m, rows)
            g = torch.Generator().manual_seed(seed)
            W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, tokens, H, I, E, K, bias, 0.5 if bias else 0.0)
            change_inputs(xs, dys)
            lib.launches.clear()
            got[rows] = _simulated_ep(P, W13, W2, b13, b2, xs, dys, ids, ws_, "swiglu", None)
            scatters[rows] = [tid for tid, n in lib.launches if n == "mok_scatter_rows_peers"]
    return got, scatters


def _assert_same_bits(a_runs, b_runs, grads=True):
    for r, (a, b) in enumerate(zip(a_runs, b_runs)):
        for u, v in zip(a[:3], b[:3]):
            assert torch.equal(_bits(u), _bits(v)), r
        if grads:
            for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
                u, v = getattr(a[3], name), getattr(b[3], name)
                assert (u is None) == (v is None), (r, name)
                assert u is None or torch.equal(_bits(u), _bits(v)), (r, name)


@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
def test_scatter_rows_same_bits_as_push(stub_publish, monkeypatch, tokens):
    """Token and d y rows scattered (nothing moved before the barriers; the gathers read each rank's rows
    from its own section, by the stub's mok_scatter_rows_peers) against the rows pushed before the barriers:
    every output and gradient the same bits."""
    got, scatters = _push_and_scatter_runs(stub_publish, monkeypatch, tokens, 11 + len(tokens), bias=True)
    assert not scatters["push"]
    assert len(scatters["scatter"]) == len(tokens) * 2  # x and d y rows
    _assert_same_bits(got["scatter"], got["push"])


def test_scatter_mode_same_on_every_rank(stub_publish, monkeypatch):
    """Whether a rank scatters (reads the peers' rows from their sections) or pushes its rows must not depend on
    what differs between ranks, such as the layout of its x: here rank 1's x is a column-major view (same values;
    not rows of 16-byte vectors, so its publish takes the torch ops). Where the rule scatters both ranks must
    still scatter, else one would read rows the other never sent: the same bits as push / push."""
    def column_major_x1(xs, dys):
        xs[1] = xs[1].t().contiguous().t()
        assert xs[1].stride(1) != 1

    got, scatters = _push_and_scatter_runs(stub_publish, monkeypatch, [37, 20], 5, bias=False,
                                           change_inputs=column_major_x1)
    assert not scatters["push"] and len(set(scatters["scatter"])) == 2  # every rank scatters, or none
    _assert_same_bits(got["scatter"], got["push"], grads=False)


def test_scatter_mode_same_for_any_dy_dtype(stub_publish, monkeypatch):
    """The same for the backward: rank 1 is handed its d y as fp32 (same values; a direct caller of
    cuda_ep.backward may do so, autograd never does). The d y section the kernel reads is bf16 on every rank, so
    both ranks must still scatter their d y rows (the first rule asked grad_y's dtype: rank 1 pushed, rank 0
    scattered, and rank 1 then gathered rows rank 0 never sent)."""
    def fp32_dy1(xs, dys):
        dys[1] = dys[1].float()

    got, scatters = _push_and_scatter_runs(stub_publish, monkeypatch, [37, 20], 9, bias=False,
                                           change_inputs=fp32_dy1)
    assert not scatters["push"] and len(set(scatters["scatter"])) == 2
    assert len(scatters["scatter"]) == 2 * 2  # x rows and d y rows on both ranks
    _assert_same_bits(got["scatter"], got["push"])
