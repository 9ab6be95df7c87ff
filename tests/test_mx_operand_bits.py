"""The MXFP8 weights' conversion (kernels/mx_operand.py), instruction by instruction on the CPU: every E4M3 byte
in every position of a 32-bit word, under every scale byte, against mxfp8.dequantize into bf16.

The kernel's steps are emulated from its own constants (PRMT selectors, masks, SINGLE_MAX): PRMT, shift, masks
on 32-bit words, then bf16 multiplies, each rounding its exact product once (as mul.rn.bf16x2 does, and as
torch's bf16 multiply does on the CPU: the fp32 product of two bf16 values is exact here). The GPU tests run the
kernels themselves against dequantize + the bf16 kernels.
"""

import pytest
import torch

from mok_nn.mxfp8 import MXFP8Tensor, dequantize

mx_operand = pytest.importorskip("mok_nn.kernels.mx_operand")  # (needs the CuTe DSL to import)


def prmt(a: torch.Tensor, b, selector: int) -> torch.Tensor:
    """PTX prmt.b32 (default mode) of int64-held 32-bit words a and b (words or a constant): result byte i is the
    byte that selector nibble i names (bits 0..2; 4..7 are b's), or with bit 3 set, that byte's top bit replicated."""
    b = torch.as_tensor(b, dtype=torch.int64).expand_as(a)
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = src[nibble & 0x7]
        if nibble & 0x8:
            byte = ((byte >> 7) & 1) * 0xFF
        out |= byte << (8 * i)
    return out


def bf16_lanes(word: torch.Tensor) -> torch.Tensor:
    """The two bf16 lanes (low first) of int64-held 32-bit words, [..., 2] bf16."""
    lanes = torch.stack([word & 0xFFFF, (word >> 16) & 0xFFFF], -1)
    return (lanes - ((lanes & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def factor(bits: torch.Tensor) -> torch.Tensor:
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def kernel_values(words: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., 4] bf16: what to_bf16 writes for the 4 E4M3 bytes of each word under its block's scale byte."""
    one = scale.clamp(max=mx_operand.SINGLE_MAX)
    f1 = factor((one + 120) << 7)
    f2 = torch.where(scale == 255, torch.full_like(scale, 0x7FC0), (scale - 7) << 7)
    out = []
    for selector in (mx_operand.LOW_SELECTOR, mx_operand.HIGH_SELECTOR):
        t = prmt(words, 0, selector)
        r = ((t << 4) & 0xFFFFFFFF) & mx_operand.LANE_BITS  # shl.b32, and.b32
        v = bf16_lanes(r) * f1.unsqueeze(-1)  # mul.rn.bf16x2
        second = (scale > mx_operand.SINGLE_MAX).unsqueeze(-1)
        out.append(torch.where(second, v * factor(f2).unsqueeze(-1), v))
    return torch.cat(out, -1)


def test_every_byte_in_every_position_under_every_scale_is_dequantize():
    # data [256 scales, 256 words, 32 bytes]: byte j of word w is (w + 67 j) % 256, so every byte value sits in
    # every position of a word; one block of 32 per (scale, word)
    scales = torch.arange(256, dtype=torch.int64)
    w = torch.arange(256).unsqueeze(1)
    block = (w + 67 * torch.arange(32).unsqueeze(0)) % 256  # [256 words, 32]
    data = block.unsqueeze(0).expand(256, -1, -1).to(torch.uint8).contiguous()
    scale_bytes = scales.view(256, 1, 1).expand(-1, 256, 1).to(torch.uint8).contiguous()
    want = dequantize(MXFP8Tensor(data.view(torch.float8_e4m3fn), scale_bytes, 2), torch.bfloat16)

    words = data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [256, 256, 8] little-endian words
    got = kernel_values(words, scales.view(256, 1, 1).expand(-1, 256, 8)).reshape(256, 256, 32)

    nan_byte = (data & 0x7F) == 0x7F
    finite_scale = scale_bytes != 255
    same = got.view(torch.int16) == want.view(torch.int16)
    both_nan = got.isnan() & want.isnan()
    agree = same | both_nan
    # every value agrees except the E4M3 NaN bytes under a finite scale, which the host keeps off this path
    # (cuda_mx.nan_free); those come out finite where dequantize gives NaN
    assert bool(agree[~(nan_byte & finite_scale)].all())
    assert bool(want[nan_byte & finite_scale].isnan().all()) and not bool(got[nan_byte & finite_scale].isnan().any())
    # the cases the recipe distinguishes are all present: subnormal E4M3, the two-multiply scales, bf16 subnormal
    # and overflowing results, NaN blocks
    assert bool((want[:, :, :].abs() < 2.0**-126).any()) and bool(want.isinf().any())
    assert bool((scales > mx_operand.SINGLE_MAX).any()) and bool(want[255].isnan().all())


def test_selectors_put_each_byte_into_its_lane():
    """Bytes 0..3 (elements k..k + 3) of a word: the low pair's lanes hold bytes 0, 1, the high pair's 2, 3,
    each in its lane's low byte under its sign byte (0xFF for a negative byte)."""
    words = torch.tensor([0xBC2A9908], dtype=torch.int64)
    assert int(prmt(words, 0, mx_operand.LOW_SELECTOR)) == (0xFF99 << 16) | 0x0008
    assert int(prmt(words, 0, mx_operand.HIGH_SELECTOR)) == (0xFFBC << 16) | 0x002A


def test_column_selectors_pair_one_column_of_two_rows():
    """The dgrad's fragment words (mx_swapped.SwappedMxColumnGemm): from the 16-bit loads of row k (columns c,
    c + 1) and row k + 1, EVEN holds column c's bytes of rows k (low lane) and k + 1, ODD column c + 1's, each under
    its sign byte; the loads' upper halves (sign-extended by LDS.S16) are never selected."""
    mx_swapped = pytest.importorskip("mok_nn.kernels.mx_swapped")
    lo = torch.tensor([0x9908, 0xFFFF9908], dtype=torch.int64)  # row k: column c 0x08, c + 1 0x99
    hi = torch.tensor([0x2ABC, 0x00002ABC], dtype=torch.int64)  # row k + 1: column c 0xBC, c + 1 0x2A
    assert prmt(lo, hi, mx_swapped.COLUMN_EVEN_SELECTOR).tolist() == [(0xFFBC << 16) | 0x0008] * 2
    assert prmt(lo, hi, mx_swapped.COLUMN_ODD_SELECTOR).tolist() == [(0x002A << 16) | 0xFF99] * 2


def requant_columns(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dgrad's requantisation steps (mx_operand.py) for E4M3 data [R, 32] (one 32-column scale block, scale [R]
    bytes): [R, 32] bf16, the values along R in blocks of 32 rows."""
    rows = data.shape[0]
    bytes_ = data.view(torch.uint8).to(torch.int64)  # [R, 32]
    # v = r * f_k: r from each byte (a lane of the PRMT / shift / mask), f_k = 2**(S_k - 7) as bf16 bits
    lane = (((bytes_ >> 7) * 0xFF) << 8) | bytes_  # the byte under its sign byte
    r = bf16_lanes(((lane << 4) & 0xFFFF) & (mx_operand.LANE_BITS & 0xFFFF))[..., 0]
    f = factor((scale.to(torch.int64) + 120) << 7).unsqueeze(1)
    v = (r * f).view(rows // 32, 32, 32)  # [row blocks, rows, columns]
    # e = rceil(max |v|) from the bf16 bits, clamped below at -127
    a16 = v.abs().amax(dim=1).view(torch.int16).to(torch.int64) & 0xFFFF  # [row blocks, columns]
    e = ((a16 >> 7) - 135 + ((a16 & 0x7F) > 0x60).to(torch.int64)).clamp(min=-127)
    down = factor((127 - e) << 7).unsqueeze(1)
    up = factor((e + 247) << 7).unsqueeze(1)
    q = (v * down).float().to(torch.float8_e4m3fn)  # cvt.rn.satfinite.e4m3x2.f32 (|v * 2**-e| <= 448)
    qb = q.view(torch.uint8).to(torch.int64)
    rq = bf16_lanes(((((((qb >> 7) * 0xFF) << 8) | qb) << 4) & 0xFFFF) & (mx_operand.LANE_BITS & 0xFFFF))[..., 0]
    # blocks whose smallest |v| is at least 2**(e - 6) keep v (the kernel skips the rounding there)
    a_min = v.abs().amin(dim=1).view(torch.int16).to(torch.int64) & 0xFFFF
    floor = torch.where(e < -120, 1 << (e + 127).clamp(min=0), (e + 121) << 7)
    rounds = (a_min < floor).unsqueeze(1)
    return torch.where(rounds, rq * up, v).view(rows, 32)


def test_requantised_columns_are_fake_quantize_along_rows_of_w_q():
    """The dgrad's requantisation on MXFP8-only weights (mx_operand.py) gives mxfp8.fake_quantize_fast along the rows of
    W_q = dequantize(stored), bit for bit, for scale bytes up to 134 (what cuda_mx.column_reason admits): rows
    whose scales differ by up to 12 (small values of the lower rows fall into E4M3's subnormals at the column
    block's scale and round), runs of byte values, all-zero columns, the extreme scales (bf16 subnormal W_q)."""
    from mok_nn import cuda_mx
    from mok_nn.mxfp8 import fake_quantize_fast

    assert cuda_mx.COLUMN_MAX_SCALE == mx_operand.SINGLE_MAX  # (the host's bound is the kernels' one-multiply bound)
    g = torch.Generator().manual_seed(0)
    blocks = []
    for base in (0, 60, 127, cuda_mx.COLUMN_MAX_SCALE - 12):
        for spread in (0, 1, 3, 12):
            rows = 64 * 4
            data = torch.randint(0, 256, (rows, 32), generator=g, dtype=torch.int64)
            data[(data & 0x7F) == 0x7F] = 0x7E  # no NaN bytes (cuda_mx.nan_free)
            data[:32, 0] = 0  # an all-zero column block
            data[32:64, 1] = torch.arange(32) + 95  # runs of consecutive byte values (no NaN byte 0x7F)
            data[64:96, 2] = torch.arange(32)
            data[96:128, 3] = torch.arange(32) + 128
            s = base + torch.randint(0, spread + 1, (rows,), generator=g)
            s = s.clamp(max=cuda_mx.COLUMN_MAX_SCALE)
            blocks.append((data.to(torch.uint8), s.to(torch.uint8)))
    rounded = skipped = 0
    for data, s in blocks:
        stored = MXFP8Tensor(data.view(torch.float8_e4m3fn), s.view(-1, 1).contiguous(), 1)
        w_q = dequantize(stored, torch.bfloat16)
        want = fake_quantize_fast(w_q, axis=0)
        got = requant_columns(data.view(torch.float8_e4m3fn), s)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        rounded += int((want.view(torch.int16) != w_q.view(torch.int16)).sum())
        v = w_q.float().view(-1, 32, 32).abs()
        skipped += int((v.amin(dim=1) * 2.0**6 >= v.amax(dim=1).clamp(min=2.0**-126)).sum())
    assert rounded > 0  # the case that needs rounding is exercised
    assert skipped > 0  # and blocks that skip it (a rough count: no value far below the block's largest)
