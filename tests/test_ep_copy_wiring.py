"""MOK_EP_COPY (v1 / v2 / torch) in cuda_ep, on the CPU: which row-copy kernels each mode launches,
with which arguments, and that all three give the same bits.

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
        if name in ("mok_ep_copy_rows", "mok_ep_copy_rows_v2"):
            src, src_idx, dst, dst_idx = args[:4]
            assert (name == "mok_ep_copy_rows_v2") == (len(args) == 5)
            for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
                if s >= 0 and d >= 0:
                    dst[d] = src[s]
        elif name == "mok_ep_pull_peers":
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


def _run(monkeypatch, mode, seed, tokens):
    if mode is None:
        monkeypatch.delenv("MOK_EP_COPY", raising=False)
    else:
        monkeypatch.setenv("MOK_EP_COPY", mode)
    H, I, E, K = 64, 32, 4 * len(tokens), 2
    g = torch.Generator().manual_seed(seed)
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, tokens, H, I, E, K, False, 0.0)
    return _simulated_ep(len(tokens), W13, W2, b13, b2, xs, dys, ids, ws_, "swiglu", None)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
def test_copy_modes_same_bits_and_launches(stub_copies, monkeypatch, tokens):
    P = len(tokens)
    monkeypatch.setenv("MOK_EP_COMBINE_SUMS", "rank")  # per-rank sums where P divides the leaves
    rank_sums = cuda_ep.combine_sums(4 * P, P, 2) == "rank"  # [37, 20]: 2 ranks, 8 experts; [5, 9, 1]: slot sums
    # the combine and d x per rank and step: one pre-reduced push + the source's final sum, or the slot push
    sums = ["mok_ep_partial_push", "mok_combine_final"] * 2 * P if rank_sums else []
    got = {}
    for mode in ("torch", "v1", None, "v2"):
        stub_copies.launches.clear()
        got[mode] = _run(monkeypatch, mode, seed=3 + P, tokens=tokens)
        names = [n for _, n in stub_copies.launches]
        copies = [n for n in names if n not in ("mok_ep_partial_push", "mok_combine_final")]
        if mode == "torch":
            assert names == []
            continue
        assert sorted(set(names) - set(copies)) == sorted(set(sums)) and len(names) - len(copies) == len(sums)
        if mode == "v1":
            # forward: P-1 pulls (+ P pushes); backward: P-1 pulls (d y; the forward kept its x rows,
            # MOK_EP_SAVE_X_ROWS) (+ P pushes), per rank
            assert set(copies) == {"mok_ep_copy_rows"}
            assert len(copies) / P == 2 * (P - 1) + (0 if rank_sums else 2 * P)
        else:  # v2, also the default: one pull per section, one push per step
            pushes = [] if rank_sums else ["mok_ep_push_peers"] * 2 * P
            assert sorted(copies) == sorted(["mok_ep_pull_peers"] * 2 * P + pushes)
    for mode in ("v1", None, "v2"):
        for r in range(P):
            y, dx, dw, grads = got[mode][r]
            y0, dx0, dw0, grads0 = got["torch"][r]
            for a, b in [(y, y0), (dx, dx0), (dw, dw0), (grads.gate_up_proj, grads0.gate_up_proj),
                         (grads.down_proj, grads0.down_proj)]:
                assert torch.equal(_bits(a), _bits(b)), (mode, r)


@pytest.mark.parametrize("modes", [("gemm", "kernel"), ("kernel", "gemm"), ("gemm", "gemm")])
@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
def test_push_gemm_wiring(stub_copies, monkeypatch, tokens, modes):
    """MOK_EP_DOWN_PUSH / MOK_EP_DX_PUSH=gemm: the forward's down GEMM (mok_gemm_bk_ef_push) and the backward's
    dgrad of gate/up (mok_gemm_bn_ef_push), here the stub's torch GEMM + scatter, send each row to its source's
    slots / dxslots instead of the GEMM and mok_ep_push_peers: one launch per rank and pass, no push after it,
    and the same bits as the GEMMs then the slot pushes."""
    P = len(tokens)
    down, dx = modes
    monkeypatch.setenv("MOK_EP_COMBINE_SUMS", "slot")
    monkeypatch.setenv("MOK_EP_DOWN_PUSH", "kernel")
    monkeypatch.setenv("MOK_EP_DX_PUSH", "kernel")
    ref = _run(monkeypatch, None, seed=11 + P, tokens=tokens)
    stub_copies.launches.clear()
    monkeypatch.setattr(cuda_ep, "_gemm_push_ok", lambda a: True)  # the stub takes CPU tensors
    monkeypatch.setenv("MOK_EP_DOWN_PUSH", down)
    monkeypatch.setenv("MOK_EP_DX_PUSH", dx)
    got = _run(monkeypatch, None, seed=11 + P, tokens=tokens)
    names = [n for _, n in stub_copies.launches]
    assert names.count("mok_gemm_bk_ef_push") == (P if down == "gemm" else 0)
    assert names.count("mok_gemm_bn_ef_push") == (P if dx == "gemm" else 0)
    assert names.count("mok_ep_push_peers") == (down == "kernel") * P + (dx == "kernel") * P
    for r in range(P):
        for a, b in zip(got[r][:3] + (got[r][3].gate_up_proj, got[r][3].down_proj),
                        ref[r][:3] + (ref[r][3].gate_up_proj, ref[r][3].down_proj)):
            assert torch.equal(_bits(a), _bits(b)), r


@pytest.mark.parametrize("tokens", [[37, 20], [5, 9, 1]])
def test_dy_rows_push_wiring(stub_copies, monkeypatch, tokens):
    """MOK_EP_DY_ROWS=push: each rank copies its d y rows into every peer's dy section before the backward's
    barrier and nothing pulls them after it: one pull launch per rank fewer (the forward's stays), same bits."""
    P = len(tokens)
    got = {}
    for mode in ("pull", "push"):
        monkeypatch.setenv("MOK_EP_DY_ROWS", mode)
        stub_copies.launches.clear()
        got[mode] = _run(monkeypatch, None, seed=17 + P, tokens=tokens)
        pulls = [n for _, n in stub_copies.launches].count("mok_ep_pull_peers")
        assert pulls == (2 * P if mode == "pull" else P), (mode, pulls)
    for r in range(P):
        a, b = got["push"][r], got["pull"][r]
        for u, v in zip(a[:3] + (a[3].gate_up_proj, a[3].down_proj), b[:3] + (b[3].gate_up_proj, b[3].down_proj)):
            assert torch.equal(_bits(u), _bits(v)), r
    monkeypatch.delenv("MOK_EP_DY_ROWS")
    assert cuda_ep.dy_rows_mode(128, 2, 8) == "scatter" and cuda_ep.dy_rows_mode(8, 2, 2) == "pull"  # qwen3, mixtral
    assert cuda_ep.dy_rows_mode(64, 64, 60) == "pull"  # token rows pulled after the barrier (above 32 ranks)
    assert cuda_ep.dy_rows_mode(128, 2, 8, overlapped_forward=True) == "push"  # (scatter not run after it yet)


def test_push_gemm_modes(monkeypatch):
    monkeypatch.setenv("MOK_EP_DOWN_PUSH", "sideways")
    with pytest.raises(ValueError, match="MOK_EP_DOWN_PUSH='sideways'"):
        cuda_ep.down_push(torch.zeros(2, 8), False)
    monkeypatch.delenv("MOK_EP_DOWN_PUSH")
    assert not cuda_ep.down_push(torch.zeros(2, 8), False)  # off the GPU: never
    monkeypatch.setattr(cuda_ep, "_gemm_push_ok", lambda a: True)
    assert cuda_ep.down_push(torch.zeros(2, 8), False) and not cuda_ep.down_push(torch.zeros(2, 8), True)  # bias
    monkeypatch.delenv("MOK_EP_DX_PUSH", raising=False)
    limit = cuda_ep.DX_PUSH_GEMM_MAX_H
    assert cuda_ep.dx_push_mode(limit) == "gemm" and cuda_ep.dx_push_mode(limit + 8) == "copy_engine"
    monkeypatch.setenv("MOK_EP_DX_PUSH", "kernel")
    assert cuda_ep.dx_push_mode(8) == "kernel"
    monkeypatch.setenv("MOK_EP_DX_PUSH", "nowhere")
    with pytest.raises(ValueError, match="MOK_EP_DX_PUSH='nowhere'"):
        cuda_ep.dx_push_mode(8)


def test_copy_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv("MOK_EP_COPY", "v3")
    with pytest.raises(ValueError, match="MOK_EP_COPY='v3'"):
        cuda_ep.copy_mode()
    monkeypatch.delenv("MOK_EP_COPY")
    assert cuda_ep.copy_mode() == "v2"


def test_copy_grid():
    warps = registry.EP_COPY_THREADS // 32  # warps per CTA of the row copies
    assert cuda_ep.copy_grid(0, 132, 4) == 1
    assert cuda_ep.copy_grid(1, 132, 4) == 1
    assert cuda_ep.copy_grid(warps + 1, 132, 4) == 2
    assert cuda_ep.copy_grid(10**6, 132, 4) == 528
    assert cuda_ep.copy_grid(10**6, 132, 0) == 132
