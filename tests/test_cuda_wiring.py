"""The one-GPU path's host wiring (cuda_backend), on the CPU with torch stand-ins for the kernels.

The stand-in library checks every launch against its registry spec (argument count, dtypes, ranks,
fixed extents) and computes the varlen-M grouped GEMMs in fp32 tile by tile. What is tested is the
plumbing: which kernel runs for which shape (the measured rules), that every launch matches its
kernel's arguments, and that the results are the experts' function; the kernels themselves are checked
on the GPU (tests/gpu/test_cuda_kernels.py).
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
        if spec.factory == "VarlenMGroupedGemm":
            a, b, c, te, seg_end, seg_rows, _ = args
            _gemm(a[:, :, 0], b, c, te)
        elif spec.factory == "VarlenMGroupedGemmDyn":  # dynamic tiles: the same tiles, claimed from a zeroed counter
            a, b, c, te, seg_end, seg_rows, _, counter = args
            assert int(counter[0]) == 0, f"{name}: tile counter not zeroed before the launch"
            _gemm(a[:, :, 0], b, c, te)
        elif spec.factory == "MxQuant":
            src, dst, te, seg_end, seg_rows, mode, grid = args
            assert mode in (0, 1, 2) and grid >= 1
            dst.copy_(_mx_quant(src, mode, seg_end, seg_rows))
        else:
            raise AssertionError(f"stand-in has no {name}")


def _mx_quant(src, mode, seg_end, seg_rows):
    """mok_mx_quant's contract, from mxfp8.fake_quantize (the slow quantiser): along the columns (mode 0), the
    rows (1), or the rows with only each expert's routed rows (the first seg_rows of its segment) kept (2)."""
    from mok_nn.mxfp8 import fake_quantize

    if mode == 0:
        return fake_quantize(src, -1)
    if mode == 2:
        kept = torch.zeros_like(src)
        start = 0
        for end, n in zip(seg_end.tolist(), seg_rows.tolist()):
            kept[start:start + n] = src[start:start + n]
            start = end
        src = kept
    return fake_quantize(src, 0)


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
    monkeypatch.setenv("MOK_ACT", "torch")  # no fused activation kernels: the plain GEMMs everywhere
    monkeypatch.delenv("MOK_GEMM", raising=False)
    monkeypatch.setattr(cb, "weight_grad", _torch_weight_grad)
    return lib


def _torch_weight_grad(a_rows, b_rows, sched, counts, into=None):
    """The weight gradients by torch._grouped_mm (the kernels' contract; MOK_GEMM=torch's formula)."""
    out = torch._grouped_mm(a_rows.t(), b_rows, offs=sched.seg_end)
    return out if into is None else into.add_(out.to(into.dtype))


@pytest.mark.parametrize("T,H,I,bias,activation,limit", [
    (37, 32, 16, False, "swiglu", None),  # every K <= 1024: the clustered ping-pong kernels
    (1, 32, 16, True, "swiglu_oai", 7.0),
    (20, 1040, 520, False, "swiglu", None),  # K = H, 2I > 1024: the whole-tile kernels with dynamic tiles
])
def test_default_path_launches_and_function(fake_lib, T, H, I, bias, activation, limit):
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(T, H, I, 4, 2, bias, seed=T + H)
    args = (W13, W2, b13, b2, activation, limit)
    y, saved = cb.experts_forward(x, ids, w, *args)
    dx, dtk, grads = cb.experts_backward(dy, saved, x, ids, w, *args)
    gemms = [c for c in fake_lib.calls if c.startswith("mok_gemm")]
    # forward gate/up (K = H), down (K = I); backward dgrad of down (fp32), dgrad of gate/up (K = 2I)
    assert gemms == [cb.gemm_kernel(False, k=H), cb.gemm_kernel(False, k=I), "mok_gemm_bn_f32_dyn",
                     cb.gemm_kernel(True, k=2 * I)], gemms
    assert saved.x_rows is not None
    # the experts' function (fp32 stand-ins, bf16 roundings: close to the reference)
    y_ref, saved_r = reference.experts_forward(x, ids, w, *args)
    dx_r, dtk_r, grads_r = reference.experts_backward(dy, saved_r, x, ids, w, *args)
    for got, want in ((y, y_ref), (dx, dx_r), (dtk, dtk_r), (grads.gate_up_proj, grads_r.gate_up_proj),
                      (grads.down_proj, grads_r.down_proj)):
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


def test_backward_frees_each_row_buffer_before_the_next_one(fake_lib, monkeypatch):
    """Peak memory of the backward: the d y rows and w h are gone when the d x rows are computed (the down
    weight's gradient ran first), and the d x rows are gone when the gate/up weight's gradient runs; the result
    is the same as before the spies."""
    import weakref

    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, False, seed=7)
    args = (W13, W2, b13, b2, "swiglu", None)
    _, saved = cb.experts_forward(x, ids, w, *args)
    want = cb.experts_backward(dy, saved, x, ids, w, *args)
    refs, events = {}, []
    gather, act_b, gemm, wgrad = cb.gather_rows, cb.act_backward, cb.grouped_gemm, cb.weight_grad

    def alive(name):
        return name in refs and refs[name]() is not None

    def spy_gather(t, sched, skip_tail=False):
        out = gather(t, sched, skip_tail)
        refs["dy_rows"] = weakref.ref(out)
        return out

    def spy_act_b(*a, **kw):
        dgu, wh, dw = act_b(*a, **kw)
        refs["wh"] = weakref.ref(wh)
        return dgu, wh, dw

    def spy_gemm(a, wt, sched, transpose_w, out_dtype=torch.bfloat16):
        if transpose_w and out_dtype == torch.bfloat16:  # the dgrad of gate/up: the d x rows
            events.append(("dx_rows", alive("dy_rows"), alive("wh")))
            out = gemm(a, wt, sched, transpose_w, out_dtype)
            refs["dx_rows"] = weakref.ref(out)
            return out
        return gemm(a, wt, sched, transpose_w, out_dtype)

    def spy_wgrad(*a, **kw):
        events.append(("wgrad", alive("dx_rows")))
        return wgrad(*a, **kw)

    for name, f in (("gather_rows", spy_gather), ("act_backward", spy_act_b), ("grouped_gemm", spy_gemm),
                    ("weight_grad", spy_wgrad)):
        monkeypatch.setattr(cb, name, f)
    got = cb.experts_backward(dy, saved, x, ids, w, *args)
    assert events == [("wgrad", False), ("dx_rows", False, False), ("wgrad", False)], events
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2].gate_up_proj, want[2].gate_up_proj) and torch.equal(got[2].down_proj,
                                                                                  want[2].down_proj)
