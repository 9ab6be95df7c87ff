"""MX (OCP Microscaling) FP8 quantisation: E4M3 elements, one E8M0 scale per block.

A tensor is cut into blocks of ``block_size`` (32) consecutive values along one
axis (the GEMM's reduction dimension K). Each block gets one power-of-two scale
``2**e`` stored as an E8M0 byte ``e + 127`` (``e`` in [-127, 127]; byte 0xFF is
NaN), and each value is stored as ``float8_e4m3fn(x / 2**e)``, rounded to
nearest, ties to even. The dequantised value is ``float(data) * 2**e``.

Scale rule (``amax`` = largest magnitude in the block, taken exactly in fp32):

- ``"rceil"`` (default, as NVIDIA's RCEIL mode): ``e = ceil(log2(amax / 448))``
  computed exactly, i.e. the smallest integer with ``amax <= 448 * 2**e``. No
  element can exceed 448 after scaling, so nothing saturates. In bits: write
  ``amax = m * 2**p`` with ``m`` in [1, 2); then ``e = p - 8 + (m > 1.75)``.
  (An fp32 ``amax * (1/448)`` rounded up to a power of two differs when
  ``amax = 1.75 * 2**p`` exactly, because fl(1/448) > 1/448; kernels must use
  the exact rule above.)
- ``"floor"`` (OCP MX v1.0 reference): ``e = floor(log2(amax)) - 8`` (8 being
  the largest exponent of E4M3); scaled values up to 2**9 are clamped to +-448
  (saturating cast).

Edge cases, identical in both modes:

- ``e`` is clamped to [-127, 127]. An all-zero block, or one whose amax is so
  small that the rule gives ``e < -127`` (fp32 subnormals included), gets
  ``e = -127`` (byte 0x00); its values are scaled by 2**127 and rounded to
  E4M3 (subnormals of E4M3 included) as usual. For finite inputs of fp32 /
  bf16 / fp16 the rule never exceeds 127.
- A block containing NaN or +-Inf (E4M3 "fn" has no Inf) gets scale byte 0xFF
  (NaN) and all its data bytes are 0x7F (NaN); it dequantises to NaN.
- Negative zero stays negative zero.

Layout: ``MXFP8Tensor.data`` has the shape of the input; ``scale`` has that
shape with ``shape[axis]`` divided by ``block_size``. For a weight ``[N, K]``
or expert weights ``[E, N, K]``, ``axis=-1`` is row-wise quantisation (along K,
scale ``[..., N, K/32]``, the layout of compressed-tensors / ModelOpt
checkpoints) and ``axis=-2`` is column-wise (along N, scale ``[..., N/32, K]``,
what the transposed operand of a backward GEMM needs). A size along ``axis``
that is not a multiple of ``block_size`` raises ValueError (no padding).

``precision="mxfp8"`` (MoKMoELayer, reference path; details and rationale in
docs/mxfp8.md): every operand of the six expert GEMMs is fake-quantised
("rceil", blocks of 32) along that GEMM's reduction dimension, then the BF16
path's fp32 math runs on the dequantised values. Forward: ``x`` and
``gate_up_proj`` along H, ``h = act(gate_up)`` and ``down_proj`` along I.
Backward (``dy`` unscaled by the top-k weight ``w``): ``dh = dy @ down_proj`` with
``dy`` along H and ``down_proj`` along H (column-wise); ``d down_proj = dy^T @ (w h)``
and ``d gate_up_proj = dgu^T @ x`` with both operands along the expert's token
rows (blocks of 32 rows in ascending token order, last block zero-padded);
``dx = dgu @ gate_up_proj`` with ``dgu`` along 2I and ``gate_up_proj`` along 2I
(column-wise). Router, activation, biases, the top-k weight gradient and the
combine are not quantised.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.utils.weak

from . import triton_ops

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
SCALE_MODES = ("rceil", "floor")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MXFP8Tensor:
    """MXFP8 data (float8_e4m3fn, shape of the original) and E8M0 scale bytes (uint8)."""

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    block_size: int = 32

    def __post_init__(self):
        if self.data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"MXFP8Tensor.data must be float8_e4m3fn, got {self.data.dtype}")
        if self.scale.dtype != torch.uint8:
            raise TypeError(f"MXFP8Tensor.scale must be uint8 (E8M0 bits), got {self.scale.dtype}")
        if not 0 <= self.axis < self.data.dim():
            raise ValueError(f"MXFP8Tensor.axis must be in [0, {self.data.dim()}), got {self.axis}")
        expected = _scale_shape(self.data.shape, self.axis, self.block_size)
        if tuple(self.scale.shape) != expected:
            raise ValueError(
                f"MXFP8Tensor.scale has shape {tuple(self.scale.shape)}, expected {expected} "
                f"for data {tuple(self.data.shape)}, axis={self.axis}, block_size={self.block_size}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel()

    def to(self, device) -> "MXFP8Tensor":
        return MXFP8Tensor(self.data.to(device), self.scale.to(device), self.axis, self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self, dtype)


def _scale_shape(shape, axis: int, block_size: int) -> tuple:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if shape[axis] % block_size != 0:
        raise ValueError(
            f"size {shape[axis]} of dimension {axis} (shape {tuple(shape)}) is not a multiple "
            f"of the MX block size {block_size}; pad the tensor first"
        )
    out = list(shape)
    out[axis] = shape[axis] // block_size
    return tuple(out)


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a {ndim}-D tensor")
    return axis % ndim


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2**e for integer e in [-127, 127] (2**-127 is an fp32 subnormal)."""
    return torch.exp2(e.to(torch.float64)).to(torch.float32)


def quantize(
    x: torch.Tensor, axis: int = -1, block_size: int = 32, scale_mode: str = "rceil"
) -> MXFP8Tensor:
    """Quantise ``x`` (fp32 / bf16 / fp16) to MXFP8 in blocks along ``axis``. See the module doc."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"quantize supports float32, bfloat16 and float16 inputs, got {x.dtype}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if x.dim() == 0:
        raise ValueError("quantize needs a tensor with at least one dimension")
    axis = _normalize_axis(axis, x.dim())
    _scale_shape(x.shape, axis, block_size)
    if (block_size == 32 and scale_mode == "rceil" and triton_ops.quantize_runs_on(x, axis)
            and triton_ops.verified(("quantize", x.dtype), x.device, lambda: _quantize_both(x), exact=True)):
        return MXFP8Tensor(*triton_ops.quantize(x), axis, block_size)  # CUDA: one pass (below: about a dozen)
    return _quantize(x, axis, block_size, scale_mode)


def _quantize_both(x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(the Triton kernel's, the torch ops') quantize of x's first rows along the last dimension, as bytes: the
    first use check (triton_ops.verified) of the kernel."""
    rows = x.reshape(-1, x.shape[-1])[:8]
    got, want = triton_ops.quantize(rows), _quantize(rows, 1, 32, "rceil")
    return (got[0].view(torch.uint8), got[1]), (want.data.view(torch.uint8), want.scale)


def _quantize(x: torch.Tensor, axis: int, block_size: int, scale_mode: str) -> MXFP8Tensor:
    """quantize in torch ops (axis normalised, shapes checked)."""
    moved = x.movedim(axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // block_size, block_size).float()
    amax = blocks.abs().amax(dim=-1)  # NaN propagates
    nonfinite = ~torch.isfinite(amax)

    # amax = mant * 2**exp with mant in [0.5, 1): floor(log2(amax)) = exp - 1.
    mant, exp = torch.frexp(amax)
    e = exp - 9
    if scale_mode == "rceil":
        e = e + (mant > 0.875).to(e.dtype)  # amax > 1.75 * 2**floor(log2 amax): one more
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e)
    e = torch.where(nonfinite, torch.zeros_like(e), e).clamp(-E8M0_BIAS, E8M0_BIAS)

    scaled = blocks * _pow2(-e).unsqueeze(-1)
    if scale_mode == "floor":
        scaled = scaled.clamp(-E4M3_MAX, E4M3_MAX)
    data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(nonfinite.unsqueeze(-1), torch.full_like(data, E4M3_NAN), data)
    scale = torch.where(nonfinite, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)

    data = data.reshape(moved.shape).movedim(-1, axis).contiguous().view(torch.float8_e4m3fn)
    scale = scale.movedim(-1, axis).contiguous()
    return MXFP8Tensor(data, scale, axis, block_size)


def quantize_experts(w: torch.Tensor, scale_mode: str = "rceil") -> MXFP8Tensor:
    """quantize(w, axis=-1) of expert weights w [E, N, K], one expert at a time: the transient fp32 copies of
    quantize are one expert's (along K the experts are independent, so the bits are those of quantising w at
    once). A meta tensor gives empty data and scales of the right shapes."""
    data = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(*w.shape[:-1], w.shape[-1] // 32, dtype=torch.uint8, device=w.device)
    if not w.is_meta:
        for e in range(w.shape[0]):
            q = quantize(w[e], axis=-1, block_size=32, scale_mode=scale_mode)
            data[e].copy_(q.data)
            scale[e].copy_(q.scale)
    return MXFP8Tensor(data, scale, w.dim() - 1)


def dequantize(t: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``float(data) * 2**(scale - 127)`` in ``dtype`` (NaN where the scale byte is 0xFF; a NaN's sign bit is
    unspecified)."""
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"dequantize expects an MXFP8Tensor, got {type(t).__name__}")
    if (t.block_size == 32 and triton_ops.dequantize_runs_on(t.data, t.axis, dtype)
            and triton_ops.verified(("dequantize", dtype), t.data.device, lambda: _dequantize_both(_rows(t, 8), dtype),
                                    exact=True)):
        return triton_ops.dequantize(t.data, t.scale, dtype)  # CUDA: one pass (below: about six)
    return _dequantize(t, dtype)


def _rows(t: MXFP8Tensor, n: int) -> MXFP8Tensor:
    """The first n rows of t's data and scales seen as [rows, K] (blocks along the last dimension)."""
    k = t.data.shape[-1]
    return MXFP8Tensor(t.data.reshape(-1, k)[:n], t.scale.reshape(-1, k // t.block_size)[:n], 1, t.block_size)


def _dequantize_both(t: MXFP8Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the Triton kernel's, the torch ops') dequantize of t: triton_ops.verified's pair."""
    return triton_ops.dequantize(t.data, t.scale, dtype), _dequantize(t, dtype)


def _dequantize(t: MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize in torch ops."""
    data = t.data.movedim(t.axis, -1)
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // t.block_size, t.block_size)
    s = t.scale.movedim(t.axis, -1).to(torch.int32)
    factor = _pow2((s - E8M0_BIAS).clamp(max=E8M0_BIAS))
    factor = torch.where(s == E8M0_NAN, torch.full_like(factor, float("nan")), factor)
    if dtype == torch.bfloat16:
        # E4M3 values and 2**e (e >= -127, NaN) are bf16 values, and a bf16 product is the fp32 product rounded
        # once to bf16: the fp32 route's bits, with a third of its memory traffic (the expert weights of an
        # MXFP8-only layer are dequantised every forward and backward); in chunks along dim 0 into the result,
        # so the transient bf16 copy of the data is a chunk's, not a second copy of the whole
        factor = factor.to(torch.bfloat16).unsqueeze(-1)
        out = torch.empty(blocks.shape, dtype=torch.bfloat16, device=blocks.device)
        for a, b in row_chunks(blocks.shape[0], 2 * blocks[:1].numel(), blocks.device):  # (blocks: 2-D at least)
            torch.mul(blocks[a:b].to(torch.bfloat16), factor[a:b], out=out[a:b])
        return out.reshape(data.shape).movedim(-1, t.axis).contiguous()
    # fp32 product is exact: 4 significant bits times a power of two.
    out = blocks.float() * factor.unsqueeze(-1)
    return out.reshape(data.shape).movedim(-1, t.axis).to(dtype).contiguous()


def fake_quantize(
    x: torch.Tensor, axis: int = -1, block_size: int = 32, scale_mode: str = "rceil"
) -> torch.Tensor:
    """``dequantize(quantize(x, ...))`` in ``x.dtype``: the values an MXFP8 GEMM operand takes. Near the top of
    ``x.dtype``'s range (fp16 >= 63488) an element rounded up to 448 * 2**e is inf in ``x.dtype``
    (docs/mxfp8.md)."""
    return dequantize(quantize(x, axis, block_size, scale_mode), x.dtype)


def fake_quantize_padded(
    x: torch.Tensor, axis: int = -1, block_size: int = 32, scale_mode: str = "rceil"
) -> torch.Tensor:
    """``fake_quantize`` of ``x`` zero-padded along ``axis`` to a multiple of ``block_size``.

    The padding is dropped again. Zeros do not change a block's amax, so this is the MX
    quantisation of a ragged group (an expert's token rows) whose last block is partial.
    """
    axis = _normalize_axis(axis, x.dim())
    pad = -x.shape[axis] % block_size
    if pad == 0:
        return fake_quantize(x, axis, block_size, scale_mode)
    shape = list(x.shape)
    shape[axis] = pad
    padded = torch.cat([x, x.new_zeros(shape)], dim=axis)
    return fake_quantize(padded, axis, block_size, scale_mode).narrow(axis, 0, x.shape[axis])


PRECISIONS = ("bf16", "mxfp8")


def operand_quantizer(precision: str):
    """``q(t, axis)`` applied to every expert-GEMM operand: identity for "bf16", MXFP8 fake
    quantisation (rceil, blocks of 32 along ``axis``, ragged groups zero-padded) for "mxfp8"."""
    if precision == "bf16":
        return lambda t, axis: t
    if precision == "mxfp8":
        return lambda t, axis: fake_quantize_padded(t, axis)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def chunk_bytes(device: torch.device) -> int:
    """Bytes of fp32 temporaries per chunk of the chunked elementwise passes (fake_quantize_fast, the portable
    backend's activation and sums): on CPU 1 MiB, so the passes stay in the L2 cache and no temporary is a fresh
    mapping (page faults) each call; elsewhere (GPUs) 256 MiB, a bound on the temporaries that keeps the
    launches few (1 MiB chunks there cost a launch per op per MiB: thousands a layer)."""
    return 1 << 20 if device.type == "cpu" else 1 << 28


def row_chunks(num_rows: int, row_bytes: int, device: torch.device) -> list[tuple[int, int]]:
    """Row ranges [a, b) whose temporaries take about chunk_bytes(device) each, row_bytes a row. Fixed by the sizes
    and the device type alone: the same chunks, the same bits, run after run."""
    step = max(1, chunk_bytes(device) // max(row_bytes, 1))
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


def fake_quantize_fast(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """``fake_quantize(x, axis)`` ("rceil", blocks of 32): the same values bit for bit, from fp32 arithmetic
    instead of frexp, float64 powers and float8 round trips (torch converts float8 to float unvectorised on CPU),
    without moving ``axis`` last (the blocks are a view of x, the scales broadcast over them: contiguous passes
    whatever the axis) and without masks or torch.where (slow on CPU); the portable backend applies it to every
    GEMM operand of precision="mxfp8". The size along ``axis`` must be a multiple of 32.

    Per block: e from amax's bits (quantize's rceil rule); |s| = |x| * 2**-e (one exact multiply, 2**-e a
    normal fp32, |s| <= 448); |s| rounded to E4M3 (ties to even) as (|s| + C) - C, C = 1.5 * 2**(max(E, -6) + 20)
    for |s|'s exponent E: C's fp32 spacing 2**(max(E, -6) - 3) is E4M3's grid there (3 mantissa bits, the
    subnormal spacing 2**-9 below 2**-6), the sum stays in C's binade and is rounded once, to even (C is an even
    multiple of the grid); x's sign bit put back (zeros keep theirs); then one multiply by 2**e (down to the
    subnormal 2**-127; NaN for a block holding NaN / inf), rounded once as dequantize's. On CUDA, where Triton is
    importable, the same steps run as one kernel (triton_ops)."""
    block = 32
    axis = _normalize_axis(axis, x.dim())
    if x.shape[axis] % block:
        raise ValueError(f"size {x.shape[axis]} of dimension {axis} is not a multiple of the MX block size {block}")
    if triton_ops.runs_on(x) and triton_ops.verified(
            ("fake_quantize", x.dtype, axis == x.dim() - 1), x.device,
            lambda: (triton_ops.fake_quantize(x[:64], axis), _fake_quantize_chunks(x[:64], axis)), exact=True):
        return triton_ops.fake_quantize(x, axis)  # CUDA: the same arithmetic as one kernel (below: ~15 passes)
    return _fake_quantize_chunks(x, axis)


def _fake_quantize_chunks(x: torch.Tensor, axis: int) -> torch.Tensor:
    """fake_quantize_fast in torch ops, a chunk of rows at a time (axis normalised)."""
    block = 32
    # chunks along dim 0 (whole blocks: units of 32 rows where axis is 0) of chunk_bytes(device) of fp32; blocks
    # are independent, so the values do not depend on the chunking
    unit = block if axis == 0 else 1
    chunks = row_chunks(x.shape[0] // unit, 4 * x[:1].numel() * unit, x.device) if x.dim() >= 2 else []
    if len(chunks) <= 1:
        return _fake_quantize_fast(x, axis, out=None)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for a, b in chunks:
        _fake_quantize_fast(x[a * unit:b * unit], axis, out=out[a * unit:b * unit])
    return out


def _fake_quantize_fast(x: torch.Tensor, axis: int, out: torch.Tensor | None) -> torch.Tensor:
    block = 32
    shape = x.shape
    xf = x.float().reshape(*shape[:axis], shape[axis] // block, block, *shape[axis + 1:])
    xbits = xf.view(torch.int32)
    sign = xbits & -(2**31)
    # |x| as bits with the sign cleared (in place where xf is our fp32 copy)
    mag = (xbits.bitwise_xor_(sign) if x.dtype != torch.float32 else xbits ^ sign).view(torch.float32)
    amax = mag.amax(dim=axis + 1, keepdim=True)
    bits = amax.view(torch.int32)
    biased = (bits >> 23) & 0xFF  # 255 for inf / NaN
    # e = floor(log2 amax) - 8, one more where the significand exceeds 1.75 (quantize's rceil rule); zero and
    # subnormal amax (biased exponent 0) give e < -127, clamped to -127. e <= 121 (amax < 2**128).
    e = biased - (E8M0_BIAS + 8) + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = torch.where(biased == 0, torch.full_like(e, -E8M0_BIAS), e).clamp_(-E8M0_BIAS, E8M0_BIAS)
    down = ((E8M0_BIAS - e) << 23).view(torch.float32)  # 2**-e
    up = torch.where(e == -E8M0_BIAS, torch.full_like(e, 1 << 22), (e + E8M0_BIAS) << 23).view(torch.float32)
    up = torch.where(biased == 255, torch.full_like(up, float("nan")), up)
    mag.mul_(down)  # |s|
    # C's bits: biased exponent max(E, -6) + 127 + 20, significand 1.5 (garbage for inf / NaN: those blocks are NaN)
    c = (mag.view(torch.int32) & 0x7F800000).clamp_(min=(E8M0_BIAS - 6) << 23).add_((20 << 23) | (1 << 22))
    c = c.view(torch.float32)
    rounded = mag.add_(c).sub_(c)  # |s| on the E4M3 grid, >= +0
    res = rounded.view(torch.int32).bitwise_or_(sign).view(torch.float32).mul_(up)  # x's sign put back
    return res.view(shape).to(x.dtype) if out is None else out.copy_(res.view(shape))


# --------------------------------------------------------------------------
# MXFP8 values of the expert weights, kept while they are reused
#
# Every backend of precision="mxfp8" quantises each expert weight along H for the forward GEMMs and along 2I / H
# for the backward's d x and d h' GEMMs. The values depend on the weight's values only, so they are kept:
#
# - for a weight that does not require grad (frozen experts, evaluation, W_q of MXFP8-only weights): per tensor
#   (weakly: an entry goes with its tensor) and axis, with the state they were computed from: the tensor's
#   version counter (bumped by every in-place update through the tensor or any view of it: copy_ / add_ under
#   no_grad, load_state_dict), its data pointer, shape, strides, dtype and device. Any change recomputes them.
#   At most one copy per weight and axis: once more the weights' memory in their dtype, per axis used.
# - for a trained weight: only inside a weight_scope() (MoKFunction opens one around a forward's macrobatch
#   passes, and one around a backward's, where there are several: autograd.weight_scope_for), dropped at its
#   end. Otherwise each value is made for its GEMM and freed after it: one pass asks for each once, and a scope
#   would hold a copy of the expert weights to the end of the pass (at the backward's peak). Keeping them
#   longer would hold two more copies of every trained weight for values an optimizer step makes stale.
#
# Cached or not, the values are those of fake_quantize_fast: the same bits. Writes that bypass the version
# counter (through `.data` or another alias of the storage with its own counter) are not seen: call
# clear_weight_cache() after them.

_MX_WEIGHTS = torch.utils.weak.WeakIdKeyDictionary()
_SCOPE = threading.local()  # .values inside a weight_scope (per thread): {id(w): {axis: (state, values)}}


def clear_weight_cache() -> int:
    """Forget every cached MXFP8 weight; returns how many weight tensors had entries."""
    n = len(_MX_WEIGHTS)
    _MX_WEIGHTS.clear()
    return n


@contextlib.contextmanager
def weight_scope():
    """Inside it, trained weights' MXFP8 values are kept too (computed once for the passes of a forward or a
    backward), and dropped at its end; nested scopes share the outermost one; each thread has its own."""
    outer = getattr(_SCOPE, "values", None) is not None
    if not outer:
        _SCOPE.values = {}
    try:
        yield
    finally:
        if not outer:
            _SCOPE.values = None


def weight_state(w: torch.Tensor):
    """What the cached values of w were computed from, or None where w cannot be cached (no version counter:
    inference tensors; tracing)."""
    if torch.compiler.is_compiling() or w.is_inference():
        return None
    return w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device


def mark_values(w: torch.Tensor, axis: int) -> None:
    """Record that w (a weight that does not require grad) holds MXFP8 values along axis already (W_q of
    MXFP8-only weights along their storage axis): weight_values(w, axis) then returns w itself while w is
    unchanged, with no pass over it (requantising MXFP8 values along their own axis gives them back, in bf16 /
    fp32; except blocks whose values overflowed to inf, from scale bytes >= 248, which requantising would make
    NaN)."""
    state = weight_state(w)
    if state is not None and not w.requires_grad:
        _MX_WEIGHTS.setdefault(w, {})[axis] = (state, None)  # None: w itself (a reference would keep w alive)


def weight_values(w: torch.Tensor, axis: int, quantize=None) -> torch.Tensor:
    """fake_quantize_fast(w, axis), kept while w is unchanged and reused (see above). quantize(w, axis): what
    computes it on a miss (a backend's kernel giving the same bits; default fake_quantize_fast)."""
    quantize = quantize or fake_quantize_fast
    state = weight_state(w)
    scoped = getattr(_SCOPE, "values", None)
    if state is None or (w.requires_grad and scoped is None):
        return quantize(w.detach(), axis)
    entries = scoped.setdefault(id(w), {}) if w.requires_grad else _MX_WEIGHTS.setdefault(w, {})
    hit = entries.get(axis)
    if hit is not None and hit[0] == state:
        return w if hit[1] is None else hit[1]
    entries.pop(axis, None)  # the stale copy goes before the new one is made
    q = quantize(w.detach(), axis)
    entries[axis] = (state, q)
    return q
