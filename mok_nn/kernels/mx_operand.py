"""E4M3 bytes of MXFP8 weights made bf16 inside the GEMMs that read them (mx_swapped.py: each thread's wgmma A
fragment, in registers): the recipe, and the steps that requantise W_q along K for precision="mxfp8"'s dgrad GEMMs
on MXFP8-only weights. An E4M3 value times a power of two is a bf16 value, so a GEMM on the converted values is
bitwise the bf16 GEMM of dequantize(W) (mxfp8.dequantize), with no dequantised copy of the weights in global
memory.

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
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SINGLE_MAX = 134  # scale bytes up to this take one multiply (2**(S - 7) is a normal bf16 up to 2**127)


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
# W_q requantised along K: precision="mxfp8"'s dgrad on MXFP8-only weights
#
# The dgrad GEMMs (d h = d y @ W2, d x = d gate_up @ W13) reduce over W[e]'s stored rows (K) and output its stored
# blocks' axis (N), and precision="mxfp8" wants W_q's MXFP8 values along K (column-wise, docs/mxfp8.md): a second
# quantisation of W_q. mx_swapped.SwappedMxColumnGemm gets a table of row factors with the bytes; per 32-row block
# of a column:
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
# (most blocks of real weights) keeps out = v. So the kernel makes v everywhere, and the rest only in the 32 x 32
# blocks that the caller marks by ROUNDS_FLAG in their rows' factors (cuda_mx.column_marks).

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
