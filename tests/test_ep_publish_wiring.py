"""MOK_EP_PUBLISH (kernel / torch) in cuda_ep, on the CPU: which launches each mode issues, with which
arguments, and that the torch ops (the oracle) store what mok_ep_publish's contract says, bit for bit.

The library is a stub that carries out the kernel's documented contract (kernels/ep_publish.py) on
the CPU tensors behind the addresses it is given, written independently of the torch ops (element
by element, bf16 widened by integer shifts). The kernel itself is checked on the GPU by
tests/gpu/test_ep_publish.py.
"""

import threading

import pytest
import torch

from mok_nn import cuda_ep
from test_cuda_ep_simulated import _problem, _simulated_ep, install_stub_library


def _fp32_bits(w: torch.Tensor) -> list:
    """int32 bit patterns of w as fp32: bf16 by shifting its 16 bits up (exact widening), fp32 as is."""
    if w.dtype == torch.bfloat16:
        u = w.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
        return [v - (1 << 32) if v >= 1 << 31 else v for v in (u << 16).flatten().tolist()]
    assert w.dtype == torch.float32
    return w.contiguous().view(torch.int32).flatten().tolist()


class _StubLib:
    """mok_ep_publish(_bf16w) by its contract; every other kernel is unexpected here."""

    def __init__(self):
        self.launches = []
        self.sections = {}  # data_ptr -> the CPU section tensor at that address
        self.by_pad = {}  # data_ptr of a rank's pad section -> its buffers (the barrier at the end)
        self.barriers = []  # epochs of the barriers the launches ended with
        self.num_experts = []  # the expert count each publish launch was given (its id check's bound)
        self._lock = threading.Lock()

    def launch(self, name, *args, stream):
        with self._lock:
            self.launches.append((threading.get_ident(), name))
        if name == "mok_scatter_rows_peers":
            return self._scatter_rows_peers(*args)
        assert name in ("mok_ep_publish", "mok_ep_publish_bf16w"), f"unexpected launch {name}"
        (x, ids, w, tokens, table, rank, tc, num_tokens, grid, pads, err, arrivals, epoch, timeout_us, tokens_all, push,
         num_experts) = args
        assert (name == "mok_ep_publish_bf16w") == (w.dtype == torch.bfloat16)
        assert w.dtype in (torch.float32, torch.bfloat16) and ids.dtype == torch.int64
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
        bits = _fp32_bits(w[:n])
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
        for name in ("ids", "weights", "ntok", "tokens", "dy"):
            lib.sections[views[name].data_ptr()] = views[name]
    lib.by_pad[bufs.local("pad").data_ptr()] = bufs


@pytest.fixture
def stub_publish(monkeypatch):
    monkeypatch.setenv("MOK_EP_COPY", "torch")
    monkeypatch.setattr(cuda_ep, "_on_cuda", lambda t: True)  # the stub takes CPU tensors
    lib = _StubLib()
    install_stub_library(monkeypatch, lib, lambda bufs: _register(lib, bufs))
    return lib


def _set_mode(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv("MOK_EP_PUBLISH", raising=False)
    else:
        monkeypatch.setenv("MOK_EP_PUBLISH", mode)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("rows", ["needed", "push", "scatter"])
@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_publish_modes_same_bits_and_launches(stub_publish, monkeypatch, tokens, wdtype, rows):
    """The whole simulated EP step: one mok_ep_publish per rank and forward (none in the backward,
    none in torch mode), and every output / gradient the same bits in all modes; the token rows pulled
    after the schedule, pushed by the publish (MOK_EP_PULL=push) or read from the peers' own sections by the
    gather (scatter, with the backward's d y rows too: the stub carries out mok_scatter_rows_peers)."""
    monkeypatch.setenv("MOK_EP_PULL", rows)
    monkeypatch.setenv("MOK_EP_DY_ROWS", "scatter" if rows == "scatter" else "auto")
    P = len(tokens)
    H, I, E, K = 64, 32, 4 * P, 2
    got = {}
    for mode in ("torch", "kernel", None):
        _set_mode(monkeypatch, mode)
        stub_publish.launches.clear()
        g = torch.Generator().manual_seed(7 + P)
        W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, tokens, H, I, E, K, False, 0.0)
        ws_ = [w.to(wdtype) for w in ws_]
        got[mode] = _simulated_ep(P, W13, W2, b13, b2, xs, dys, ids, ws_, "swiglu", None)
        scatters = [n for _, n in stub_publish.launches if n == "mok_scatter_rows_peers"]
        names = [n for _, n in stub_publish.launches if n != "mok_scatter_rows_peers"]
        want = "mok_ep_publish_bf16w" if wdtype == torch.bfloat16 else "mok_ep_publish"
        assert names == ([] if mode == "torch" else [want] * P), mode
        assert stub_publish.num_experts == ([] if mode == "torch" else [E] * P), mode  # the id check's bound
        stub_publish.num_experts.clear()
        # scatter: the forward's x rows and the backward's d y rows, one launch each per rank
        assert len(scatters) == (2 * P if rows == "scatter" else 0), mode
        # the kernel's launch ends with the forward's first barrier (every rank, one epoch each)
        assert len(stub_publish.barriers) == (0 if mode == "torch" else P), mode
        stub_publish.barriers.clear()
        # one publish per rank (thread)
        assert len({tid for tid, n in stub_publish.launches if n != "mok_scatter_rows_peers"}) == len(names)
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
    each float dtype, with -0.0 / inf / NaN / denormals / values that round to fp32); push: the rows
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
        kname = "mok_ep_publish_bf16w" if wdtype == torch.bfloat16 else "mok_ep_publish"
        assert [n for _, n in stub_publish.launches] == ([] if mode == "torch" else [kname])
        out[mode] = raws
    fresh = _poisoned_raws(P, tc, H, K, seed=3)
    for p in range(P):
        assert not torch.equal(out["torch"][p], fresh[p])  # something was written into every rank
        assert torch.equal(out["kernel"][p], out["torch"][p]), p


def test_publish_kernel_fallback(monkeypatch):
    """publish_kernel: the variant by weight dtype; None (torch ops) off the GPU or for rows that
    are not 16-byte vectors."""
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    w32, w16 = torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.bfloat16)
    assert cuda_ep.publish_kernel(x, w32) is None  # CPU
    monkeypatch.setattr(cuda_ep, "_on_cuda", lambda t: True)
    assert cuda_ep.publish_kernel(x, w32) == "mok_ep_publish"
    assert cuda_ep.publish_kernel(x, w16) == "mok_ep_publish_bf16w"
    assert cuda_ep.publish_kernel(x, w32.double()) == "mok_ep_publish"
    wide = torch.zeros(4, 20, dtype=torch.bfloat16)
    assert cuda_ep.publish_kernel(wide[:, 4:], w32) is None  # row stride 20: not 16-byte rows
    assert cuda_ep.publish_kernel(wide[:, ::2][:, :8], w32) is None  # column stride 2
    assert cuda_ep.publish_kernel(x.view(-1)[1:33].view(2, 16), w32) is None  # 2 bytes off alignment


def test_publish_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv("MOK_EP_PUBLISH", "fast")
    with pytest.raises(ValueError, match="MOK_EP_PUBLISH='fast'"):
        cuda_ep.publish_mode()
    monkeypatch.delenv("MOK_EP_PUBLISH")
    assert cuda_ep.publish_mode() == "kernel"


def _push_and_scatter_runs(lib, monkeypatch, tokens, seed, bias, change_inputs=lambda xs, dys: None):
    """{"push": ..., "scatter": ...}: the simulated EP step (_simulated_ep) with the token and d y rows pushed
    before the barriers or read from the peers' sections (MOK_EP_PULL = MOK_EP_DY_ROWS), on the same problem
    (change_inputs may alter its xs and dys first), and per mode the threads that launched
    mok_scatter_rows_peers and how often."""
    P = len(tokens)
    H, I, E, K = 64, 32, 4 * P, 2
    got, scatters = {}, {}
    for rows in ("push", "scatter"):
        monkeypatch.setenv("MOK_EP_PULL", rows)
        monkeypatch.setenv("MOK_EP_DY_ROWS", rows)
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


@pytest.mark.parametrize("save_x", ["1", "0"])
@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
def test_scatter_rows_same_bits_as_push(stub_publish, monkeypatch, tokens, save_x):
    """MOK_EP_PULL=scatter with MOK_EP_DY_ROWS=scatter (nothing moved before the barriers; the gathers read
    each rank's rows from its own section, by the stub's mok_scatter_rows_peers; MOK_EP_SAVE_X_ROWS=0: the
    backward's x rows as well) against the rows pushed before the barriers (push / push): every output and
    gradient the same bits."""
    monkeypatch.setenv("MOK_EP_SAVE_X_ROWS", save_x)
    got, scatters = _push_and_scatter_runs(stub_publish, monkeypatch, tokens, 11 + len(tokens), bias=True)
    assert not scatters["push"]
    # x and d y rows (and x again in the backward)
    assert len(scatters["scatter"]) == len(tokens) * (2 if save_x == "1" else 3)
    _assert_same_bits(got["scatter"], got["push"])


def test_scatter_mode_same_on_every_rank(stub_publish, monkeypatch):
    """Whether a rank scatters (reads the peers' rows from their sections) or pushes its rows must not depend on
    what differs between ranks, such as the layout of its x: here rank 1's x is a column-major view (same values;
    not rows of 16-byte vectors, so its publish takes the torch ops). Under MOK_EP_PULL=scatter both ranks must
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
