"""cuda_mx on the CPU: the scale pairs the MXFP8 GEMMs read, the NaN-byte guard, when the fused forward takes
MXFP8-only weights as MXFP8, and the first-use check (its verdicts and fallbacks). The kernels themselves run in
tests/gpu/test_mx_gemm_cuda.py."""

import types
import warnings

import pytest
import torch

from mok_nn import cuda_mx
from mok_nn.mxfp8 import MXFP8Tensor, dequantize, quantize


def _weight(E=3, N=40, K=192, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = quantize((torch.randn(E, N, K, generator=g) * 3).to(torch.bfloat16), axis=-1)
    return cuda_mx.MxWeight(q.data, q.scale)


def test_scale_pairs_hold_both_blocks_of_each_k_pair_rows_adjacent():
    w = _weight()
    pairs = cuda_mx.scale_pairs(w.scale)
    E, N, KB = w.scale.shape
    assert pairs.shape == (N, KB // 2, E) and pairs.stride() == (1, N, N * KB // 2) and pairs.dtype == torch.uint16
    s = w.scale.long()
    got = pairs.view(torch.int16).long() & 0xFFFF  # [N, K/64, E]
    for e in range(E):
        for j in range(KB // 2):
            assert torch.equal(got[:, j, e], s[e, :, 2 * j] | (s[e, :, 2 * j + 1] << 8))
    assert cuda_mx.scale_pairs(w.scale) is pairs  # kept while the scales are unchanged
    w.scale[0, 0, 0] += 1
    fresh = cuda_mx.scale_pairs(w.scale)
    assert fresh is not pairs and int(fresh.view(torch.int16)[0, 0, 0]) & 0xFF == int(w.scale[0, 0, 0])


def test_operand_views_and_dequantized():
    w = _weight()
    b, _ = w.kernel_operands()
    E, N, K = w.shape
    assert b.shape == (N, K, E) and b.stride() == (K, 1, N * K) and b.dtype == torch.uint8
    assert torch.equal(b.permute(2, 0, 1), w.data.view(torch.uint8))
    assert w.dtype == torch.bfloat16 and w.dim() == 3
    assert torch.equal(w.dequantized(), dequantize(MXFP8Tensor(w.data, w.scale, 2), torch.bfloat16))


def test_nan_bytes_only_in_nan_blocks_pass():
    w = _weight()
    assert cuda_mx.nan_free(w.data, w.scale)
    data = w.data.view(torch.uint8)
    scale = w.scale.clone()
    scale[1, 5, 2] = 255  # a NaN block: its bytes may be anything
    data[1, 5, 64 + 7] = 0x7F
    assert cuda_mx.nan_free(w.data, scale)
    data[2, 0, 3] = 0xFF  # an E4M3 NaN under a finite scale: the kernels would make it finite
    assert not cuda_mx.nan_free(w.data, scale)
    data[2, 0, 3] = 0x01
    assert cuda_mx.nan_free(w.data, scale)  # the data changed (version): checked again


def test_forward_reason():
    w13, w2 = _weight(N=64, K=128), _weight(N=128, K=32)
    cuda_ws = types.SimpleNamespace(backend="cuda", ep_size=1)
    assert "EP = 1" in cuda_mx.forward_reason(types.SimpleNamespace(backend="torch", ep_size=1), w13.data, w13.scale,
                                              w2.data, w2.scale, torch.bfloat16)
    assert "EP = 1" in cuda_mx.forward_reason(types.SimpleNamespace(backend="cuda", ep_size=2), w13.data, w13.scale,
                                              w2.data, w2.scale, torch.bfloat16)
    assert "CUDA" in cuda_mx.forward_reason(cuda_ws, w13.data, w13.scale, w2.data, w2.scale, torch.bfloat16)
    assert "CUDA" in cuda_mx.forward_reason(cuda_ws, w13.data, w13.scale, w2.data, w2.scale, torch.float32)


def _sched(rows):
    """A schedule whose routed rows are 0 .. rows - 1 (pos, as the check reads them)."""
    return types.SimpleNamespace(pos=torch.arange(rows).view(-1, 1))


@pytest.fixture
def fresh_verdicts(monkeypatch):
    monkeypatch.setattr(cuda_mx, "_VERDICTS", {})


def test_verified_agreeing_kernel_runs_alone_after_its_first_use(fresh_verdicts):
    calls = []
    good = torch.randn(6, 4).to(torch.bfloat16)
    unwritten = torch.cat([good[:4], torch.full((2, 4), float("nan"), dtype=torch.bfloat16)])

    def run_mx():
        calls.append("mx")
        return unwritten.clone()  # rows that are not routed rows (4, 5) are not compared

    def run_bf16():
        calls.append("bf16")
        return good.clone()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(cuda_mx.verified("k", _sched(4), run_mx, run_bf16)[:4], good[:4])
        cuda_mx.verified("k", _sched(4), run_mx, run_bf16)
    assert calls == ["mx", "bf16", "mx"]


def test_verified_disagreeing_or_failing_kernel_is_dropped_with_a_warning(fresh_verdicts):
    good = torch.randn(4, 4).to(torch.bfloat16)
    off = good.clone()
    off[1, 2] = -off[1, 2] - 1
    calls = []

    def run_bf16():
        calls.append("bf16")
        return good.clone()

    with pytest.warns(RuntimeWarning, match="differ"):
        got = cuda_mx.verified("k", _sched(4), lambda: off.clone(), run_bf16)
    assert torch.equal(got, good)
    got = cuda_mx.verified("k", _sched(4), lambda: pytest.fail("not run again"), run_bf16)
    assert torch.equal(got, good) and calls == ["bf16", "bf16"]

    def broken():
        raise RuntimeError("launch failed")

    with pytest.warns(RuntimeWarning, match="launch failed"):
        got = cuda_mx.verified("k2", _sched(4), broken, run_bf16)
    assert torch.equal(got, good)


def test_verified_compares_bits_not_values(fresh_verdicts):
    """-0.0 against +0.0 is a difference (a kernel must give the bf16 kernel's bits)."""
    good = torch.zeros(4, 2, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="differ"):
        cuda_mx.verified("k", _sched(4), lambda: -good, lambda: good.clone())


def test_inference_tensors_are_read_without_a_cache():
    """Weights made under torch.inference_mode have no version counter: pairs and the guard are computed each
    time (same values), not cached."""
    with torch.inference_mode():
        w = _weight()
    pairs = cuda_mx.scale_pairs(w.scale)
    assert torch.equal(pairs.view(torch.int16), cuda_mx.scale_pairs(w.scale).view(torch.int16))
    assert w.scale not in cuda_mx._PAIRS
    assert cuda_mx.nan_free(w.data, w.scale) and w.data not in cuda_mx._NAN_FREE


def test_launches_fit_the_kernels_specs(monkeypatch):
    """The host side of the MX kernels on a CPU stub library: each launch's arguments checked against the
    registry spec as the real library checks them (count, dtypes, ranks, strides, divisibility), and the bf16
    W13 still goes to its own kernel through the shared launcher."""
    from mok_nn import cuda_backend as cb
    from mok_nn.kernels import loader

    launched = []

    class Stub:
        def launch(self, name, *args, stream):
            loader.check_launch_args(name, args, on_device=False)
            launched.append(name)

    monkeypatch.setattr(cb, "_lib", lambda: Stub())
    monkeypatch.setattr(cb, "_stream", lambda: 0)
    E, H, I = 4, 128, 128
    ids = torch.randint(0, E, (50, 2), generator=torch.Generator().manual_seed(1))
    sched = cb.make_schedule_torch(ids, E)
    a = torch.zeros(sched.capacity, H, dtype=torch.bfloat16)
    w13, w2 = _weight(E, 2 * I, H), _weight(E, H, I)
    assert cb.gemm_mx(a, w13, sched).shape == (sched.capacity, 2 * I)
    gate_up, h = cb.launch_gate_up_act(a, w13, sched, "swiglu", None)
    assert gate_up.shape == (sched.capacity, 2 * I) and h.shape == (sched.capacity, I)
    cb.launch_gate_up_act(a, w13.dequantized(), sched, "swiglu", None)
    assert cb.gemm_mx(torch.zeros(sched.capacity, I, dtype=torch.bfloat16), w2, sched).shape == (sched.capacity, H)
    assert launched == ["mok_gemm_bk_mx", "mok_gemm_gate_up_swiglu_mx", "mok_gemm_gate_up_swiglu_ppc",
                        "mok_gemm_bk_mx"]
    with pytest.raises(ValueError, match="along K"):
        cb.grouped_gemm(a, w13, sched, transpose_w=True)
    # the backward's dgrad kernels on the same weights (d x: K = 2I, N = H; d h: K = H, N = I, fp32)
    c13, c2 = cuda_mx.MxColumnWeight(w13.data, w13.scale), cuda_mx.MxColumnWeight(w2.data, w2.scale)
    launched.clear()
    dgu = torch.zeros(sched.capacity, 2 * I, dtype=torch.bfloat16)
    assert cb.gemm_mx_cols(dgu, c13, sched, "mok_gemm_bn_mxq", torch.bfloat16).shape == (sched.capacity, H)
    assert cb.gemm_mx_cols(a, c2, sched, "mok_gemm_bn_mxq_f32", torch.float32).dtype == torch.float32
    assert launched == ["mok_gemm_bn_mxq", "mok_gemm_bn_mxq_f32"]
    with pytest.raises(ValueError, match="transposed"):
        cb.grouped_gemm(a, c2, sched, transpose_w=False)


def test_many_rows_per_expert_take_the_dequantised_weights(monkeypatch, fresh_verdicts):
    """grouped_gemm and gate_up_act give an MxWeight to their _mx kernel up to that kernel's
    MX_MAX_ROWS_PER_EXPERT routed rows per expert on average, and dequantise it for the bf16 kernels above (stub
    library: the launched names)."""
    from mok_nn import cuda_backend as cb

    launched = []

    class Stub:
        def launch(self, name, *args, stream):
            launched.append(name)

    monkeypatch.setattr(cb, "_lib", lambda: Stub())
    monkeypatch.setattr(cb, "_stream", lambda: 0)
    monkeypatch.setattr(cuda_mx, "MX_MAX_ROWS_PER_EXPERT", {"mok_gemm_bk_mx": 25, "mok_gemm_gate_up_swiglu_mx": 50})
    for kernel in cuda_mx.MX_MAX_ROWS_PER_EXPERT:
        cuda_mx._VERDICTS[(kernel, "cpu")] = True  # past their first-use check
    E, H, I = 4, 128, 128
    w13 = _weight(E, 2 * I, H)
    bf16_gemm, bf16_act = cb.gemm_kernel(False, k=H), "mok_gemm_gate_up_swiglu_ppc"
    # 2 routed rows per token over 4 experts: 25, 25.5, 50 and 50.5 rows per expert
    for tokens, want in ((50, ["mok_gemm_bk_mx", "mok_gemm_gate_up_swiglu_mx"]),
                         (51, [bf16_gemm, "mok_gemm_gate_up_swiglu_mx"]),
                         (100, [bf16_gemm, "mok_gemm_gate_up_swiglu_mx"]),
                         (101, [bf16_gemm, bf16_act])):
        ids = torch.randint(0, E, (tokens, 2), generator=torch.Generator().manual_seed(tokens))
        sched = cb.make_schedule_torch(ids, E)
        a = torch.zeros(sched.capacity, H, dtype=torch.bfloat16)
        launched.clear()
        cb.grouped_gemm(a, w13, sched, transpose_w=False)
        cb.gate_up_act(a, w13, sched, "swiglu", None)
        assert launched == want, tokens


def test_column_weight_operands_and_values():
    """MxColumnWeight: the E4M3 bytes as (C, R, E) N-major with no copy, the row factors (R, C / 32, E), R fastest,
    as bf16 2**(S - 7) for each scale byte S, and its values: W_q's MXFP8 values along R (fake_quantize_fast of
    the dequantised weights along dim 1, an independent path)."""
    from mok_nn.mxfp8 import fake_quantize_fast

    g = torch.Generator().manual_seed(5)
    # magnitudes in [0.5, 1.9): no value rounds along R, but in the blocks of expert 1, rows 64 .. 95, columns
    # 256 .., whose rows have unlike scales
    w = (torch.rand(3, 128, 320, generator=g) * 1.4 + 0.5) * torch.randn(3, 128, 320, generator=g).sign()
    w[1, 64:96, 256:] *= 2.0 ** -torch.randint(0, 16, (32, 1), generator=g).float()
    q = quantize(w.to(torch.bfloat16), axis=-1)
    w = cuda_mx.MxColumnWeight(q.data, q.scale)
    E, R, C = w.shape
    b, factors = w.kernel_operands()
    assert b.shape == (C, R, E) and b.stride() == (1, C, R * C) and b.dtype == torch.uint8
    assert b.data_ptr() == w.data.data_ptr()
    assert factors.shape == (R, C // 32, E) and factors.stride() == (1, R, R * C // 32)
    assert factors.dtype == torch.uint16
    bits = factors.view(torch.int16).permute(2, 0, 1)  # [E, R, C / 32]
    f = (bits & ~cuda_mx.ROUNDS_FLAG).view(torch.bfloat16).float()
    assert torch.equal(f, 2.0 ** (w.scale.float() - 7))
    w_q = dequantize(MXFP8Tensor(w.data, w.scale, 2), torch.bfloat16)
    along_r = fake_quantize_fast(w_q, axis=1)
    assert torch.equal(w.values(), along_r)
    assert not torch.equal(w.values(), w_q)  # a second quantisation: some values change
    # ROUNDS_FLAG in the factors of each 32 x 32 block holding a changed value; nowhere else, and no other bit
    changed = (along_r != w_q).view(E, R // 32, 32, C // 32, 32).any(dim=4).any(dim=2)  # [E, R / 32, C / 32]
    block_flag = (bits & cuda_mx.ROUNDS_FLAG).bool()
    for r in range(R):
        for b in range(C // 32):
            assert torch.equal(block_flag[:, r, b], changed[:, r // 32, b])
    assert block_flag.sum() == 32 * 2 and block_flag[1, 64:96, 8:].all()  # its blocks of rows 64 .. 95
    assert torch.equal(bits & 0x7F, block_flag.to(torch.int16) * cuda_mx.ROUNDS_FLAG)


def test_column_reason(monkeypatch):
    """The dgrad kernels take MXFP8-only weights where the forward's GEMMs do and every scale byte is at most
    COLUMN_MAX_SCALE (kept per scale tensor while unchanged)."""
    w13, w2 = _weight(N=64, K=128), _weight(N=128, K=32)
    torch_ws = types.SimpleNamespace(backend="torch", ep_size=1)
    assert "EP = 1" in cuda_mx.column_reason(torch_ws, w13.data, w13.scale, w2.data, w2.scale, torch.bfloat16)
    assert cuda_mx.largest_scale(w13.scale) == int(w13.scale.max()) <= cuda_mx.COLUMN_MAX_SCALE
    w13.scale[0, 0, 0] = cuda_mx.COLUMN_MAX_SCALE + 1
    assert cuda_mx.largest_scale(w13.scale) == cuda_mx.COLUMN_MAX_SCALE + 1  # the version changed: read again
    # where the forward's conditions hold, the scale range decides
    monkeypatch.setattr(cuda_mx, "forward_reason", lambda *args: None)
    assert "above 134" in cuda_mx.column_reason(torch_ws, w13.data, w13.scale, w2.data, w2.scale, torch.bfloat16)
    w13.scale[0, 0, 0] = cuda_mx.COLUMN_MAX_SCALE
    assert cuda_mx.column_reason(torch_ws, w13.data, w13.scale, w2.data, w2.scale, torch.bfloat16) is None


def test_trained_weights_come_as_bytes_where_their_mx_kernel_takes_the_call(monkeypatch):
    """GemmOperands(..., weight_bytes=True).forward_weight (the one-GPU forward with precision="mxfp8"): a trained
    weight (requires grad) whose _mx kernel takes the call comes as an MxWeight holding the MXFP8 values along K
    (checked against the slow quantiser, fake_quantize); a frozen weight, too many rows per expert, widths that are
    not multiples of 64, no one-pass quantiser, the portable path's operands (no weight_bytes) or bf16: the
    values in bf16 (or the weight itself)."""
    from mok_nn import cuda_backend as cb
    from mok_nn import triton_ops
    from mok_nn.mxfp8 import fake_quantize

    monkeypatch.setattr(triton_ops, "quantize_runs_on", lambda x, axis: True)  # (a CPU tensor here)
    monkeypatch.setattr(cuda_mx, "MX_MAX_ROWS_PER_EXPERT", {"mok_gemm_bk_mx": 25})
    g = torch.Generator().manual_seed(3)
    block_scale = torch.exp2(torch.randint(-8, 8, (4, 128, 6, 1), generator=g).float()).expand(-1, -1, -1, 32)
    w = (torch.randn(4, 128, 192, generator=g) * block_scale.reshape(4, 128, 192)).to(torch.bfloat16)
    w.requires_grad_(True)
    want = fake_quantize(w.detach(), -1)
    q = cb.GemmOperands("mxfp8", weight_bytes=True)

    def sched(tokens):  # 2 routed rows a token over 4 experts
        return cb.make_schedule_torch(torch.randint(0, 4, (tokens, 2), generator=g), 4)

    got = q.forward_weight(w, sched(50), "mok_gemm_bk_mx")  # 25 rows per expert
    assert isinstance(got, cuda_mx.MxWeight) and torch.equal(got.dequantized(), want)
    for other, s, op in ((w, sched(51), q), (w.detach(), sched(50), q),
                         (w, sched(50), cb.GemmOperands("mxfp8"))):
        values = op.forward_weight(other, s, "mok_gemm_bk_mx")
        assert not isinstance(values, cuda_mx.MxWeight) and torch.equal(values, want)
    narrow = w.detach()[:, :96].clone().requires_grad_(True)
    assert not isinstance(q.forward_weight(narrow, sched(50), "mok_gemm_bk_mx"), cuda_mx.MxWeight)
    # trained weights stop at the lower of the two bounds (TRAINED_MX_MAX_ROWS_PER_EXPERT: 24 here, 25 frozen)
    monkeypatch.setattr(cuda_mx, "TRAINED_MX_MAX_ROWS_PER_EXPERT", 24)
    s50 = sched(50)
    assert cuda_mx.reads_mx("mok_gemm_bk_mx", s50, w)
    values = q.forward_weight(w, s50, "mok_gemm_bk_mx")
    assert not isinstance(values, cuda_mx.MxWeight) and torch.equal(values, want)
    assert isinstance(q.forward_weight(w, sched(48), "mok_gemm_bk_mx"), cuda_mx.MxWeight)
    assert cb.GemmOperands("bf16", weight_bytes=True).forward_weight(w, sched(50), "mok_gemm_bk_mx") is w
    monkeypatch.setattr(triton_ops, "quantize_runs_on", lambda x, axis: False)
    assert not isinstance(q.forward_weight(w, sched(50), "mok_gemm_bk_mx"), cuda_mx.MxWeight)
