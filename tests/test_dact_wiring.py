"""The fused-epilogue GEMMs' wiring in cuda_backend (the gate/up GEMM with the activation in its epilogue, the
dgrad of down with the activation backward in its epilogue), on the CPU with torch stand-ins for the kernels,
the kernel-choice rules, and pairwise_sum, the fixed-order sum of the fused kernel's partials.

The stand-ins (test_cuda_wiring._FakeLib, extended) check every launch against its registry spec
and compute the kernels' contracts with torch formulas. What is tested is the plumbing: the fused
kernels are picked where they run and their outputs give the unfused path's results; the kernels
themselves are checked on the GPU (tests/gpu/test_cuda_kernels.py).
"""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import reference
from mok_nn.kernels import registry
from mok_nn.mxfp8 import fake_quantize

from test_cuda_ep_simulated import SpecChecked
from test_cuda_wiring import _FakeLib, _gemm, _torch_weight_grad, random_problem


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
        if spec.factory not in ("VarlenMGroupedGemmDact", "VarlenMGroupedGemmAct", "ActBackward", "ActForward"):
            return super().launch(name, *args, stream=stream)
        self.calls.append(name)
        assert self.activation in name
        if spec.factory == "VarlenMGroupedGemmAct":  # gate_up = a @ W13^T per tile, h = act(gate_up in bf16)
            a, b, gu, h, te, seg_end, seg_rows, h_mx, limit, group_m = args
            _gemm(a[:, :, 0], b, gu, te)
            lim = None if limit == float("inf") else limit
            used = int(seg_end[-1])
            h[:used, :, 0] = reference.activation_forward(gu[:used, :, 0].float(), self.activation, lim).to(h.dtype)
            if h_mx and not name.endswith("_ppc"):  # the helper-warp forms store h's MXFP8 values
                h[:used, :, 0] = fake_quantize(h[:used, :, 0], -1)
            return
        if spec.factory == "ActForward":
            gu, h, te, limit = args
            lim = None if limit == float("inf") else limit
            h.copy_(reference.activation_forward(gu.float(), self.activation, lim).to(h.dtype))
            return
        if spec.factory == "ActBackward":
            gu, dh, w, dgu, wh, dw, te, limit, mx = args
            out_dgu, out_wh, prod = _act_bwd(gu, dh, w, self.activation, limit)
            if mx:  # d gate_up's MXFP8 values along its columns
                out_dgu = fake_quantize(out_dgu, -1)
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
    monkeypatch.setattr(cb, "weight_grad", _torch_weight_grad)
    for var in ("MOK_GEMM", "MOK_ACT"):
        monkeypatch.delenv(var, raising=False)
    return make


@pytest.mark.parametrize("I,activation,limit,bias", [(256, "swiglu", None, False), (512, "swiglu_oai", 7.0, True)])
def test_fused_epilogues_equal_unfused(dact_lib, monkeypatch, I, activation, limit, bias):
    lib = dact_lib(activation)
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(41, 32, I, 4, 2, bias, seed=I)
    args = (W13, W2, b13, b2, activation, limit)

    def run():
        lib.calls.clear()
        y, saved = cb.experts_forward(x, ids, w, *args)
        dx, dtk, gr = cb.experts_backward(dy, saved, x, ids, w, *args)
        return [y, dx, gr.gate_up_proj, gr.down_proj, gr.gate_up_bias, gr.down_bias, dtk], list(lib.calls)

    fused, calls_fused = run()
    assert f"mok_gemm_dact_{activation}_ppc" in calls_fused and f"mok_act_bwd_{activation}" not in calls_fused
    assert "mok_gemm_bn_f32_dyn" not in calls_fused
    # the gate/up GEMM fuses SwiGLU only (not swiglu_oai, not with a gate/up bias)
    fused_act = activation == "swiglu" and not bias
    assert ("mok_gemm_gate_up_swiglu_ppc" in calls_fused) == fused_act
    assert (f"mok_act_fwd_{activation}" in calls_fused) == (not fused_act)
    monkeypatch.setattr(cb, "_use_fused_dact", lambda *a: False)
    monkeypatch.setattr(cb, "use_fused_act", lambda *a: False)
    split, calls_split = run()
    assert "mok_gemm_bn_f32_dyn" in calls_split and f"mok_act_bwd_{activation}" in calls_split
    assert not any("dact" in c or "gate_up" in c for c in calls_split)
    for a, b in zip(split[:6], fused[:6]):
        if b is not None:
            assert torch.equal(a, b)
    assert torch.allclose(fused[6], split[6], rtol=1e-5, atol=1e-6)
    # and the experts' function (fp32 stand-ins: close to the reference)
    _, saved_r = reference.experts_forward(x, ids, w, *args)
    _, dtk_r, _ = reference.experts_backward(dy, saved_r, x, ids, w, *args)
    assert (fused[6] - dtk_r).norm() <= 2e-2 * dtk_r.norm()


@pytest.mark.parametrize("fused", [True, False])
def test_frozen_mxfp8_d_gate_up_comes_as_its_mxfp8_values(dact_lib, monkeypatch, fused):
    """Frozen experts with precision="mxfp8" and no gate/up bias gradient need d gate_up only as the d x GEMM's
    operand: mok_act_bwd_* stores its MXFP8 values (mx = 1; after the fused dSwiGLU GEMM, one pass), and d x and
    the top-k weight gradient are bitwise the backward's with weight gradients (which quantises d gate_up after
    the kernel, mx = 0)."""
    lib = dact_lib("swiglu")
    if not fused:
        monkeypatch.setattr(cb, "_use_fused_dact", lambda *a: False)
    x, ids, w, dy, W13, W2, _, _ = random_problem(41, 32, 256, 4, 2, False, seed=11)
    args = (W13, W2, None, None, "swiglu", None)
    flags, launch = [], lib.launch

    def recording(name, *a, stream):
        if name.startswith("mok_act_bwd"):
            flags.append(a[-1])
        return launch(name, *a, stream=stream)

    monkeypatch.setattr(lib, "launch", recording)
    runs = []
    for needs in (None, (False, False, True, True)):
        _, saved = cb.experts_forward(x, ids, w, *args, precision="mxfp8")
        kw = {} if needs is None else {"needs": needs}
        runs.append(cb.experts_backward(dy, saved, x, ids, w, *args, precision="mxfp8", **kw))
    (dx, dtk, _), (dx_f, dtk_f, grads_f) = runs
    assert torch.equal(dx_f, dx) and torch.equal(dtk_f, dtk) and grads_f.gate_up_proj is None
    assert flags == ([] if fused else [0, 1])


def test_fused_dact_falls_back_where_unsupported(dact_lib):
    """I % 256 != 0: the fused kernel cannot tile it, so the unfused kernels run; a direct call says why."""
    lib = dact_lib("swiglu")
    x, ids, w, dy, W13, W2, _, _ = random_problem(9, 16, 192, 4, 2, False, seed=1)
    y, saved = cb.experts_forward(x, ids, w, W13, W2)
    cb.experts_backward(dy, saved, x, ids, w, W13, W2)
    assert "mok_act_bwd_swiglu" in lib.calls and not any("dact" in c for c in lib.calls)
    with pytest.raises(ValueError, match="mok_gemm_dact"):
        cb.dgrad_act(saved.gate_up[:, :16], W2, saved.gate_up, torch.zeros(saved.gate_up.shape[0]), saved.sched,
                     "swiglu", None)


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


def test_kernel_choice_rules(monkeypatch):
    """The measured rules: the clustered ping-pong kernels where K is at most PINGPONG_MAX_K of the GEMM kind,
    the whole-tile epilogue with dynamic tiles up to GEMM_FULL_EPI_MAX_K, the split epilogue past it; the
    fused epilogues where they are faster. Every name is a registry kernel."""
    for var in ("MOK_GEMM", "MOK_ACT"):
        monkeypatch.delenv(var, raising=False)
    for kind, k_max in cb.PINGPONG_MAX_K.items():
        assert cb.pingpong(kind, k_max) and not cb.pingpong(kind, k_max + 8)
    # the benchmark shapes (H, I): qwen3 (2048, 768), mixtral (4096, 14336), deepseek-v3 (7168, 2048); the fused
    # dSwiGLU up to H = 2048, on an H200 up to 4096 (dact_max_k by the GPU's name)
    assert [cb._use_fused_dact(2048, "swiglu", h) for h in (2048, 4096, 7168)] == [True, False, False]
    assert cb.dact_max_k(torch.device("cpu")) == cb.DACT_MAX_K_DEFAULT == 2048
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}[i])
    cb._dact_max_k_on.cache_clear()
    try:
        assert [cb.dact_max_k(torch.device("cuda", i)) for i in (0, 1)] == [4096, 2048]
        assert [cb._use_fused_dact(2048, "swiglu", 4096, torch.device("cuda", i)) for i in (0, 1)] == [True, False]
    finally:
        cb._dact_max_k_on.cache_clear()
    assert not cb._use_fused_dact(640, "swiglu", 2048)  # I % 256 != 0
    assert [cb.use_fused_act(768, "swiglu", False, h) for h in (2048, 4096, 7168, 8200)] == [True, True, True, False]
    assert not cb.use_fused_act(768, "swiglu_oai", False, 2048) and not cb.use_fused_act(768, "swiglu", True, 2048)
    assert not cb.use_fused_act(96, "swiglu", False, 2048)  # I % 128 != 0
    monkeypatch.setenv("MOK_ACT", "torch")  # the oracle runs the activation apart
    assert not cb.use_fused_act(768, "swiglu", False, 2048) and not cb._use_fused_dact(2048, "swiglu", 2048)
    monkeypatch.delenv("MOK_ACT")
    want = {(False, 768): "mok_gemm_bk_ppc", (True, 1024): "mok_gemm_bn_ppc", (False, 2048): "mok_gemm_bk_ef_dyn",
            (True, 1536): "mok_gemm_bn_ef_dyn", (False, 14336): "mok_gemm_bk", (True, 28672): "mok_gemm_bn"}
    for (transpose, k), name in want.items():
        assert cb.gemm_kernel(transpose, k=k) == name
    assert cb.gemm_kernel(True, torch.float32, k=768) == "mok_gemm_bn_f32_dyn"
    names = {cb.gemm_kernel(t, d, k) for t in (False, True) for d in (torch.bfloat16, torch.float32)
             for k in (64, 1024, 1032, 8192, 8200)}
    assert names <= set(registry.SPECS_BY_NAME)
    for name in [s.name for s in registry.SPECS if s.name.endswith("_ppc")]:
        assert registry.tile_n_of(name) == registry.PINGPONG_TILE_N


@pytest.mark.parametrize("fused", [True, False])
def test_consumed_gate_up_is_the_activation_kernels_output(dact_lib, monkeypatch, fused):
    """consume_saved (autograd keeps no graph): the fused dSwiGLU GEMM, or mok_act_bwd_*, gets the saved gate_up
    as its d gate_up output too (one buffer, read and overwritten element by element), with the bits of the
    backward that gives them a buffer of their own."""
    import dataclasses

    lib = dact_lib("swiglu")
    if not fused:
        monkeypatch.setattr(cb, "_use_fused_dact", lambda *a: False)
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(41, 32, 256, 4, 2, False, seed=3)
    args = (W13, W2, b13, b2, "swiglu", None)
    _, saved = cb.experts_forward(x, ids, w, *args)
    buffers, launch = [], lib.launch

    def recording(name, *a, stream):
        if "dact" in name:  # (a, b, d gate_up, wh, gate_up, ...)
            buffers.append((a[2].data_ptr(), a[4].data_ptr()))
        elif name.startswith("mok_act_bwd"):  # (gate_up, dh, w, d gate_up, ...)
            buffers.append((a[3].data_ptr(), a[0].data_ptr()))
        return launch(name, *a, stream=stream)

    monkeypatch.setattr(lib, "launch", recording)
    want = cb.experts_backward(dy, saved, x, ids, w, *args)
    assert len(buffers) == 1 and buffers[0][0] != buffers[0][1]
    buffers.clear()
    got = cb.experts_backward(dy, saved, x, ids, w, *args, consume_saved=True)
    assert buffers == [(saved.gate_up.data_ptr(), saved.gate_up.data_ptr())]
    for a, b in zip((got[0], got[1], *dataclasses.astuple(got[2])[2:]),
                    (want[0], want[1], *dataclasses.astuple(want[2])[2:])):
        assert (a is None and b is None) or torch.equal(a, b)
