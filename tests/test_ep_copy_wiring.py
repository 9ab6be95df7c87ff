"""MOK_EP_COPY (kernel / torch) in cuda_ep, on the CPU: which row-copy kernels the kernel mode launches,
with which arguments, and that both give the same bits; the push GEMMs' wiring likewise.

The ranks are threads (test_cuda_ep_simulated); the library is a stub that records each launch and
carries out the kernel's documented contract with torch indexing on the CPU tensors behind the
addresses it is given (the peer address tables hold data_ptrs of the simulated sections). The kernels
themselves are checked on the GPU by tests/gpu/test_ep_copy.py.
"""

import threading

import pytest
import torch

from mok_nn import cuda_ep
from mok_nn.kernels import registry
from test_cuda_ep_simulated import _problem, _simulated_ep, install_stub_library


class _StubLib:
    """Row-copy kernels and the EP combine's two halves by their contract; every other kernel is
    unexpected here."""

    def __init__(self):
        self.launches = []
        self.sections = {}  # data_ptr -> the CPU section tensor at that address
        self._lock = threading.Lock()

    def _at(self, addr, like):
        sec = self.sections[int(addr)]
        assert sec.dtype == like.dtype and sec.shape[1] == like.shape[1]
        return sec

    def launch(self, name, *args, stream):
        with self._lock:
            self.launches.append((threading.get_ident(), name))
        if name == "mok_ep_pull_peers":
            base, pull_src, dst, grid = args
            assert grid >= 1 and pull_src.dim() == 2
            tc = pull_src.shape[1]
            for p in range(pull_src.shape[0]):
                sec = self._at(base[p], dst)
                for t, s in enumerate(pull_src[p].tolist()):
                    if s >= 0:
                        dst[p * tc + t] = sec[s]
        elif name == "mok_ep_push_peers":
            src, base, row_rank, row_slot, grid = args
            assert grid >= 1 and row_rank.dtype == torch.int64 and row_slot.dtype == torch.int64
            for r, (p, d) in enumerate(zip(row_rank.tolist(), row_slot.tolist())):
                if p >= 0:
                    self._at(base[p], src)[d] = src[r]
        elif name == "mok_ep_partial_push":
            rows, slot_row, w_all, ids_all, base, rank, e_l, epl, weighted, row0 = args
            tc = ids_all.shape[1]
            assert row0 == rank * tc  # the direct form (the copy-engine form runs only on CUDA tensors)
            for s, (node, present) in enumerate(cuda_ep.partial_sums_torch(rows, slot_row, w_all, ids_all, rank, e_l,
                                                                            epl, weighted)):
                self.sections[int(base[s])][rank][present] = node[present]
        elif name in ("mok_gemm_bk_ef_push", "mok_gemm_bn_ef_push"):
            # the GEMM's rows (as grouped_gemm's torch path computes them) to their destinations; b is [N, K, E]
            # either way (K-major: W [E, N, K] permuted; N-major: W [E, K, N] permuted), W[e] as [K, N] below
            a, b, tile_expert, seg_end, seg_rows, group_m, base, row_rank, row_slot = args
            assert a.dim() == 3 and b.dim() == 3 and row_rank.dtype == torch.int64 and row_slot.dtype == torch.int64
            assert row_rank.shape[0] == row_slot.shape[0] == a.shape[0]
            rows = torch._grouped_mm(a[..., 0], b.permute(2, 1, 0), offs=seg_end).to(a.dtype)
            for r, (p, d) in enumerate(zip(row_rank.tolist(), row_slot.tolist())):
                if p >= 0:
                    self._at(base[p], rows)[d] = rows[r]
        elif name == "mok_combine_final":
            parts, ids, flags, out, e_l, epl = args
            out.copy_(cuda_ep.final_combine_torch(parts, ids, flags, e_l, epl))
        else:
            raise AssertionError(f"unexpected launch {name}")


@pytest.fixture
def stub_copies(monkeypatch):
    lib = _StubLib()

    def register(bufs):
        for views in bufs._views:
            for name, v in views.items():
                if name in ("tokens", "dy", "slots", "dxslots", "partials"):
                    lib.sections[v.data_ptr()] = v

    install_stub_library(monkeypatch, lib, register)
    return lib


def _run(monkeypatch, mode, seed, tokens, top_k=2):
    if mode is None:
        monkeypatch.delenv("MOK_EP_COPY", raising=False)
    else:
        monkeypatch.setenv("MOK_EP_COPY", mode)
    H, I, E, K = 64, 32, 4 * len(tokens), top_k
    g = torch.Generator().manual_seed(seed)
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, tokens, H, I, E, K, False, 0.0)
    return _simulated_ep(len(tokens), W13, W2, b13, b2, xs, dys, ids, ws_, "swiglu", None)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _outputs(run):
    """y, d x, d topk-weights and the weight gradients of one rank's run."""
    return run[:3] + (run[3].gate_up_proj, run[3].down_proj)


@pytest.mark.parametrize("tokens,top_k", [([37, 20], 2), ([37, 20], 6), ([5, 9, 1], 2)])
def test_copy_modes_same_bits_and_launches(stub_copies, monkeypatch, tokens, top_k):
    """The kernel copies (the default) against the torch copies (none launched): the same bits. Per rank and
    step, the kernel mode pulls each section once where the rows are pulled (top-k 2: the needed rows, and the
    d y rows after them; top-k 6: the rule's scatter, for which the CPU pushes the rows before the barriers
    instead), and pushes the combine (and d x) once: a row per slot, or (k > 2P: per-rank sums) one
    pre-reduced push and the source's final sum."""
    P = len(tokens)
    E = 4 * P
    rank_sums = cuda_ep.combine_sums(E, P, top_k) == "rank"  # [5, 9, 1]: 3 ranks do not divide 4 leaves
    assert rank_sums == (top_k == 6)
    pulled = cuda_ep.token_rows_mode(E, P, top_k) == "needed"
    assert pulled == (top_k == 2) and cuda_ep.dy_rows_mode(E, P, top_k) == ("pull" if pulled else "scatter")
    sums = ["mok_ep_partial_push", "mok_combine_final"] * 2 * P if rank_sums else []
    got = {}
    for mode in ("torch", None, "kernel"):
        stub_copies.launches.clear()
        got[mode] = _run(monkeypatch, mode, seed=3 + P, tokens=tokens, top_k=top_k)
        names = [n for _, n in stub_copies.launches]
        copies = [n for n in names if n not in ("mok_ep_partial_push", "mok_combine_final")]
        if mode == "torch":
            assert names == []
            continue
        assert sorted(names) == sorted(copies + sums)
        pulls = ["mok_ep_pull_peers"] * 2 * P if pulled else []
        pushes = [] if rank_sums else ["mok_ep_push_peers"] * 2 * P
        assert sorted(copies) == sorted(pulls + pushes)
    for mode in (None, "kernel"):
        for r in range(P):
            for a, b in zip(_outputs(got[mode][r]), _outputs(got["torch"][r])):
                assert torch.equal(_bits(a), _bits(b)), (mode, r)


@pytest.mark.parametrize("gemms", ["down", "dgrad", "both"])
@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
def test_push_gemm_wiring(stub_copies, monkeypatch, tokens, gemms):
    """The forward's down GEMM (mok_gemm_bk_ef_push, down_push) and the backward's dgrad of gate/up
    (mok_gemm_bn_ef_push, dx_push_mode 'gemm'), here the stub's torch GEMM + scatter, send each row to its
    source's slots / dxslots instead of the GEMM and mok_ep_push_peers: one launch per rank and pass, no push
    after it, and the same bits as the GEMMs then the slot pushes (what runs where the push GEMMs cannot)."""
    P = len(tokens)
    I = 32  # (_run's): the down GEMM's rows are I wide, the dgrad's 2I
    ref = _run(monkeypatch, None, seed=11 + P, tokens=tokens)
    stub_copies.launches.clear()
    widths = {"down": (I,), "dgrad": (2 * I,), "both": (I, 2 * I)}[gemms]
    monkeypatch.setattr(cuda_ep, "_gemm_push_ok", lambda a: a.shape[1] in widths)  # the stub takes CPU tensors
    got = _run(monkeypatch, None, seed=11 + P, tokens=tokens)
    names = [n for _, n in stub_copies.launches]
    down, dgrad = gemms in ("down", "both"), gemms in ("dgrad", "both")
    assert names.count("mok_gemm_bk_ef_push") == (P if down else 0)
    assert names.count("mok_gemm_bn_ef_push") == (P if dgrad else 0)
    assert names.count("mok_ep_push_peers") == (not down) * P + (not dgrad) * P
    for r in range(P):
        for a, b in zip(_outputs(got[r]), _outputs(ref[r])):
            assert torch.equal(_bits(a), _bits(b)), r


@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
def test_dy_rows_push_wiring(stub_copies, monkeypatch, tokens):
    """dy_rows_mode 'push' (where the rule scatters but the kernel cannot run): each rank copies its d y rows
    into every peer's dy section before the backward's barrier and nothing pulls them after it: one pull launch
    per rank fewer than 'pull' (the forward's stays), same bits."""
    P = len(tokens)
    got = {}
    for mode in ("pull", "push"):
        monkeypatch.setattr(cuda_ep, "dy_rows_mode", lambda num_experts, ep_size, top_k, mode=mode: mode)
        stub_copies.launches.clear()
        got[mode] = _run(monkeypatch, None, seed=17 + P, tokens=tokens)
        pulls = [n for _, n in stub_copies.launches].count("mok_ep_pull_peers")
        assert pulls == (2 * P if mode == "pull" else P), (mode, pulls)
    for r in range(P):
        for u, v in zip(_outputs(got["push"][r]), _outputs(got["pull"][r])):
            assert torch.equal(_bits(u), _bits(v)), r


def test_push_gemm_rules(monkeypatch):
    monkeypatch.delenv("MOK_EP_COPY", raising=False)
    monkeypatch.delenv("MOK_GEMM", raising=False)
    assert not cuda_ep.down_push(torch.zeros(2, 8), False)  # off the GPU: never
    monkeypatch.setattr(cuda_ep, "_on_cuda", lambda t: True)
    assert cuda_ep.down_push(torch.zeros(2, 8), False) and not cuda_ep.down_push(torch.zeros(2, 8), True)  # bias
    monkeypatch.setenv("MOK_EP_COPY", "torch")
    assert not cuda_ep.down_push(torch.zeros(2, 8), False)
    monkeypatch.delenv("MOK_EP_COPY")
    monkeypatch.setenv("MOK_GEMM", "torch")
    assert not cuda_ep.down_push(torch.zeros(2, 8), False)
    limit = cuda_ep.DX_PUSH_GEMM_MAX_H
    assert cuda_ep.dx_push_mode(limit) == "gemm" and cuda_ep.dx_push_mode(limit + 8) == "copy_engine"


def test_copy_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv("MOK_EP_COPY", "v2")
    with pytest.raises(ValueError, match="MOK_EP_COPY='v2'"):
        cuda_ep.copy_mode()
    monkeypatch.delenv("MOK_EP_COPY")
    assert cuda_ep.copy_mode() == "kernel"


def test_copy_grid():
    warps = registry.EP_COPY_THREADS // 32  # warps per CTA of the row copies
    assert cuda_ep.copy_grid(0, 132, 4) == 1
    assert cuda_ep.copy_grid(1, 132, 4) == 1
    assert cuda_ep.copy_grid(warps + 1, 132, 4) == 2
    assert cuda_ep.copy_grid(10**6, 132, 4) == 528
    assert cuda_ep.copy_grid(10**6, 132, 0) == 132
