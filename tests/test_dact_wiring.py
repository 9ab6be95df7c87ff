"""MOK_GEMM_DACT wiring of cuda_backend (the dgrad of down with the activation backward in its epilogue, opt-in),
on the CPU with torch stand-ins for the kernels, and pairwise_sum, the fixed-order sum of its partials.

The stand-ins (test_gather_wiring._FakeLib, extended) check every launch against its registry spec
and compute the kernels' contracts with torch formulas. What is tested is the plumbing: the fused
kernel is picked where it runs (I % 256 == 0, a SwiGLU activation) and its outputs give the split
path's results; the kernel itself is checked on the GPU (tests/gpu/test_cuda_kernels.py).
"""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import reference
from mok_nn.kernels import registry

from test_cuda_ep_simulated import SpecChecked
from test_gather_wiring import _FakeLib, _gemm, random_problem


def _act_bwd(gu, dh, w, activation, limit):
    """(d gate_up bf16, w*h bf16, dw fp32) of rows: the formulas of swiglu.ActBackward in torch."""
    lim = None if limit == float("inf") else limit
    h = reference.activation_forward(gu.float(), activation, lim).to(gu.dtype).float()
    dgu = reference.activation_backward(gu.float(), w[:, None] * dh, activation, lim).to(gu.dtype)
    return dgu, (w[:, None] * h).to(gu.dtype), dh * h


class _DactLib(_FakeLib):
    def __init__(self, activation):
        super().__init__()
        self.activation = activation

    def launch(self, name, *args, stream):
        spec = registry.SPECS_BY_NAME[name]
        if spec.factory not in ("VarlenMGroupedGemmDact", "ActBackward", "ActForward"):
            return super().launch(name, *args, stream=stream)
        self.calls.append(name)
        assert name.endswith(self.activation)
        if spec.factory == "ActForward":
            gu, h, te, limit = args
            lim = None if limit == float("inf") else limit
            h.copy_(reference.activation_forward(gu.float(), self.activation, lim).to(h.dtype))
            return
        if spec.factory == "ActBackward":
            gu, dh, w, dgu, wh, dw, te, limit = args
            out_dgu, out_wh, prod = _act_bwd(gu, dh, w, self.activation, limit)
            dgu.copy_(out_dgu), wh.copy_(out_wh), dw.copy_(prod.sum(dim=1))
            return
        a, b, dgu, wh, gu, w, parts, te, seg_end, seg_rows, limit, group_m = args
        assert len(args) == len(spec.args)
        inter = wh.shape[1]
        tile_n = registry.tile_n_of(name)
        assert parts.shape == (inter // tile_n, gu.shape[0]) and parts.dtype == torch.float32
        dh = torch.zeros(gu.shape[0], inter, 1)
        _gemm(a[:, :, 0], b, dh, te)
        out_dgu, out_wh, prod = _act_bwd(gu[:, :, 0], dh[:, :, 0], w, self.activation, limit)
        dgu[:, :, 0].copy_(out_dgu), wh[:, :, 0].copy_(out_wh)
        parts.copy_(prod.view(prod.shape[0], -1, tile_n).sum(dim=2).T)


@pytest.fixture
def dact_lib(monkeypatch):
    def make(activation):
        lib = _DactLib(activation)
        monkeypatch.setattr(cb, "_lib", lambda: SpecChecked(lib))
        return lib

    monkeypatch.setattr(cb, "_stream", lambda: 0)
    monkeypatch.setattr(cb, "check_supported", lambda *a: None)
    monkeypatch.setattr(cb, "combine", cb.combine_torch)
    monkeypatch.setenv("MOK_WGRAD", "torch")
    for var in ("MOK_GEMM", "MOK_ACT", "MOK_GEMM_GATHER", "MOK_GEMM_GATHER_DY", "MOK_GEMM_ACT", "MOK_GEMM_DACT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOK_GEMM_EPI", "split")
    # the cooperative kernels: with the default (auto) these small shapes would take the ping-pong ones
    monkeypatch.setenv("MOK_GEMM_PINGPONG", "0")
    return make


@pytest.mark.parametrize("I,activation,limit,bias", [(256, "swiglu", None, False), (512, "swiglu_oai", 7.0, True)])
def test_fused_dact_equals_split(dact_lib, monkeypatch, I, activation, limit, bias):
    lib = dact_lib(activation)
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(41, 32, I, 4, 2, bias, seed=I)
    args = (W13, W2, b13, b2, activation, limit)

    def run(mode):
        monkeypatch.setenv("MOK_GEMM_DACT", mode)
        lib.calls.clear()
        y, saved = cb.experts_forward(x, ids, w, *args)
        dx, dtk, gr = cb.experts_backward(dy, saved, x, ids, w, *args)
        return [dx, gr.gate_up_proj, gr.down_proj, gr.gate_up_bias, gr.down_bias, dtk], list(lib.calls)

    monkeypatch.delenv("MOK_GEMM_DACT", raising=False)
    lib.calls.clear()
    cb.experts_backward(dy, cb.experts_forward(x, ids, w, *args)[1], x, ids, w, *args)
    assert f"mok_act_bwd_{activation}" in lib.calls, "with MOK_GEMM_PINGPONG=0 the default is the split path"
    split, calls_split = run("split")
    fused, calls_fused = run("fused")
    assert f"mok_gemm_dact_{activation}" in calls_fused and f"mok_act_bwd_{activation}" not in calls_fused
    bn_f32 = ("mok_gemm_bn_f32", "mok_gemm_bn_f32_dyn")  # static or dynamic tiles (MOK_GEMM_TILES)
    assert not set(bn_f32) & set(calls_fused)
    assert set(bn_f32) & set(calls_split) and f"mok_act_bwd_{activation}" in calls_split
    for a, b in zip(split[:5], fused[:5]):
        if b is not None:
            assert torch.equal(a, b)
    assert torch.allclose(fused[5], split[5], rtol=1e-5, atol=1e-6)
    # and the experts' function (fp32 stand-ins: close to the reference)
    _, saved_r = reference.experts_forward(x, ids, w, *args)
    _, dtk_r, _ = reference.experts_backward(dy, saved_r, x, ids, w, *args)
    assert (fused[5] - dtk_r).norm() <= 2e-2 * dtk_r.norm()


def test_fused_dact_falls_back_where_unsupported(dact_lib, monkeypatch):
    """I % 256 != 0: the fused kernel cannot tile it, so the split kernels run; bad mode names are rejected."""
    lib = dact_lib("swiglu")
    monkeypatch.setenv("MOK_GEMM_DACT", "fused")
    x, ids, w, dy, W13, W2, _, _ = random_problem(9, 16, 192, 4, 2, False, seed=1)
    y, saved = cb.experts_forward(x, ids, w, W13, W2)
    cb.experts_backward(dy, saved, x, ids, w, W13, W2)
    assert "mok_act_bwd_swiglu" in lib.calls and not any("dact" in c for c in lib.calls)
    with pytest.raises(ValueError, match="mok_gemm_dact"):
        cb.dgrad_act(saved.gate_up[:, :16], W2, saved.gate_up, torch.zeros(saved.gate_up.shape[0]), saved.sched,
                     "swiglu", None)
    monkeypatch.setenv("MOK_GEMM_DACT", "maybe")
    with pytest.raises(ValueError, match="MOK_GEMM_DACT"):
        cb.experts_backward(dy, saved, x, ids, w, W13, W2)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 56])
def test_pairwise_sum(n):
    """Close to an fp64 sum; a row's bits do not depend on where it sits or how many rows there are."""
    g = torch.Generator().manual_seed(n)
    parts = torch.randn(n, 300, generator=g) * torch.logspace(-3, 3, 300)
    got = cb.pairwise_sum(parts)
    want = parts.double().sum(dim=0)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    perm = torch.randperm(300, generator=g)
    assert torch.equal(cb.pairwise_sum(parts[:, perm]), got[perm])
    assert torch.equal(cb.pairwise_sum(parts[:, 17:40].contiguous()), got[17:40])


def test_pingpong_auto_rule(monkeypatch):
    """MOK_GEMM_PINGPONG=auto (default): the clustered ping-pong kernels where K is at most
    PINGPONG_AUTO_MAX_K of the GEMM kind, and MOK_GEMM_ACT / MOK_GEMM_DACT=auto fused exactly there;
    the other modes pick one form everywhere; bad values are rejected."""
    for var in ("MOK_GEMM_PINGPONG", "MOK_GEMM_ACT", "MOK_GEMM_DACT"):
        monkeypatch.delenv(var, raising=False)
    limits = cb.PINGPONG_AUTO_MAX_K
    for kind, k_max in limits.items():
        assert cb.pingpong_suffix(kind, k_max) == "_ppc" and cb.pingpong_suffix(kind, k_max + 8) == ""
    # the benchmark shapes (H, I): qwen3 (2048, 768), mixtral (4096, 14336), deepseek-v3 (7168, 2048)
    assert [cb._fused_mode("MOK_GEMM_DACT", "dact", h) for h in (2048, 4096, 7168)] == [True, True, False]
    # the gate/up + activation: also on the cooperative kernel with the whole tile in smem (K <= 8192), not past it
    assert [cb._fused_mode("MOK_GEMM_ACT", "act", h) for h in (2048, 4096, 7168, 8200)] == [True, True, True, False]
    monkeypatch.setenv("MOK_GEMM_EPI", "split")
    assert [cb._fused_mode("MOK_GEMM_ACT", "act", h) for h in (2048, 4096)] == [True, False]
    monkeypatch.delenv("MOK_GEMM_EPI")
    assert cb.gemm_kernel(False, k=768) == "mok_gemm_bk_ppc" and cb.gemm_kernel(True, k=2048) != "mok_gemm_bn_ppc"
    assert cb.gemm_kernel(False, k=768, pingpong=False) in ("mok_gemm_bk", "mok_gemm_bk_ef")
    assert cb.gemm_kernel(False, torch.float32, k=768) == "mok_gemm_bn_f32"
    for mode, suffix in (("0", ""), ("1", "_pp"), ("cluster", "_ppc")):
        monkeypatch.setenv("MOK_GEMM_PINGPONG", mode)
        assert cb.pingpong_suffix("gemm", 64) == suffix and cb.pingpong_suffix("dact", 99999) == suffix
        assert cb._fused_mode("MOK_GEMM_DACT", "dact", 99999) == (suffix != "")
    monkeypatch.setenv("MOK_GEMM_PINGPONG", "0")
    monkeypatch.setenv("MOK_GEMM_DACT", "fused")
    assert cb._fused_mode("MOK_GEMM_DACT", "dact", 2048)
    monkeypatch.delenv("MOK_GEMM_DACT")
    for var, bad in (("MOK_GEMM_PINGPONG", "2"), ("MOK_GEMM_DACT", "maybe")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            cb._fused_mode("MOK_GEMM_DACT", "dact", 2048)
        monkeypatch.delenv(var)
    # an odd count of column tiles takes the unclustered kernel (the clustered epilogue would write past it)
    monkeypatch.setenv("MOK_GEMM_PINGPONG", "cluster")
    assert cb._fused_kernel("mok_gemm_dact_swiglu", "dact", 2048, 6) == "mok_gemm_dact_swiglu_ppc"
    assert cb._fused_kernel("mok_gemm_dact_swiglu", "dact", 2048, 3) == "mok_gemm_dact_swiglu_pp"
    monkeypatch.delenv("MOK_GEMM_PINGPONG")
    for name in [s.name for s in registry.SPECS if s.name.endswith(("_pp", "_ppc"))]:
        assert registry.tile_n_of(name) == registry.PINGPONG_TILE_N
