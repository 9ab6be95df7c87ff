"""MXFP8 values of a bf16 matrix, in bf16: the operands of precision="mxfp8" (docs/mxfp8.md).

dst = fake_quantize(src) along one axis ("rceil", blocks of 32): per block, e from the amax's bits, each
element rounded to E4M3 at the scale 2**e, times 2**e. The arithmetic is that of mxfp8.fake_quantize_fast,
step for step in fp32, so the bits are those of the torch ops (and of mxfp8.quantize + dequantize):

  |s| = |x| * 2**-e                          exact (a power of two; |s| <= 448)
  r   = (|s| + C) - C, C = 1.5 * 2**(max(E, -6) + 20), E = |s|'s exponent: |s| on E4M3's grid, ties to even
  out = bf16((r | sign(x)) * 2**e)           NaN for a block holding NaN / inf

The adds go through add.rn / sub.rn explicitly, so no compiler can fold (|s| + C) - C.

mode (a run-time scalar: one compiled kernel for every operand):
  0  blocks along the columns (a row's 32 consecutive values): the GEMMs' A rows, the weights forward.
     A warp takes 32 vectors of 8 columns (16-byte loads); the 4 lanes of a block share its amax by shuffle.
     Each thread loads UNROLL vectors (one per grid stride) before it computes any: memory-level parallelism.
  1  blocks along the rows (32 consecutive rows of a column): the weights' backward axis. A thread takes two
     adjacent columns of one 32-row block as 32-bit words (a warp reads 128 contiguous bytes per row), all 32
     loads issued before any arithmetic, the amax taken on the bf16 bits.
  2  as 1, for rows in schedule order (the weight-gradient operands): each expert's blocks start at its
     segment's first row, and the rows that are not routed rows (padding, past the last segment) count as
     zeros, whatever they hold. A 32-row block lies in one TILE_M tile, so one expert: its routed rows are a
     prefix of the block, from tile_expert, seg_end and seg_rows.
  3  both of d gate_up's operands from one read: dst = mode 2's values (schedule rows) and src overwritten in
     place with mode 0's (along the columns, every row). The units are mode 2's; the 16 lanes of a half-warp
     hold the 32 columns of one row block (columns % 32 == 0: a half-warp never straddles two row blocks), so
     each row's block shares its amax by four shuffles. A thread writes only the words it has read.
  4  as 2, row r of dst made from src row row_src[r] (a schedule's row_token: x's or d y's rows for a weight
     gradient), only the routed rows read: the gather into schedule order and the quantisation in one pass,
     with no bf16 rows in schedule order written and read in between. src [N, C] may be a column block of a
     wider matrix (its row stride).
The work units are walked by a fixed grid (grid-stride, whole warps together: the shuffles need every lane);
each output element is written once, by one thread: the result does not depend on the grid. The grid is
MX_QUANT_CTAS_PER_SM resident CTAs per SM, the register budget the launch bound gives each thread.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .registry import MX_QUANT_CTAS_PER_SM, MX_QUANT_UNROLL as UNROLL
from .registry import MX_QUANT_THREADS as THREADS
from .registry import TILE_M

BLOCK = 32
VEC = 8  # mode 0: columns per lane (one 16-byte load)
LANES_PER_BLOCK = BLOCK // VEC
BF16_MAG = 0x7FFF
HIGH_HALF = -(2**16)  # 0xFFFF0000: the upper bf16 of a 32-bit word, in place
MAG_MASK = 0x7FFFFFFF
SIGN_BIT = -(2**31)
EXP_MASK = 0x7F800000
C_MIN = (127 - 6) << 23  # C's exponent never below E4M3's subnormal range (2**-6)
C_ADD = (20 << 23) | (1 << 22)  # C = 1.5 * 2**(E + 20)


def _rn(op: str):
    @dsl_user_op
    def f(a, b, *, loc=None, ip=None) -> cutlass.Float32:
        args = [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b)]
        return cutlass.Float32(
            llvm.inline_asm(T.f32(), args, f"{op}.rn.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        )

    return f


_add_rn = _rn("add")
_sub_rn = _rn("sub")


@cute.jit
def rceil_scales(amax_bits: cutlass.Int32):
    """(2**-e, 2**e) as fp32 for a block whose largest magnitude has these bits (the rceil rule: e = p - 8, one
    more where the significand exceeds 1.75; e = -127 for zero and subnormal amax; 2**e NaN for NaN / inf)."""
    biased = (amax_bits >> 23) & 0xFF
    e = biased - 135
    if (amax_bits & 0x7FFFFF) > 0x600000:
        e = e + 1
    if biased == 0:
        e = cutlass.Int32(-127)
    e = cutlass.max(cutlass.min(e, cutlass.Int32(127)), cutlass.Int32(-127))
    down = cutlass.Int32((127 - e) << 23).bitcast(cutlass.Float32)
    up_bits = (e + 127) << 23
    if e == -127:
        up_bits = cutlass.Int32(1 << 22)  # 2**-127, an fp32 subnormal
    if biased == 255:
        up_bits = cutlass.Int32(0x7FC00000)  # NaN
    return down, up_bits.bitcast(cutlass.Float32)


@cute.jit
def quantize_value(x: cutlass.Float32, down: cutlass.Float32, up: cutlass.Float32) -> cutlass.Float32:
    bits = x.bitcast(cutlass.Int32)
    s = (bits & MAG_MASK).bitcast(cutlass.Float32) * down
    c = cutlass.max((s.bitcast(cutlass.Int32) & EXP_MASK), cutlass.Int32(C_MIN)) + C_ADD
    cf = c.bitcast(cutlass.Float32)
    r = _sub_rn(_add_rn(s, cf), cf)
    return (r.bitcast(cutlass.Int32) | (bits & SIGN_BIT)).bitcast(cutlass.Float32) * up


@cute.jit
def quantize_lane_block(x: cute.Tensor, live: cutlass.Boolean):
    """x (fp32 registers): this lane's values of a block of 32 columns that four adjacent lanes hold (lanes
    4j .. 4j + 3, LANES_PER_BLOCK), made their MXFP8 values in place: the block's largest magnitude by two
    shuffles, then each value (rceil_scales, quantize_value). Every lane of the warp takes part (the shuffles); a
    lane with live False adds amax 0 and keeps x."""
    amax = cutlass.Int32(0)
    if live:
        for i in cutlass.range_constexpr(cute.size(x)):
            amax = cutlass.max(amax, x[i].bitcast(cutlass.Int32) & MAG_MASK)
    for k in cutlass.range_constexpr(2):
        amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
    if live:
        down, up = rceil_scales(amax)
        for i in cutlass.range_constexpr(cute.size(x)):
            x[i] = quantize_value(x[i], down, up)


@cute.jit
def mx_values_of_lane_block(v: cute.Tensor, x: cute.Tensor, live: cutlass.Boolean):
    """v (bf16 registers): this lane's values of a 4-lane block made their MXFP8 values in place, through x (fp32
    registers of v's size; quantize_lane_block): the bits mok_mx_quant gives for the stored values."""
    x.store(v.load().to(cutlass.Float32))
    quantize_lane_block(x, live)
    v.store(x.load().to(v.element_type))


class MxQuant:
    @cute.jit
    def __call__(
        self,
        src: cute.Tensor,  # (R, C) bf16
        dst: cute.Tensor,  # (R, C) bf16
        tile_expert: cute.Tensor,  # (R / TILE_M,) int32 (mode 2; any one-element tensor otherwise)
        seg_end: cute.Tensor,  # (E,) int32
        seg_rows: cute.Tensor,  # (E,) int32
        row_src: cute.Tensor,  # (R,) int64 (mode 4; any one-element tensor otherwise)
        mode: cutlass.Int32,
        grid: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(src, dst, tile_expert, seg_end, seg_rows, row_src, mode).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=MX_QUANT_CTAS_PER_SM,
            preferred_smem_carveout=0, stream=stream,  # no shared memory (a carveout: no device query at build)
        )

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, tile_expert: cute.Tensor, seg_end: cute.Tensor,
               seg_rows: cute.Tensor, row_src: cute.Tensor, mode: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        first = bidx * THREADS + tidx
        stride = gdim * THREADS
        rows = cute.size(dst, mode=[0])  # (src's too, but in mode 4)
        cols = cute.size(src, mode=[1])
        if mode == 0:
            n_vec = cols // VEC
            units = rows * n_vec
            whole = (units + 31) // 32 * 32  # every lane of a warp takes every step (the shuffles)
            fin = cute.make_rmem_tensor((VEC, UNROLL), src.element_type)  # column j: unit j's vector
            row = cute.make_rmem_tensor((UNROLL,), cutlass.Int32)  # unit j's row and vector (one division each)
            vec = cute.make_rmem_tensor((UNROLL,), cutlass.Int32)
            acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            res = cute.make_rmem_tensor((VEC,), dst.element_type)
            for base in range(first, whole, stride * UNROLL):
                for j in cutlass.range_constexpr(UNROLL):  # the loads first
                    u = base + j * stride
                    row[j] = u // cutlass.max(n_vec, 1)
                    vec[j] = u - row[j] * n_vec
                    if u < units:
                        cute.autovec_copy(cute.zipped_divide(src[(row[j], None)], (VEC,))[(None, vec[j])],
                                          fin[(None, j)])
                for j in cutlass.range_constexpr(UNROLL):
                    live = base + j * stride < units
                    if live:
                        acc.store(fin[(None, j)].load().to(cutlass.Float32))
                    quantize_lane_block(acc, live)
                    if live:
                        res.store(acc.load().to(dst.element_type))
                        cute.autovec_copy(res, cute.zipped_divide(dst[(row[j], None)], (VEC,))[(None, vec[j])])
        else:
            # 32-bit words: two adjacent bf16 columns (the low half is the even column)
            src2 = cute.recast_tensor(src, cutlass.Int32)
            dst2 = cute.recast_tensor(dst, cutlass.Int32)
            n_pair = cols // 2
            units = (rows // BLOCK) * n_pair
            words = cute.make_rmem_tensor((BLOCK,), cutlass.Int32)
            res = cute.make_rmem_tensor((2,), dst.element_type)
            last = units
            if mode == 3:  # every lane takes every step (the shuffles; units is a multiple of 16)
                last = (units + 31) // 32 * 32
            for u in range(first, last, stride):
                live = u < units
                b = u // cutlass.max(n_pair, 1)
                p = u - b * n_pair
                r0 = b * BLOCK
                # the block's 32 words of column pair p: one base address, the row stride apart
                src_blk = cute.zipped_divide(src2[(None, p)], (BLOCK,))[(None, b)]  # (not read in mode 4)
                dst_blk = cute.zipped_divide(dst2[(None, p)], (BLOCK,))[(None, b)]
                routed = cutlass.Int32(BLOCK)  # rows of the block that count (a prefix)
                if (mode >= 2) & live:
                    e = tile_expert[r0 // TILE_M]
                    routed = 0
                    if e >= 0:
                        start = cutlass.Int32(0)
                        if e > 0:
                            start = seg_end[e - 1]
                        routed = cutlass.max(cutlass.min(start + seg_rows[e] - r0, cutlass.Int32(BLOCK)),
                                             cutlass.Int32(0))
                if live:
                    if mode == 4:
                        for i in cutlass.range_constexpr(BLOCK):
                            words[i] = 0
                            if i < routed:
                                words[i] = src2[(cutlass.Int32(row_src[r0 + i]), p)]
                    else:
                        for i in cutlass.range_constexpr(BLOCK):  # every row exists (rows % 32 == 0): no predicate
                            words[i] = src_blk[i]
                if mode == 3:
                    # each row along its 32 columns (the half-warp's 16 lanes), into src in place, a row at a
                    # time (re-read from L1: unrolled, the rows' shuffles would need more than 64 registers)
                    for i in cutlass.range(BLOCK, unroll=1):
                        w = cutlass.Int32(0)
                        if live:
                            w = src_blk[i]
                        amax = cutlass.max(w & BF16_MAG, (w >> 16) & BF16_MAG)
                        for k in cutlass.range_constexpr(4):
                            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
                        down, up = rceil_scales(amax << 16)
                        res[0] = quantize_value((w << 16).bitcast(cutlass.Float32), down, up).to(dst.element_type)
                        res[1] = quantize_value((w & HIGH_HALF).bitcast(cutlass.Float32), down, up).to(dst.element_type)
                        if live:
                            src_blk[i] = cute.recast_tensor(res, cutlass.Int32)[0]
                # amax on the bf16 magnitude bits (ordered as the magnitudes; NaN above inf): an fp32's bits
                # are the bf16's shifted up by 16
                amax0 = cutlass.Int32(0)
                amax1 = cutlass.Int32(0)
                for i in cutlass.range_constexpr(BLOCK):
                    if i >= routed:
                        words[i] = 0
                    amax0 = cutlass.max(amax0, words[i] & BF16_MAG)
                    amax1 = cutlass.max(amax1, (words[i] >> 16) & BF16_MAG)
                down0, up0 = rceil_scales(amax0 << 16)
                down1, up1 = rceil_scales(amax1 << 16)
                if live:
                    for i in cutlass.range_constexpr(BLOCK):
                        w = words[i]
                        res[0] = quantize_value((w << 16).bitcast(cutlass.Float32), down0, up0).to(dst.element_type)
                        res[1] = quantize_value((w & HIGH_HALF).bitcast(cutlass.Float32), down1, up1).to(
                            dst.element_type)
                        dst_blk[i] = cute.recast_tensor(res, cutlass.Int32)[0]
