"""MXFP8 quantisation: byte-exact against an independent numpy model of the rule."""

import numpy as np
import pytest
import torch

from mok_nn.mxfp8 import MXFP8Tensor, dequantize, fake_quantize, quantize

# ---------------------------------------------------------------------------
# Independent reference: float64 / integer bit manipulation, element by element.
# ---------------------------------------------------------------------------


def _e4m3_value(code: int) -> float:
    """Value of an E4M3FN byte (sign ignored), decoded from its bit fields."""
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0:
        return man / 8.0 * 2.0**-6
    return (1.0 + man / 8.0) * 2.0 ** (exp - 7)


_POS_CODES = np.arange(0x7F)  # 0x00..0x7E: the finite non-negative codes, increasing values
_POS_VALUES = np.array([_e4m3_value(int(c)) for c in _POS_CODES])


def ref_e4m3_bits(v: np.ndarray) -> np.ndarray:
    """Round float64 values (|v| <= 448) to nearest E4M3 code, ties to the even code."""
    mag = np.abs(v)
    assert np.all(mag <= 448.0)
    hi = np.searchsorted(_POS_VALUES, mag, side="left")  # first value >= mag
    hi = np.minimum(hi, len(_POS_VALUES) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - _POS_VALUES[lo], _POS_VALUES[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (_POS_CODES[hi] % 2 == 0))
    code = np.where(pick_hi, _POS_CODES[hi], _POS_CODES[lo])
    code = np.where(mag == _POS_VALUES[hi], _POS_CODES[hi], code)
    return (code | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def ref_scale_exponent(amax32: np.ndarray, mode: str) -> np.ndarray:
    """Scale exponent from the fp32 bit fields of amax (finite amax only)."""
    bits = amax32.astype(np.float32).view(np.uint32).astype(np.int64)
    biased, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    p = biased - 127  # amax = 1.man * 2**p for normal amax
    e = p - 8
    if mode == "rceil":
        e = e + (man > 0x600000)  # 1.man > 1.75
    e = np.where(biased == 0, -127, e)  # zero and fp32 subnormals
    return np.clip(e, -127, 127)


def ref_quantize(x: torch.Tensor, axis: int, mode: str, bs: int = 32):
    """Returns (data bytes, scale bytes) with the layout of mok_nn.mxfp8.quantize."""
    a = np.moveaxis(x.float().numpy(), axis, -1)
    blocks = a.reshape(*a.shape[:-1], a.shape[-1] // bs, bs)
    data = np.zeros(blocks.shape, np.uint8)
    scale = np.zeros(blocks.shape[:-1], np.uint8)
    for idx in np.ndindex(*blocks.shape[:-1]):
        blk = blocks[idx].astype(np.float64)
        if not np.all(np.isfinite(blk)):
            scale[idx], data[idx] = 0xFF, 0x7F
            continue
        amax = np.float32(np.max(np.abs(blk)))
        e = int(ref_scale_exponent(np.array([amax]), mode)[0])
        v = blk * 2.0 ** (-e)  # exact in float64
        if mode == "floor":
            v = np.clip(v, -448.0, 448.0)
        scale[idx], data[idx] = e + 127, ref_e4m3_bits(v)
    data = np.moveaxis(data.reshape(a.shape), -1, axis)
    scale = np.moveaxis(scale, -1, axis)
    return data, scale


def assert_matches_ref(x, axis, mode):
    q = quantize(x, axis=axis, scale_mode=mode)
    ref_data, ref_scale = ref_quantize(x, axis, mode)
    got_data = q.data.view(torch.uint8).numpy()
    got_scale = q.scale.numpy()
    assert got_scale.shape == ref_scale.shape
    np.testing.assert_array_equal(got_scale, ref_scale)
    np.testing.assert_array_equal(got_data, ref_data)
    return q


# ---------------------------------------------------------------------------


def test_reference_decoder_sanity():
    assert _e4m3_value(0x7E) == 448.0 and _e4m3_value(0x01) == 2.0**-9 and _e4m3_value(0x08) == 2.0**-6
    # our E4M3 table agrees with torch's decoder (both read the same bits)
    tv = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(tv, _POS_VALUES)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_byte_exact(mode, dtype):
    g = torch.Generator().manual_seed(1)
    # log-uniform magnitudes over a wide range so every block has its own scale
    mag = torch.exp2(torch.randn(6, 8, 96, generator=g) * 6)
    x = (torch.randn(6, 8, 96, generator=g).sign() * mag).to(dtype)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    for axis in (-1, -2, 0):
        if x.shape[axis] % 32 == 0:
            assert_matches_ref(x, axis, mode)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_rounding_ties_and_boundaries(mode):
    # values at / between E4M3 grid points after scaling by 2**e (e fixed by the 448 entry)
    vals = [448.0, 0.0, -0.0, 1.0, 1.0625, 1.1875, 17.0, 19.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10,
            2.0**-10 * 1.01, 2.0**-11, 240.0, 232.0, 248.0, -1.0625, -3 * 2.0**-10, 0.0]
    vals += [((i % 7) - 3) * 0.37 for i in range(32 - len(vals))]
    x = torch.tensor(vals, dtype=torch.float32).reshape(1, 32)
    q = assert_matches_ref(x, -1, mode)
    assert q.scale.item() == 127  # 448 exactly fits with e = 0 in both modes
    # amax = 1.75 * 2**p exactly: rceil keeps e = p - 8 (fp32 amax * (1/448) would round up)
    x2 = torch.full((1, 32), 0.5)
    x2[0, 3] = 1.75 * 2.0**20
    q2 = assert_matches_ref(x2, -1, mode)
    assert q2.scale.item() == 127 + 12
    x2[0, 3] = float(np.nextafter(np.float32(1.75 * 2.0**20), np.float32(np.inf)))
    q3 = assert_matches_ref(x2, -1, mode)
    assert q3.scale.item() == 127 + 12 + (mode == "rceil")


def test_floor_saturates_rceil_does_not():
    x = torch.full((1, 32), 0.25)
    x[0, 0] = 480.0  # floor: e = 8 - 8 = 0, 480 saturates to 448; rceil: e = 1, 480/2 = 240 exact
    qf, qr = quantize(x, scale_mode="floor"), quantize(x, scale_mode="rceil")
    assert qf.scale.item() == 127 and qr.scale.item() == 128
    assert dequantize(qf, torch.float32)[0, 0].item() == 448.0
    assert dequantize(qr, torch.float32)[0, 0].item() == 480.0
    assert_matches_ref(x, -1, "floor")
    assert_matches_ref(x, -1, "rceil")


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_edge_blocks(mode):
    tiny = 2.0**-149  # smallest fp32 subnormal
    rows = [
        torch.zeros(32),                                  # all-zero block
        torch.full((32,), tiny),                          # fp32 subnormals
        torch.linspace(-1, 1, 32) * 2.0**-126,            # around the fp32 normal limit
        torch.linspace(-1, 1, 32) * 448 * 2.0**-127,      # amax exactly at the low E8M0 end
        torch.linspace(-1, 1, 32) * 3.0e38,               # near fp32 max (high end)
        torch.linspace(-1, 1, 32) * 2.0**127,
        torch.linspace(-2, 2, 32),
    ]
    x = torch.stack(rows)
    q = assert_matches_ref(x, -1, mode)
    assert q.scale[0].item() == 0 and q.data[0].view(torch.uint8).eq(0).all()
    assert q.scale[1].item() == 0 and q.scale[3].item() == 0
    # low end: 448 * 2**-127 round-trips exactly
    assert dequantize(q, torch.float32)[3, -1].item() == 448 * 2.0**-127
    dq = dequantize(q, torch.float32)
    assert torch.isfinite(dq).all()
    # sign of zero preserved
    qz = quantize(torch.cat([torch.tensor([-0.0]), torch.ones(31)]).reshape(1, 32), scale_mode=mode)
    assert qz.data.view(torch.uint8)[0, 0].item() == 0x80


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_blocks(mode, bad):
    x = torch.randn(2, 64)
    x[1, 40] = bad
    q = assert_matches_ref(x, -1, mode)
    assert q.scale[1, 1].item() == 0xFF and q.data[1, 32:].view(torch.uint8).eq(0x7F).all()
    dq = dequantize(q, torch.float32)
    assert torch.isnan(dq[1, 32:]).all() and torch.isfinite(dq[1, :32]).all() and torch.isfinite(dq[0]).all()


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_round_trip_error_per_block(mode):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=g) * torch.exp2(torch.randn(16, 8, generator=g) * 4).repeat_interleave(32, 1)
    q = quantize(x, scale_mode=mode)
    err = (dequantize(q, torch.float32) - x).abs().double()
    e = (q.scale.double() - 127).repeat_interleave(32, 1)
    ax = x.abs().double()
    # E4M3 keeps 3 mantissa bits: half-ulp relative error 2**-4 for normals, 2**(e-10) in the subnormal range
    bound = torch.maximum(ax * 2.0**-4, torch.exp2(e - 10))
    if mode == "floor":
        bound = bound + (ax - 448 * torch.exp2(e)).clamp(min=0)  # saturation
    assert (err <= bound).all()
    blk_err = err.reshape(16, 8, 32).amax(-1)
    blk_amax = ax.reshape(16, 8, 32).amax(-1)
    assert (blk_err <= blk_amax * (2.0**-4 if mode == "rceil" else 0.125)).all()
    assert blk_err.max() > 0  # the quantisation is not the identity


def test_column_wise_equals_transposed_row_wise():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 64, 96, generator=g, dtype=torch.float32).bfloat16()
    col = quantize(w, axis=-2)
    row_t = quantize(w.transpose(-1, -2).contiguous(), axis=-1)
    assert col.axis == 1 and col.scale.shape == (3, 2, 96) and col.data.shape == w.shape
    assert torch.equal(col.data.view(torch.uint8), row_t.data.view(torch.uint8).transpose(-1, -2))
    assert torch.equal(col.scale, row_t.scale.transpose(-1, -2))
    assert_matches_ref(w, 1, "rceil")


def test_fake_quantize_and_idempotence():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=g).bfloat16()
    fq = fake_quantize(x)
    assert fq.dtype == torch.bfloat16 and not torch.equal(fq, x)
    assert torch.equal(fq, dequantize(quantize(x), torch.bfloat16))
    # quantising already-representable values is lossless (rceil), also from floor-mode data
    assert torch.equal(fake_quantize(fq), fq)
    ff = fake_quantize(x, scale_mode="floor")
    assert torch.equal(fake_quantize(ff), ff)
    # deterministic
    assert torch.equal(quantize(x).data.view(torch.uint8), quantize(x).data.view(torch.uint8))


def test_bad_inputs():
    with pytest.raises(ValueError, match="not a multiple"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="not a multiple"):
        quantize(torch.randn(40, 64), axis=0)
    with pytest.raises(ValueError, match="scale_mode"):
        quantize(torch.randn(4, 32), scale_mode="nearest")
    with pytest.raises(TypeError, match="float32"):
        quantize(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="axis"):
        quantize(torch.randn(4, 32), axis=2)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.randn(4, 32), block_size=0)
    with pytest.raises(ValueError, match="scale"):
        MXFP8Tensor(torch.zeros(4, 64, dtype=torch.float8_e4m3fn), torch.zeros(4, 3, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match="uint8"):
        MXFP8Tensor(torch.zeros(4, 64, dtype=torch.float8_e4m3fn), torch.zeros(4, 2), 1)


def test_other_block_sizes():
    x = torch.randn(2, 64)
    q = quantize(x, block_size=16)
    assert q.scale.shape == (2, 4)
    ref = torch.cat([dequantize(quantize(x[:, i:i + 16], block_size=16), torch.float32) for i in range(0, 64, 16)], 1)
    assert torch.equal(dequantize(q, torch.float32), ref)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_every_bf16_value(mode):
    # all 65536 bf16 bit patterns (non-finite ones replaced by 1.0), once sorted (neighbours share a
    # block: every value lands near the top of its block's range) and once shuffled (wide blocks)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).clone()
    x[~torch.isfinite(x)] = 1.0
    srt = x[torch.argsort(x.float().abs(), stable=True)].reshape(-1, 64)
    g = torch.Generator().manual_seed(5)
    shuf = x[torch.randperm(x.numel(), generator=g)].reshape(-1, 64)
    assert_matches_ref(srt, -1, mode)
    assert_matches_ref(shuf, -1, mode)


def test_dequantize_bf16_route_is_the_fp32_route_bit_for_bit():
    """dequantize(..., bfloat16) multiplies in bf16 (E4M3 values and 2**e are bf16 values; the product is rounded
    once): every E4M3 byte against every scale byte gives the bits of the fp32 product rounded to bf16, NaN
    where that is NaN."""
    from mok_nn.mxfp8 import MXFP8Tensor, dequantize

    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.float8_e4m3fn)  # [scale byte, elements]
    data = data.repeat_interleave(32, dim=1)[:, : 256 * 32]  # 256 blocks of one value each per row
    scale = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 256).contiguous()
    t = MXFP8Tensor(data, scale, 1)
    got = dequantize(t, torch.bfloat16)
    want = (data.float().view(256, 256, 32) * torch.exp2(scale.double() - 127).float().unsqueeze(-1)).view(256, -1)
    want = torch.where(scale.repeat_interleave(32, dim=1) == 255, float("nan"), want).bfloat16()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert got[~nan].ne(0).any() and (got[~nan] != got[~nan].float().bfloat16()).sum() == 0


def test_dequantize_in_chunks_is_the_whole(monkeypatch):
    """dequantize to bf16 runs in chunks along dim 0 (one transient bf16 chunk): the bits of one pass, for
    every chunk size."""
    from mok_nn import mxfp8

    g = torch.Generator().manual_seed(4)
    w = torch.randn(5, 8, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (5, 8, 64), generator=g).float())
    q = mxfp8.quantize(w, axis=-1)
    whole = mxfp8.dequantize(q, torch.bfloat16)
    for size in (1, 100, 1 << 30):  # one block row, a few, all
        monkeypatch.setattr(mxfp8, "chunk_bytes", lambda device, size=size: size)
        assert torch.equal(mxfp8.dequantize(q, torch.bfloat16), whole)
    assert torch.equal(whole.float(), mxfp8.dequantize(q, torch.float32).bfloat16().float())
