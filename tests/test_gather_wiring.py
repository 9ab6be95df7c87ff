"""MOK_GEMM_GATHER / MOK_GEMM_GATHER_DY wiring of cuda_backend, on the CPU with torch stand-ins for the kernels.

The stand-in library checks every launch against its registry spec (argument count,
dtypes, ranks, fixed extents) and computes the varlen-M grouped GEMMs in fp32 tile by
tile; its gather variants read A row r as x[row_token[r]] (a zero row for T). What is
tested is the plumbing: the gather path launches the gather kernels with the right
arguments, saves no permuted copy of x, and gives the default path's bits.
"""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import reference
from mok_nn.kernels import registry

from test_cuda_ep_simulated import SpecChecked

_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "i64": torch.int64}


class _FakeLib:
    def __init__(self):
        self.calls = []

    def launch(self, name, *args, stream):
        spec = registry.SPECS_BY_NAME[name]
        assert len(args) == len(spec.args), name
        for a, t in zip(spec.args, args):
            if isinstance(a, registry.ScalarArg):
                continue
            assert t.dtype == _DTYPES[a.dtype], (name, a.name, t.dtype)
            assert t.dim() == len(a.shape), (name, a.name, t.shape)
            for s, n in zip(a.shape, t.shape):
                assert s == registry.DYN or s == n, (name, a.name, t.shape)
        self.calls.append(name)
        if spec.factory == "VarlenMGroupedGemmGather":
            x, row_idx, b, c, te, seg_end, seg_rows, _ = args
            rows = torch.cat([x[:, :, 0], x.new_zeros(1, x.shape[1])])  # the kernel zero-fills padding rows
            _gemm(rows.index_select(0, row_idx), b, c, te)
        elif spec.factory == "VarlenMGroupedGemm":
            a, b, c, te, seg_end, seg_rows, _ = args
            _gemm(a[:, :, 0], b, c, te)
        elif spec.factory == "VarlenMGroupedGemmDyn":  # dynamic tiles: the same tiles, claimed from a zeroed counter
            a, b, c, te, seg_end, seg_rows, _, counter = args
            assert int(counter[0]) == 0, f"{name}: tile counter not zeroed before the launch"
            _gemm(a[:, :, 0], b, c, te)
        else:
            raise AssertionError(f"stand-in has no {name}")


def _gemm(a, b, c, tile_expert):
    """c[m] = a[m] @ b[:, :, e(m)]^T per 128-row tile, fp32 sums, rounded once."""
    for t, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        r = slice(t * registry.TILE_M, (t + 1) * registry.TILE_M)
        c[r, :, 0] = (a[r].float() @ b[:, :, e].float().T).to(c.dtype)


def random_problem(T, H, I, E, K, bias, seed):
    """(x, ids, w, dy, W13, W2, b13, b2): fresh random inputs, bf16 rows and weights, fp32 top-k weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    dy = torch.randn(T, H, generator=g).bfloat16()
    W13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    W2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16() if bias else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).bfloat16() if bias else None
    return x, ids, w, dy, W13, W2, b13, b2


@pytest.fixture
def fake_lib(monkeypatch):
    lib = _FakeLib()
    monkeypatch.setattr(cb, "_lib", lambda: SpecChecked(lib))
    monkeypatch.setattr(cb, "_stream", lambda: 0)
    monkeypatch.setattr(cb, "check_supported", lambda *a: None)
    monkeypatch.setattr(cb, "combine", cb.combine_torch)
    monkeypatch.setenv("MOK_ACT", "torch")
    monkeypatch.setenv("MOK_WGRAD", "torch")
    for var in ("MOK_GEMM", "MOK_GEMM_GATHER", "MOK_GEMM_GATHER_DY", "MOK_GEMM_ACT", "MOK_GEMM_EPI"):
        monkeypatch.delenv(var, raising=False)
    return lib


@pytest.mark.parametrize("T,bias,activation,limit", [(37, False, "swiglu", None), (1, True, "swiglu_oai", 7.0)])
def test_gather_path_equals_default(fake_lib, monkeypatch, T, bias, activation, limit):
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(T, 32, 16, 4, 2, bias, seed=T)
    args = (W13, W2, b13, b2, activation, limit)

    def run():
        fake_lib.calls.clear()
        y, saved = cb.experts_forward(x, ids, w, *args)
        dx, dw, grads = cb.experts_backward(dy, saved, x, ids, w, *args)
        outs = [y, dx, dw, grads.gate_up_proj, grads.down_proj, grads.gate_up_bias, grads.down_bias]
        return saved, outs, list(fake_lib.calls)

    saved0, want, calls0 = run()
    assert saved0.x_rows is not None and not any(c.endswith("_gather") for c in calls0)
    monkeypatch.setenv("MOK_GEMM_GATHER", "1")
    monkeypatch.setenv("MOK_GEMM_GATHER_DY", "1")
    saved1, got, calls1 = run()
    assert saved1.x_rows is None, "the forward kept the permuted copy of x"
    # K = H = 32 <= GEMM_FULL_EPI_MAX_K: the full-epilogue variants, as in the default path
    assert calls1[0] == "mok_gemm_bk_ef_gather" and "mok_gemm_bn_f32_gather" in calls1, calls1
    for a, b in zip(got, want):
        if b is not None:
            assert torch.equal(a, b)
    used = int(saved0.sched.seg_end[-1])  # padding rows included: they must be the zeros' products
    assert torch.equal(saved1.gate_up[:used], saved0.gate_up[:used])
    # and both are the experts' function (fp32 stand-ins: close to the reference)
    y_ref, _ = reference.experts_forward(x, ids, w, *args)
    assert (got[0].float() - y_ref.float()).norm() <= 2e-2 * y_ref.float().norm()


def test_gather_forward_only(fake_lib, monkeypatch):
    """MOK_GEMM_GATHER=1 alone: the backward's dgrad of down stays on the permuted copy of dy."""
    T, H, I, E, K = 20, 16, 8, 4, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    W13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    W2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    monkeypatch.setenv("MOK_GEMM_GATHER", "1")
    y, saved = cb.experts_forward(x, ids, w, W13, W2)
    cb.experts_backward(torch.randn(T, H, generator=g).bfloat16(), saved, x, ids, w, W13, W2)
    assert fake_lib.calls.count("mok_gemm_bk_ef_gather") == 1
    assert "mok_gemm_bn_f32_gather" not in fake_lib.calls
    assert {"mok_gemm_bn_f32", "mok_gemm_bn_f32_dyn"} & set(fake_lib.calls)  # static or dynamic tiles

