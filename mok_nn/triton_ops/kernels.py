"""The Triton kernels behind mok_nn.triton_ops (imported on first use, where Triton is importable)."""

import triton
import triton.language as tl


@triton.jit
def _load_bits(ptr, offs, mask, IN_BF16: tl.constexpr):
    # the fp32 bits of the values at ptr (bf16 shifted up by integer operations; fp16 / fp32 by a conversion, which
    # is exact: no float arithmetic touches a subnormal here or below, which the compiled code may flush to zero)
    if IN_BF16:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)


@triton.jit
def _store_bits(ptr, offs, bits, mask):
    # fp32 bits rounded once to ptr's dtype: bf16 by integer round-to-nearest-even on the bits (NaN kept NaN),
    # fp16 by a conversion (what it would flush lies below fp16's range), fp32 as they are
    dt = ptr.dtype.element_ty
    if dt == tl.bfloat16:
        tl.store(ptr + offs, _bf16_rne(bits).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, bits.to(tl.float32, bitcast=True).to(dt), mask=mask)


@triton.jit
def _bf16_rne(bits):
    # fp32 bits -> bf16 bits (the low 16 of the result), rounded to nearest even by integer operations (not the
    # conversion, whose rounding Triton's interpreter does not follow); NaN -> bf16's NaN, overflow -> inf
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _times_pow2_bits(bits, k):
    # the fp32 bits of v * 2**k for v's bits (non-negative, 0 or normal, at most 4 significant bits: values on
    # E4M3's grid) and integer k, exactly, by integer operations: the exponent moved, or for a subnormal result
    # the significand shifted right (its low bits are zero: nothing is lost); inf past fp32's range
    v_exp = bits >> 23
    o_exp = v_exp + k
    sig = (bits & 0x7FFFFF) | 0x800000
    sub = sig >> tl.minimum(tl.maximum(1 - o_exp, 0), 31)
    out = tl.where(o_exp >= 1, bits + (k << 23), sub)
    out = tl.where(o_exp >= 255, 0x7F800000, out)
    return tl.where(bits == 0, 0, out)


@triton.jit
def fake_quantize_kernel(x_ptr, out_ptr, n_blocks, IN_BF16: tl.constexpr, HW_E4M3: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    # blocks of BLOCK consecutive elements (along the last axis); a program takes ROWS consecutive blocks, a
    # [ROWS, BLOCK] tile (along another axis: fake_quantize_rows_kernel)
    first = tl.program_id(0).to(tl.int64) * ROWS
    local = tl.arange(0, ROWS)
    offs = local[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (first + local < n_blocks)[:, None]
    _mx_quantize_store(out_ptr + first * BLOCK, offs, _load_bits(x_ptr + first * BLOCK, offs, mask, IN_BF16), mask, 1,
                       HW_E4M3)


@triton.jit
def fake_quantize_rows_kernel(x_ptr, out_ptr, row0_ptr, nrows_ptr, cols, IN_BF16: tl.constexpr, HW_E4M3: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr, SEGMENTS: tl.constexpr):
    # x [N, cols] in blocks of BLOCK consecutive rows. A program takes one row block and ROWS consecutive columns, a
    # [BLOCK, ROWS] tile whose rows are contiguous in memory (16-byte loads and stores; a block's elements lie
    # cols apart). Without SEGMENTS block r is rows r * BLOCK ..; with them (an expert's rows, the last block of a
    # segment short: its missing rows count as zeros, which move no block's amax) it starts at row row0[r] and
    # holds nrows[r] rows (0: past the last).
    chunks = (cols + ROWS - 1) // ROWS
    blk = tl.program_id(0) // chunks
    i = (tl.program_id(0) % chunks) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK)
    if SEGMENTS:
        base = tl.load(row0_ptr + blk) * cols  # (int64)
        mask = (j < tl.load(nrows_ptr + blk))[:, None] & (i < cols)[None, :]
    else:
        base = blk.to(tl.int64) * BLOCK * cols
        mask = (i < cols)[None, :]
    offs = (j.to(tl.int64) * cols)[:, None] + i[None, :]  # (int64: BLOCK rows of a long row may pass 2**31)
    _mx_quantize_store(out_ptr + base, offs, _load_bits(x_ptr + base, offs, mask, IN_BF16), mask, 0, HW_E4M3)


@triton.jit
def quantize_kernel(x_ptr, data_ptr, scale_ptr, n_blocks, IN_BF16: tl.constexpr, HW_E4M3: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # mxfp8.quantize ("rceil") of blocks of BLOCK consecutive elements (along the last axis): each block's E4M3 bytes
    # and its E8M0 scale byte; a program takes ROWS consecutive blocks, a [ROWS, BLOCK] tile
    first = tl.program_id(0).to(tl.int64) * ROWS
    local = tl.arange(0, ROWS)
    live = first + local < n_blocks
    offs = local[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    bits = _load_bits(x_ptr + first * BLOCK, offs, live[:, None], IN_BF16)
    # (e: -127 for a block of zeros or subnormals, as quantize clamps it; a block holding NaN / inf: NaN bytes under
    # the NaN scale)
    sign, mag_bits, nan, e, e_fast, all_fast = _block_scales(bits, 1)
    if all_fast:  # |x| * 2**-e in fp32 is exact, or rounds to 0 either way
        s = mag_bits.to(tl.float32, bitcast=True) * ((127 - e_fast) << 23).to(tl.float32, bitcast=True)[:, None]
    else:  # by integer operations wherever a value may be subnormal (_mx_round_exact's first step)
        s = _scaled_exact(mag_bits, e[:, None]).to(tl.float32, bitcast=True)
    if HW_E4M3:  # (|s| <= 448 under the rceil scale: nothing saturates; ties to even, subnormals kept)
        byte = s.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        byte = _e4m3_byte(_e4m3_grid(s).to(tl.int32, bitcast=True))
    byte = tl.where(nan[:, None], 0x7F, byte | ((sign >> 24) & 0x80))
    tl.store(data_ptr + first * BLOCK + offs, byte.to(tl.uint8), mask=live[:, None])
    tl.store(scale_ptr + first + local, tl.where(nan, 255, e + 127).to(tl.uint8), mask=live)


@triton.jit
def _scaled_exact(mag_bits, e):
    # the fp32 bits of |x| * 2**-e for |x|'s bits, by integer operations (a subnormal x: its mantissa m as a float,
    # times 2**-149); a result below fp32's normal range rounds to 0 on E4M3's grid (its smallest step is 2**-9):
    # taken as 0
    x_exp = mag_bits >> 23
    sub_x = x_exp == 0
    src = tl.where(sub_x, (mag_bits & 0x7FFFFF).to(tl.float32).to(tl.int32, bitcast=True), mag_bits)
    shift = tl.where(sub_x, -149, 0) - e
    return tl.where((src >> 23) + shift >= 1, src + (shift << 23), 0)


@triton.jit
def _e4m3_byte(r_bits):
    # the E4M3 byte (sign clear) of a non-negative fp32 value on E4M3's grid (0, or 2**-9 .. 448), exactly: a normal
    # one (fp32 biased exponent >= 121) has E4M3 exponent field exp - 120 and the top 3 mantissa bits; a subnormal
    # one is m * 2**-9, m = its 24-bit significand >> (141 - exp)
    exp = r_bits >> 23
    normal = ((exp - 120) << 3) | ((r_bits >> 20) & 7)
    sub = ((r_bits & 0x7FFFFF) | 0x800000) >> tl.minimum(141 - exp, 31)
    return tl.where(exp >= 121, normal, tl.where(r_bits == 0, 0, sub))


MX_FAST_MIN_E = tl.constexpr(-116)  # the float form is exact for blocks with e >= this (_mx_round_fast)


@triton.jit
def _mx_quantize_store(ptr, offs, bits, mask, AXIS: tl.constexpr, HW_E4M3: tl.constexpr):
    # the MXFP8 values ("rceil") of fp32 bits `bits` in blocks along AXIS of the tile, stored at ptr in its dtype
    # (_store_bits' rounding). HW_E4M3: round by the GPU's E4M3 conversion (sm_89 and later) on the float form
    sign, mag_bits, nan, e, e_fast, all_fast = _block_scales(bits, AXIS)
    nan = tl.expand_dims(nan, AXIS)  # a block holding NaN / inf: NaN
    # A tile whose blocks are all zeros or have e >= MX_FAST_MIN_E (real data) takes the float form: about half the
    # instructions of the integer form, which bounded the kernels' speed (on an H200 1.2-1.9 TB/s against a copy's
    # 3.3-4.1; the float form 1.7-3.0); a tile holding a block of tiny nonzero values takes the integer form.
    if all_fast:
        if HW_E4M3:
            out = _mx_round_hw(bits, tl.expand_dims(e_fast, AXIS))
        else:
            out = _mx_round_fast(mag_bits, tl.expand_dims(e_fast, AXIS)) | sign
        out = tl.where(nan, 0x7FC00000, out)
        # Into bf16 as the top 16 bits, without the rounding: each result is 0, NaN, inf or a normal number of at
        # most 4 significant bits, so its low 16 bits are zero and the rounding would keep it (that rounding was
        # about a fifth of the tile's instructions)
        if ptr.dtype.element_ty == tl.bfloat16:
            tl.store(ptr + offs, (out >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            _store_bits(ptr, offs, out, mask)
    else:
        _store_bits(ptr, offs, tl.where(nan, 0x7FC00000, _mx_round_exact(mag_bits, tl.expand_dims(e, AXIS)) | sign),
                    mask)


@triton.jit
def _block_scales(bits, AXIS: tl.constexpr):
    # The rceil scales of a tile's blocks along AXIS from its values' fp32 bits: (sign bits, |x|'s bits, each
    # block's NaN flag, its exponent e, e with all-zero blocks at 0 (the float form's), whether every block of the
    # tile is all zeros or has e >= MX_FAST_MIN_E, where the float form is exact). amax is the block's largest bit
    # pattern with the sign cleared (int order is float order; a NaN's pattern lies above inf's, and both give the
    # biased exponent 255 the NaN rule keys on).
    sign = bits & -(2**31)
    mag_bits = bits ^ sign
    amax = tl.max(mag_bits, axis=AXIS)
    nan = ((amax >> 23) & 0xFF) == 255
    e = _rceil_exponent(amax)
    fast = (amax == 0) | (e >= MX_FAST_MIN_E)
    all_fast = tl.min(tl.reshape(fast.to(tl.int32), [fast.numel]), axis=0) == 1  # (the tile's blocks: 1-D or 2-D)
    return sign, mag_bits, nan, e, tl.where(amax == 0, 0, e), all_fast


@triton.jit
def _rceil_exponent(amax):
    # the "rceil" scale exponent e of a block whose largest magnitude has the fp32 bits amax: floor(log2 amax) - 8,
    # one more where its mantissa lies above 1.75 (amax / 2**e <= 448); -127 for a block of zeros or subnormals,
    # clamped to E8M0's [-127, 127]
    biased = (amax >> 23) & 0xFF
    e = biased - (127 + 8) + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(biased == 0, -127, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _mx_round_fast(mag_bits, e):
    # |x|'s bits -> the bits of its MXFP8 value at the block scale 2**e, in fp32 arithmetic; exact for
    # e >= MX_FAST_MIN_E: |s| = |x| * 2**-e is exact where it is normal, and where it is not (or |x| is subnormal
    # and flushed to zero), |s| < 2**-10 rounds to 0 on E4M3's grid either way; a nonzero result (>= 2**-9 * 2**e)
    # is normal, so the multiply by 2**e is exact too (flushing nothing). Fused multiply-adds change nothing:
    # every product here is exact.
    s = mag_bits.to(tl.float32, bitcast=True) * ((127 - e) << 23).to(tl.float32, bitcast=True)
    rounded = _e4m3_grid(s)
    return (rounded * ((127 + e) << 23).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)


@triton.jit
def _mx_round_hw(bits, e):
    # x's bits (signed) -> the bits of its MXFP8 value at the block scale 2**e, for e >= MX_FAST_MIN_E as
    # _mx_round_fast, with the rounding to E4M3's grid done by the hardware conversion (cvt.rn.satfinite.e4m3x2:
    # ties to even, subnormals kept; |s| <= 448 under the rceil scale, so nothing saturates) and back (exact): the
    # float branch takes about 8 SASS instructions an element against 12. The sign rides through (a value rounding
    # to zero keeps it, as the | sign does).
    s = bits.to(tl.float32, bitcast=True) * ((127 - e) << 23).to(tl.float32, bitcast=True)
    q = s.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    return (q * ((127 + e) << 23).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)


@triton.jit
def _mx_round_exact(mag_bits, e):
    # |x|'s bits -> the bits of its MXFP8 value at the block scale 2**e, by integer operations wherever a value
    # may be subnormal (|s| = |x| * 2**-e by _scaled_exact)
    s_bits = _scaled_exact(mag_bits, e)
    rounded = _e4m3_grid(s_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return _times_pow2_bits(rounded, e)


@triton.jit
def _e4m3_grid(s):
    # |s| (fp32, >= +0, at most 448) rounded to E4M3's grid, ties to even: (|s| + C) - C with
    # C = 1.5 * 2**(max(E, -6) + 20) for |s|'s exponent E
    c_bits = tl.maximum(s.to(tl.int32, bitcast=True) & 0x7F800000, (127 - 6) << 23) + ((20 << 23) | (1 << 22))
    c = c_bits.to(tl.float32, bitcast=True)
    return (s + c) - c


@triton.jit
def _clamped(g, u, limit, HAS_LIMIT: tl.constexpr):
    # gate and up as the activation takes them (clamped where there is a limit), fp32
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g, u


@triton.jit
def _act(g, u, OAI: tl.constexpr, ALPHA: tl.constexpr):
    # h in fp32 from clamped gate and up; one expression for the forward and the backward kernel, so the
    # backward's h is the forward's bit for bit
    if OAI:  # (u + 1) g sigmoid(alpha g)
        return (u + 1.0) * g * (1.0 / (1.0 + tl.exp(-(g * ALPHA))))
    return g / (1.0 + tl.exp(-g)) * u  # silu(g) u


@triton.jit
def activation_forward_kernel(gu_ptr, h_ptr, inter, limit, HAS_LIMIT: tl.constexpr, OAI: tl.constexpr,
                   ALPHA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        g, u = _clamped(g, u, limit, HAS_LIMIT)
        tl.store(h_ptr + row * inter + cols, _act(g, u, OAI, ALPHA).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def mlp_backward_rows_kernel(gu_ptr, dh_ptr, w_ptr, dw_ptr, wh_ptr, dgu_ptr, inter, limit,
                    HAS_LIMIT: tl.constexpr, OAI: tl.constexpr, ALPHA: tl.constexpr, WRITE_WH: tl.constexpr,
                    BLOCK: tl.constexpr):
    # h is not read: it is made again from gate_up as the forward made it (_act, rounded to the storage dtype),
    # so the forward need not keep it. dgu_ptr may be gu_ptr (each element is read before it is written).
    row = tl.program_id(0).to(tl.int64)
    w = tl.load(w_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < inter
        dh_raw = tl.load(dh_ptr + row * inter + cols, mask=m, other=0.0).to(tl.float32)
        g_in = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u_in = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        g, u = _clamped(g_in, u_in, limit, HAS_LIMIT)
        h = _act(g, u, OAI, ALPHA).to(dgu_ptr.dtype.element_ty).to(tl.float32)
        acc += dh_raw * h
        if WRITE_WH:
            tl.store(wh_ptr + row * inter + cols, (w * h).to(wh_ptr.dtype.element_ty), mask=m)
        dh = dh_raw * w
        if OAI:
            sig = 1.0 / (1.0 + tl.exp(-(g * ALPHA)))
            d_act = ((g * ALPHA) * (1.0 - sig) + 1.0) * sig  # d/dg of g sigmoid(alpha g)
            d_gate = ((u + 1.0) * dh) * d_act
        else:
            sig = 1.0 / (1.0 + tl.exp(-g))
            d_act = ((1.0 - sig) * g + 1.0) * sig  # silu'(g)
            d_gate = (dh * u) * d_act
        d_up = (g * sig) * dh
        if HAS_LIMIT:  # times the masks, as the reference (a NaN stays NaN)
            d_gate = d_gate * (g_in <= limit).to(tl.float32)
            d_up = d_up * ((u_in >= -limit) & (u_in <= limit)).to(tl.float32)
        tl.store(dgu_ptr + row * 2 * inter + cols, d_gate.to(dgu_ptr.dtype.element_ty), mask=m)
        tl.store(dgu_ptr + row * 2 * inter + inter + cols, d_up.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + row, tl.sum(acc, axis=0))


FAST_LO = tl.constexpr(10)  # the scale bytes under which every E4M3 value, subnormals included, is a normal
FAST_HI = tl.constexpr(246)  # bf16 / fp32 value (the NaN scale, 255, lies outside)


@triton.jit
def dequantize_kernel(data_ptr, scale_ptr, out_ptr, n_blocks, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # data: E4M3 bytes, blocks of BLOCK consecutive ones, an E8M0 scale byte each; value * 2**(scale - 127), exact
    # (4 significant bits times a power of two), by integer operations. A program whose scales all lie in
    # [FAST_LO, FAST_HI] builds each bf16 / fp32 result's bits directly (_dequantize_bits_fast: every value is
    # normal there, nothing to round); others, and fp16, go the general way (_dequantize_bits_exact).
    first = tl.program_id(0).to(tl.int64) * ROWS  # (int64 once per program, int32 offsets within it)
    local = tl.arange(0, ROWS)
    in_range = first + local < n_blocks
    offs = local[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    data_ptr += first * BLOCK
    out_ptr += first * BLOCK
    q = tl.load(data_ptr + offs, mask=in_range[:, None], other=0).to(tl.int32)
    s = tl.load(scale_ptr + first + local, mask=in_range, other=127).to(tl.int32)
    if out_ptr.dtype.element_ty == tl.float16:
        _store_bits(out_ptr, offs, _dequantize_bits_exact(q, s[:, None]), in_range[:, None])
    elif (tl.min(s, axis=0) >= FAST_LO) & (tl.max(s, axis=0) <= FAST_HI):
        _store_bf16_bits(out_ptr, offs, _dequantize_bits_fast(q, s[:, None]), in_range[:, None])
    else:
        _store_bits(out_ptr, offs, _dequantize_bits_exact(q, s[:, None]), in_range[:, None])


@triton.jit
def _store_bf16_bits(ptr, offs, bits, mask):
    # bf16 bits (the low 16 of each int32) as bf16, or as the same value in fp32 (its low 16 bits zero)
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr + offs, bits.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, (bits << 16).to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def requantize_rows_kernel(data_ptr, scale_ptr, out_ptr, cols, ROUND_BF16: tl.constexpr, HW_E4M3: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # MXFP8 data [n, cols] (E4M3 bytes, an E8M0 scale byte per BLOCK along each row; cols a multiple of BLOCK) ->
    # the MXFP8 values of its values in blocks of BLOCK consecutive rows, in out's dtype. A program takes one row
    # block and ROWS consecutive columns as a [BLOCK rows, ROWS // BLOCK column blocks, BLOCK columns] tile, so
    # that each (row, column block) scale byte is loaded once and broadcast over its columns.
    # Where the tile's scales allow the direct bf16 bits (dequantize_kernel's fast way), most tiles of real weights
    # keep every value: W_q's values carry at most 4 significant bits, so a value is unchanged by the rounding
    # at its block's scale 2**e unless it falls below E4M3's normal range there (|v| < 2**(e - 6)) with a set bit
    # below that range's step 2**(e - 9). A tile whose blocks all hold no NaN and no such value stores the
    # dequantised bits as they are (the same bits as the rounding gives; checked against a bound first, then per
    # column); any other tile takes the rounding (_mx_quantize_store) of the exact values.
    # HW_E4M3 (sm_89 and later): in the direct bits' scale range every tile takes the exact values by the E4M3
    # conversion and _mx_quantize_store's rounding by that conversion, fewer instructions than the check above.
    NB: tl.constexpr = ROWS // BLOCK
    chunks = (cols + ROWS - 1) // ROWS
    blk = tl.program_id(0) // chunks
    base = blk.to(tl.int64) * BLOCK * cols  # (int64 once per program, int32 offsets within it)
    data_ptr += base
    out_ptr += base
    scale_ptr += base // BLOCK
    first_block = (tl.program_id(0) % chunks) * NB  # the tile's first column block
    r = tl.arange(0, BLOCK)[:, None, None]
    cb = (first_block + tl.arange(0, NB))[None, :, None]
    mask = cb < cols // BLOCK
    offs = r * cols + cb * BLOCK + tl.arange(0, BLOCK)[None, None, :]
    q_bytes = tl.load(data_ptr + offs, mask=mask, other=0)
    q = q_bytes.to(tl.int32)
    s = tl.load(scale_ptr + r * (cols // BLOCK) + cb, mask=mask, other=127).to(tl.int32)
    fast_range = (tl.min(s) >= FAST_LO) & (tl.max(s) <= FAST_HI)
    kept = fast_range  # (a tile keeps its values only where the direct bits apply)
    if HW_E4M3 and fast_range:  # (the values are normal there: the scale's power of two multiplies exactly)
        v = q_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (s << 23).to(tl.float32, bitcast=True)
        _mx_quantize_store(out_ptr, offs, v.to(tl.int32, bitcast=True), mask, 0, True)
    elif fast_range:
        b16 = _dequantize_bits_fast(q, s)  # (every value a normal bf16 there: nothing to round)
        mag = b16 & 0x7FFF
        # the biased exponent of each nonzero value's lowest set bit: its bf16 exponent less 3 plus the trailing
        # zeros of its 4 significant bits [1 | m2 m1 m0] (lowest set bit 1, 2, 4, 8 -> 0, 1, 2, 3); zeros never round
        low = ((mag >> 4) & 7) | 8
        low = low & -low
        lowest = tl.where(mag == 0, 0x7FFF, (mag >> 7) - 3 + (low >> 1) - (low >> 3))
        # A value is on E4M3's grid at its column block's new scale 2**e, so the rounding keeps it, iff its lowest
        # set bit is at least 2**(e - 9) (the grid's step below 2**(e - 6); above, 4 significant bits always fit)
        # and |v| <= 448 * 2**e (the rceil scale of the block's largest ensures it). e is at most the largest of the
        # block's row scales, 2**(smax - 127) (each value is at most 448 times its row's), so a value whose lowest
        # set bit is at least 2**(smax - 127 - 9) is kept whatever e is: one comparison an element, no reduction
        # along the columns. Only a tile holding a value below that bound takes e per column.
        smax = tl.max(s, axis=0, keep_dims=True)
        kept = tl.min(((mag < 0x7F80) & (lowest >= smax - 9)).to(tl.int32)) == 1
        if not kept:
            amax = tl.max(mag, axis=0)  # per column: its block of BLOCK rows
            e = _rceil_exponent(amax << 16)  # the block's scale exponent, from amax's bf16 bits as fp32 bits
            kept = tl.min(((amax < 0x7F80) & (tl.min(lowest, axis=0) - 127 >= e - 9)).to(tl.int32)) == 1
        if kept:
            _store_bf16_bits(out_ptr, offs, b16, mask)
    if not kept:  # NaN, values too small for the new scale, or scales outside the direct bits' range
        _requantize_blocks(data_ptr, scale_ptr, out_ptr, cols, first_block, ROUND_BF16, NB, BLOCK)


@triton.jit
def _requantize_blocks(data_ptr, scale_ptr, out_ptr, cols, first_block, ROUND_BF16: tl.constexpr, NB: tl.constexpr,
                       BLOCK: tl.constexpr):
    # requantize_rows_kernel's general way, one [BLOCK, BLOCK] block of its tile at a time (few registers: these
    # tiles are rare): the exact values (rounded to bf16 where ROUND_BF16, as a dequantisation into bf16 rounds;
    # in the direct bits' scale range that rounds nothing), then _mx_quantize_store along the rows
    r = tl.arange(0, BLOCK)[:, None]
    for j in range(NB):
        cb = first_block + j
        if cb < cols // BLOCK:
            offs = r * cols + cb * BLOCK + tl.arange(0, BLOCK)[None, :]
            q = tl.load(data_ptr + offs).to(tl.int32)
            bits = _dequantize_bits_exact(q, tl.load(scale_ptr + r * (cols // BLOCK) + cb).to(tl.int32))
            if ROUND_BF16:  # (_store_bits' rounding, the fp32 bits of the bf16 value kept)
                bits = _bf16_rne(bits) << 16
            _mx_quantize_store(out_ptr, offs, bits, None, 0, False)


@triton.jit
def _dequantize_bits_fast(q, s):
    # bf16 bits of E4M3 byte q times 2**(s - 127) for FAST_LO <= s <= FAST_HI. A normal q (exponent field e >= 1)
    # has the biased exponent e + s - 7 and its 3 mantissa bits on top of bf16's: one add on [e | m] and a shift.
    # A subnormal m * 2**-9 (e = 0): m's fp32 bits (exact: m < 8) with the exponent moved by s - 136, of which the
    # top 16 bits are all (3 significant bits). E4M3FN's NaN (0x7F / 0xFF) gives bf16's NaN.
    mag = q & 0x7F
    normal = (mag + ((s - 7) << 3)) << 4
    m = mag & 0x7
    sub = (m.to(tl.float32).to(tl.int32, bitcast=True) + ((s - 136) << 23)) >> 16
    bits = tl.where(mag >= 8, normal, tl.where(m == 0, 0, sub))
    return tl.where(mag == 0x7F, 0x7FC0, bits | ((q & 0x80) << 8))


@triton.jit
def _dequantize_bits_exact(q, s):
    # fp32 bits of E4M3 byte q times 2**(s - 127) for any scale byte s (NaN for 255), rounded nowhere:
    # |value| = sig * 2**k, normals (8 + man) * 2**(exp - 10), subnormals man * 2**-9, then the block's scale
    exp = (q >> 3) & 0xF
    man = q & 0x7
    sig = tl.where(exp == 0, man, man | 8)
    k = tl.where(exp == 0, -9, exp - 10) + s - 127
    bits = _times_pow2_bits(sig.to(tl.float32).to(tl.int32, bitcast=True), k)  # (sig: 0..15, exact as a float)
    bits = bits | ((q & 0x80) << 24)
    nan = ((exp == 15) & (man == 7)) | (s == 255)  # E4M3FN's only NaN (no inf); the scale's NaN byte
    return tl.where(nan, 0x7FC00000, bits)


@triton.jit
def _order_key(v):
    # int32 keys in the order of the fp32 values v, by integer operations only (a float comparison could flush
    # subnormals to zero): negatives below the positives, -0 equal to +0, every NaN one key above +inf's
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    key = tl.where(bits < 0, -mag, mag)
    return tl.where(mag > 0x7F800000, 0x7F800001, key)


@triton.jit
def _row_tile(n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The tile of the row kernels (top-k, routing): this program's ROWS rows (int64) of a row-major
    [n_rows, n_cols] array, columns 0 .. BLOCK - 1, which rows exist and which elements exist."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = r < n_rows
    return r, c, live, live[:, None] & (c < n_cols)[None, :]


@triton.jit
def topk_kernel(v_ptr, ids_ptr, n_rows, n_cols, K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows per program, a whole row (n_cols <= BLOCK) in registers; K rounds of the largest key, the winner
    # then removed
    r, c, live, mask = _row_tile(n_rows, n_cols, ROWS, BLOCK)
    v = tl.load(v_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
    key = _order_key(v)
    # unique keys: ties to the lower column by construction (whatever argmax does with equal values)
    key = key.to(tl.int64) * BLOCK + (BLOCK - 1 - c)[None, :]
    gone = -(2**63)  # padding and removed entries: below every value's key
    key = tl.where(mask, key, gone)
    for j in tl.static_range(K):
        best = tl.argmax(key, axis=1)
        tl.store(ids_ptr + r * K + j, best.to(tl.int64), mask=live)
        key = tl.where(c[None, :] == best[:, None], gone, key)


@triton.jit
def _route_rows(x, r, c, live, mask, bias_ptr, ids_ptr, w_ptr, scores_ptr, n_cols, scale, K: tl.constexpr,
                KP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # router.route of the fp32 logits x [ROWS, BLOCK] (-inf past n_cols, 0 in rows past the end): scores
    # (softmax / sigmoid), the top-k of scores (+ bias) as topk_kernel selects it, their scores as weights,
    # renormalised and scaled
    if SOFTMAX:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    else:
        s = 1.0 / (1.0 + tl.exp(-x))
    tl.store(scores_ptr + r[:, None] * n_cols + c[None, :], s, mask=mask)
    v = s
    if HAS_BIAS:
        v = s + tl.load(bias_ptr + c, mask=c < n_cols, other=0.0)[None, :]
    key = _order_key(v)
    key = key.to(tl.int64) * BLOCK + (BLOCK - 1 - c)[None, :]
    gone = -(2**63)
    key = tl.where(mask, key, gone)
    j_col = tl.arange(0, KP)
    w = tl.zeros((ROWS, KP), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(key, axis=1)
        tl.store(ids_ptr + r * K + j, best.to(tl.int64), mask=live)
        picked = c[None, :] == best[:, None]
        w = tl.where(j_col[None, :] == j, tl.sum(tl.where(picked, s, 0.0), axis=1)[:, None], w)
        key = tl.where(picked, gone, key)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scale
    tl.store(w_ptr + r[:, None] * K + j_col[None, :], w, mask=live[:, None] & (j_col < K)[None, :])


@triton.jit
def route_forward_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scores_ptr, n_rows, n_cols, scale, K: tl.constexpr,
                         KP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # router.route for ROWS rows of fp32 logits
    r, c, live, mask = _row_tile(n_rows, n_cols, ROWS, BLOCK)
    x = tl.load(logits_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=-float("inf"))
    x = tl.where(live[:, None], x, 0.0)  # rows past the end: no NaN from an all -inf row
    _route_rows(x, r, c, live, mask, bias_ptr, ids_ptr, w_ptr, scores_ptr, n_cols, scale, K, KP, SOFTMAX, HAS_BIAS,
                NORM, ROWS, BLOCK)


@triton.jit
def router_forward_kernel(x_ptr, wr_ptr, lbias_ptr, bias_ptr, logits_ptr, ids_ptr, w_ptr, scores_ptr, n_rows, n_cols,
                          hidden, scale, K: tl.constexpr, KP: tl.constexpr, SOFTMAX: tl.constexpr,
                          HAS_LBIAS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    # the router's logits x [rows, hidden] @ wr [n_cols, hidden]^T (+ lbias) of 16-bit x and wr, exact products
    # summed in fp32 on the tensor cores, stored, then router.route of them (_route_rows) from the registers
    r, c, live, mask = _row_tile(n_rows, n_cols, ROWS, BLOCK)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        in_k = (k0 + kk) < hidden
        a = tl.load(x_ptr + r[:, None] * hidden + (k0 + kk)[None, :], mask=live[:, None] & in_k[None, :], other=0.0)
        b = tl.load(wr_ptr + c[None, :].to(tl.int64) * hidden + (k0 + kk)[:, None],
                    mask=in_k[:, None] & (c < n_cols)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    if HAS_LBIAS:
        acc = acc + tl.load(lbias_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(logits_ptr + r[:, None] * n_cols + c[None, :], acc, mask=mask)
    x = tl.where(mask, acc, -float("inf"))
    x = tl.where(live[:, None], x, 0.0)  # rows past the end: no NaN from an all -inf row
    _route_rows(x, r, c, live, mask, bias_ptr, ids_ptr, w_ptr, scores_ptr, n_cols, scale, K, KP, SOFTMAX, HAS_BIAS,
                NORM, ROWS, BLOCK)


@triton.jit
def route_backward_kernel(scores_ptr, ids_ptr, dw_ptr, ds_ptr, dlogits_ptr, dl_in_ptr, parts_ptr, n_rows, n_cols,
                          scale, K: tl.constexpr, KP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_DS: tl.constexpr,
                          NORM: tl.constexpr, HAS_DL: tl.constexpr, PARTS: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK: tl.constexpr):
    # d logits of route_forward_kernel from d weights [rows, K] and (HAS_DS) d scores [rows, E]: through the
    # scaling and renormalisation to the selected scores, then through softmax / sigmoid
    r, c, live, mask = _row_tile(n_rows, n_cols, ROWS, BLOCK)
    s = tl.load(scores_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=0.0)
    ds = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    if HAS_DS:
        ds = tl.load(ds_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=0.0)
    j_col = tl.arange(0, KP)
    kmask = live[:, None] & (j_col < K)[None, :]
    ids = tl.load(ids_ptr + r[:, None] * K + j_col[None, :], mask=kmask, other=-1)
    dw = tl.load(dw_ptr + r[:, None] * K + j_col[None, :], mask=kmask, other=0.0) * scale
    sel = tl.zeros((ROWS, KP), dtype=tl.float32)  # the selected scores
    for j in tl.static_range(K):
        id_j = tl.sum(tl.where(j_col[None, :] == j, ids, 0), axis=1)
        sel = tl.where(j_col[None, :] == j, tl.sum(tl.where(c[None, :] == id_j[:, None], s, 0.0), axis=1)[:, None],
                       sel)
    d_sel = dw
    if NORM:  # w = sel / (sum(sel) + eps): d sel_j = (dw_j - sum_k dw_k w_k) / (sum(sel) + eps)
        denom = tl.sum(sel, axis=1) + 1e-20
        d_sel = (dw - (tl.sum(dw * sel, axis=1) / denom)[:, None]) / denom[:, None]
    for j in tl.static_range(K):
        id_j = tl.sum(tl.where(j_col[None, :] == j, ids, 0), axis=1)
        d_j = tl.sum(tl.where(j_col[None, :] == j, d_sel, 0.0), axis=1)
        ds = ds + tl.where(c[None, :] == id_j[:, None], d_j[:, None], 0.0)
    if SOFTMAX:
        dl = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    else:
        dl = ds * s * (1.0 - s)
    if HAS_DL:  # plus an incoming d logits (the logits' own gradient, e.g. a z-loss's)
        dl = dl + tl.load(dl_in_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=0.0)
    tl.store(dlogits_ptr + r[:, None] * n_cols + c[None, :], dl, mask=mask)
    if PARTS:  # and d logits as three bf16 parts side by side, [rows, 3 n_cols]: router._bf16_parts, torch.cat'ed
        hi = _bf16_rne(dl.to(tl.int32, bitcast=True))
        hi_f = (hi << 16).to(tl.float32, bitcast=True)
        rest = tl.where((hi & 0x7F80) != 0x7F80, dl - hi_f, 0.0)  # (hi not inf / NaN: the remainder, exact)
        mid = _bf16_rne(rest.to(tl.int32, bitcast=True))
        lo = _bf16_rne((rest - (mid << 16).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True))
        row = parts_ptr + r[:, None] * (3 * n_cols) + c[None, :]
        tl.store(row, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(row + n_cols, mid.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(row + 2 * n_cols, lo.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def transpose_kernel(x_ptr, out_ptr, marks_ptr, rows, cols, FACTORS: tl.constexpr, BIAS: tl.constexpr,
                     MARKS: tl.constexpr, TILE: tl.constexpr):
    # [e, rows, cols] -> [e, cols, rows] (any element type, as the pointers give it): a program takes a TILE x TILE
    # tile of one matrix; its load runs along cols, its store along rows (each gets its own coalesced layout).
    # FACTORS: E8M0 scale bytes (each at most 134) stored as int16 (S + BIAS) << 7: the row factors of
    # cuda_mx.MxColumnWeight (BIAS 120, the bf16 bits of 2**(S - 7)); MARKS: or'ed with marks[e, r // 32, c] (int16)
    e = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * TILE + tl.arange(0, TILE)[:, None]
    c = tl.program_id(2) * TILE + tl.arange(0, TILE)[None, :]
    mask = (r < rows) & (c < cols)
    base = e * rows * cols
    v = tl.load(x_ptr + base + r * cols + c, mask=mask)
    if FACTORS:
        v = ((v.to(tl.int32) + BIAS) << 7).to(tl.int16)
        if MARKS:
            v = v | tl.load(marks_ptr + e * (rows // 32) * cols + (r // 32) * cols + c, mask=mask, other=0)
    tl.store(out_ptr + base + c * rows + r, v, mask=mask)
