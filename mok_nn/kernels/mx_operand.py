"""E4M3 bytes of MXFP8 weights made bf16 inside the GEMMs that read them: the recipe, shared by the forward's GEMMs
(mx_swapped.py: each thread's wgmma A fragment, in registers) and precision="mxfp8"'s dgrad GEMMs (MxRequantB
below: each B stage, in shared memory). An E4M3 value times a power of two is a bf16 value, so a GEMM on the
converted values is bitwise the bf16 GEMM of dequantize(W) (mxfp8.dequantize), with no dequantised copy of the
weights in global memory.

The bits (per E4M3 byte b = s eeee mmm, block scale byte S):

    r = (s << 15) | (eeee mmm << 4)     as bf16: b's value times 2**-120, for normal and subnormal b alike
                                        (PRMT: lane = b's sign byte : b; shift left 4; one mask)
    out = r * 2**(S - 7)                one bf16 multiply (mul.rn.bf16x2, no flush of subnormals), S <= 134
    out = (r * 2**127) * 2**(S - 134)   S > 134 (the first product is exact); S = 255: NaN (a NaN block)

so each value is rounded once from its exact value, as dequantize rounds its fp32 product to bf16. Data bytes
0x7F / 0xFF (E4M3 NaN) under a scale that is not 255 would come out finite: the caller does not take this path
for such weights (cuda_backend.MxWeight). tests/test_mx_operand_bits.py checks this recipe on every byte
under every scale against mxfp8.dequantize; tests/gpu the kernels against dequantize + the bf16 kernels.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .registry import ROUNDS_FLAG, STAGE_FLAG

BK = 64  # K per stage (the GEMM's tile_mnk[2]): two scale blocks
BYTES_PER_LOAD = 16
SINGLE_MAX = 134  # scale bytes up to this take one multiply (2**(S - 7) is a normal bf16 up to 2**127)
MX_BARRIER_ID = 4  # named barrier of the consumer threads around each stage's conversion


def _asm_b32(ptx: str, *values):
    """One 32-bit result of an inline PTX block over 32-bit operands."""
    @dsl_user_op
    def f(*args, loc=None, ip=None) -> cutlass.Int32:
        ops = [cutlass.Int32(v).ir_value(loc=loc, ip=ip) for v in args]
        constraints = ",".join(["=r"] + ["r"] * len(ops))
        return cutlass.Int32(llvm.inline_asm(T.i32(), ops, ptx, constraints, has_side_effects=False,
                                             is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
    return f(*values)


# The bits r of two E4M3 bytes as a bf16x2 word: PRMT makes each 16-bit lane b's byte with its sign byte above it
# (selector nibbles 8 + i replicate byte i's top bit), so lane << 4 has s at bit 15 and eeee mmm at bits 10..4;
# LANE_BITS keeps those (and drops the bits the shift moved across lanes). LOW: bytes 0, 1; HIGH: bytes 2, 3.
LOW_SELECTOR, HIGH_SELECTOR = 0x9180, 0xB3A2
LANE_BITS = 0x87F087F0


def _e4m3_pair_ptx(selector: int) -> str:
    return ("{ .reg .b32 t;"
            f" prmt.b32 t, $1, 0, {selector:#x}; shl.b32 t, t, 4; and.b32 t, t, {LANE_BITS:#x};"
            " mul.rn.bf16x2 $0, t, $2; }")  # times the bf16x2 factor $2


_LOW_PAIR = _e4m3_pair_ptx(LOW_SELECTOR)  # elements k, k + 1 of the word's 4
_HIGH_PAIR = _e4m3_pair_ptx(HIGH_SELECTOR)  # elements k + 2, k + 3


# --------------------------------------------------------------------------
# The backward's B: MXFP8 weights requantised along K (the grouped GEMM's b_mx_cols)
#
# The dgrad GEMMs (d h = d y @ W2, d x = d gate_up @ W13) take B = W[e] with K along the stored rows and N along
# the stored blocks' axis, and precision="mxfp8" wants W_q's MXFP8 values along K (column-wise, docs/mxfp8.md):
# a second quantisation of W_q. Each stage's bytes arrive N-major (one (bn, 64) box, K rows of bn bytes) with a
# table of row factors; consumer thread t owns column t (one N), i.e. 64 K values = two K blocks of 32, so the
# column-wise block maxima need no exchange between threads. Per K block, per thread:
#
#     v = r * f_k                     W_q in bf16 (the exact value rounded once, as dequantize does): r = the
#                                     byte's bits as bf16 (b * 2**-120, as above), f_k = 2**(S_k - 7) for the
#                                     row's scale byte S_k (S_k <= 134: f_k a normal bf16)
#     e = rceil(max |v|)              quantize's rule on the bf16 bits of the column block's maximum
#     q = e4m3(v * 2**-e)             cvt.rn.satfinite.e4m3x2.f32: round to nearest even (|v * 2**-e| <= 448)
#     out = r(q) * 2**(e + 120)       the E4M3 value back in bf16 as above, exact
#
# which is fake_quantize's value along K of W_q, bit for bit (tests/gpu/test_mx_gemm_cuda.py against
# triton_ops.requantize_rows; the recipe on the CPU: tests/test_mx_operand_bits.py). S_k <= 134 also bounds
# e <= 7, so 2**(e + 120) is a bf16 number: the caller (cuda_mx.column_reason) takes this path only for such
# weights, without NaN bytes or blocks. A value can change only where it lies below E4M3's normal range at the new
# scale, |v| < 2**(e - 6) (v has at most 4 significant bits): a column block whose smallest |v| is at least that
# (most blocks of real weights) keeps out = v.
#
# Most column blocks hold no value that changes, so the stage is made as W_q first: thread t converts the 64 bytes of
# K row t // 4, columns 64 (t % 4) .., with the recipe above, and stores them N-major (the stage's bf16
# B is N-major, as the bf16 dgrad kernel's). The caller marks the 32 x 32 blocks (32 K rows, 32 columns) holding a
# value that changes by ROUNDS_FLAG in their rows' factors, and every factor of a stage holding such a block by
# STAGE_FLAG (cuda_mx.MxColumnWeight). In a marked stage, after a barrier, each warp whose 32 columns hold a marked
# block reads that block back, one column a thread, and applies the steps above to it. The threads read the stage's
# flag from its first factor (zero-filled factors past N carry none), so the whole CTA takes the same path.

FACTOR_PAIR_BITS = 0xFF80FF80  # two row factors' bits without the flags

_MAX = "max.bf16x2 $0, $1, $2;"
_MIN = "min.bf16x2 $0, $1, $2;"
BF16_INF_PAIR = 0x7F807F80
# q = e4m3(v * 2**-e) for a bf16x2 word v ($1, times $2 = 2**-e twice), then back to bf16 times $3 = 2**(e + 120)
_REQUANT_PAIR = (
    "{ .reg .b32 t, lo, hi, r; .reg .b16 q;"
    " mul.rn.bf16x2 t, $1, $2; shl.b32 lo, t, 16; and.b32 hi, t, 0xFFFF0000;"
    " cvt.rn.satfinite.e4m3x2.f32 q, hi, lo; cvt.u32.u16 r, q;"
    f" prmt.b32 r, r, 0, {LOW_SELECTOR:#x}; shl.b32 r, r, 4; and.b32 r, r, {LANE_BITS:#x};"
    " mul.rn.bf16x2 $0, r, $3; }"
)


@cute.jit
def _column_scale(amax_pair: cutlass.Int32, amin_pair: cutlass.Int32):
    """(2**-e, 2**(e + 120)) as bf16x2 words, and whether any value may round, for a column block whose largest
    and smallest |v| are the larger half of amax_pair and the smaller half of amin_pair (bf16 bits)."""
    a16 = cutlass.max(amax_pair & 0xFFFF, (amax_pair >> 16) & 0xFFFF)
    e = (a16 >> 7) - 135
    if (a16 & 0x7F) > 0x60:  # significand above 1.75: one more (rceil)
        e = e + 1
    e = cutlass.max(e, cutlass.Int32(-127))  # zero and tiny blocks
    down = (127 - e) << 7
    up = (e + 247) << 7
    # Only a value below E4M3's normal range at the block's scale, |v| < 2**(e - 6), can round (W_q's values have
    # at most 4 significant bits); most blocks hold none and keep v as it is. 2**(e - 6) as bf16 bits:
    floor = (e + 121) << 7
    if e < -120:
        floor = cutlass.Int32(1) << (e + 127)  # a bf16 subnormal
    rounds = cutlass.min(amin_pair & 0xFFFF, (amin_pair >> 16) & 0xFFFF) < floor
    return down | (down << 16), up | (up << 16), rounds


class MxRequantB:
    """Consumer side of the dgrad's MXFP8 B: to_bf16(stage) turns the stage's N-major E4M3 bytes into the bf16
    N-major B tile of W_q's MXFP8 values along K (see above).

    sB: the bf16 B buffers (bn, 64, stages), N-major as the wgmma reads them; sB8: the same memory as bytes,
    (bn, 64, 2 stages) N-major: the bytes of stage s are piece 2 s + 1 (the upper half); sF: the row factors
    (64, bn / 32, stages) u16, K fastest (f_k of the stage's 64 rows for each 32 columns, with the flags above);
    tid: this consumer thread (K row tid // 4, columns 64 (tid % 4) .. of the conversion; column tid of the
    requantisation); threads: the consumer threads."""

    def __init__(self, sB, sB8, sF, tid, threads: int):
        assert threads == 4 * BK, "four threads a K row of the stage"
        self.sB, self.sB8, self.sF, self.col = sB, sB8, sF, tid
        self.k, self.c = tid // 4, tid % 4
        # The 16-byte pieces of a thread's row in a rotated order, (c + k) % 4 first: each quarter warp then loads
        # and stores 8 distinct bank groups (the bytes' rows are 256 bytes apart; the bf16 rows are swizzled by row)
        self.rot = (self.c + self.k) % 4
        self.barrier = pipeline.NamedBarrier(barrier_id=MX_BARRIER_ID, num_threads=threads)
        self.raw = cute.make_rmem_tensor((BK,), cutlass.Uint8)
        self.out = cute.make_rmem_tensor((32,), cutlass.BFloat16)

    @cute.jit
    def to_bf16(self, stage):
        src = cute.zipped_divide(self.sB8[(None, self.k, 2 * stage + 1)], (BYTES_PER_LOAD,))
        raw_v = cute.zipped_divide(self.raw, (BYTES_PER_LOAD,))
        for q in cutlass.range_constexpr(BK // BYTES_PER_LOAD):
            cute.autovec_copy(src[(None, 4 * self.c + (q + self.rot) % 4)], raw_v[(None, q)])
        self.barrier.arrive_and_wait()  # every thread's bytes are in registers: the bf16 rows may overwrite them
        self._w_q(stage)
        barrier = self.barrier
        if (self.sF[(0, 0, stage)].to(cutlass.Int32) & STAGE_FLAG) != 0:
            barrier.arrive_and_wait()  # the stage's W_q is in shared memory
            self._requantize_columns(stage)
        cute.arch.fence_proxy("async.shared", space="cta")  # the wgmma (async proxy) reads these stores
        self.barrier.arrive_and_wait()

    @cute.jit
    def _w_q(self, stage):
        """W_q in bf16 for this thread's 64 bytes (K row k, columns 64 c ..): one multiply a pair."""
        f0 = self.sF[(self.k, 2 * self.c, stage)].to(cutlass.Int32)
        f1 = self.sF[(self.k, 2 * self.c + 1, stage)].to(cutlass.Int32)
        pair0 = (f0 | (f0 << 16)) & FACTOR_PAIR_BITS
        pair1 = (f1 | (f1 << 16)) & FACTOR_PAIR_BITS
        words = cute.recast_tensor(self.raw, cutlass.Int32)  # 16 words: piece q's columns 4 w .. 4 w + 3
        out = cute.recast_tensor(self.out, cutlass.Int32)
        out_v = cute.zipped_divide(self.out, (8,))
        dst = cute.zipped_divide(self.sB[(None, self.k, stage)], (8,))  # the row's 8-column pieces
        for q in cutlass.range_constexpr(BK // BYTES_PER_LOAD):
            piece = (q + self.rot) % 4
            f = pair0
            if piece >= 2:  # the second block of 32 columns
                f = pair1
            for w in cutlass.range_constexpr(4):
                word = words[4 * q + w]
                out[2 * w] = _asm_b32(_LOW_PAIR, word, f)
                out[2 * w + 1] = _asm_b32(_HIGH_PAIR, word, f)
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(out_v[(None, h)], dst[(None, 8 * self.c + 2 * piece + h)])

    @cute.jit
    def _requantize_columns(self, stage):
        """Column col's K blocks marked ROUNDS_FLAG (the same for the warp's 32 columns), requantised where a value
        may round."""
        sB, sF, col, vals = self.sB, self.sF, self.col, self.out  # (no attributes inside the staged ifs)
        out = cute.recast_tensor(vals, cutlass.Int32)  # 16 words, the block's rows 2p (low), 2p + 1
        for blk in cutlass.range_constexpr(2):
            if (sF[(32 * blk, col // 32, stage)].to(cutlass.Int32) & ROUNDS_FLAG) != 0:
                for i in cutlass.range_constexpr(32):  # down the column: one bf16 a K row
                    vals[i] = sB[(col, 32 * blk + i, stage)]
                amax, amin = cutlass.Int32(0), cutlass.Int32(BF16_INF_PAIR)
                for p in cutlass.range_constexpr(16):
                    mag = out[p] & 0x7FFF7FFF
                    amax = _asm_b32(_MAX, amax, mag)
                    amin = _asm_b32(_MIN, amin, mag)
                down, up, rounds = _column_scale(amax, amin)
                if rounds:
                    for p in cutlass.range_constexpr(16):
                        out[p] = _asm_b32(_REQUANT_PAIR, out[p], down, up)
                    for i in cutlass.range_constexpr(32):
                        sB[(col, 32 * blk + i, stage)] = vals[i]
