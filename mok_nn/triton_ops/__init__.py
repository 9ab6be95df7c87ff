"""Memory-bound steps as Triton kernels, on CUDA tensors where Triton is importable (it ships with PyTorch's CUDA
builds): the portable backend's activation and MXFP8 quantisation, the MXFP8 dequantisation of every backend and
the router's selection; everywhere else the torch ops run. In torch ops each of these steps is several to a dozen
or more elementwise passes, over fp32 copies; here it is one read of the inputs and one write of the outputs.

  fake_quantize       mxfp8.fake_quantize_fast's values, the same bits. The tensor is seen as [outer, L, inner],
                      blocks of 32 along L; a program takes 64 blocks, consecutive along inner (or along L where
                      inner is 1): coalesced loads either way. A tile whose blocks all have a scale exponent
                      e >= -116 (real data) takes fp32 arithmetic, exact there, its rounding to E4M3 by the GPU's
                      conversion where there is one (hw_e4m3); a tile holding a block of tiny nonzero values takes
                      integer bit operations wherever a value may be subnormal.
  quantize            mxfp8.quantize of blocks along the last dimension (MXFP8 weights: the explicit call, and a
                      trained layer's forward weights with precision="mxfp8" on the fused path): the same bytes in
                      one read of x and one write of the bytes, the E4M3 rounding as fake_quantize's
  dequantize          mxfp8.dequantize of blocks along the last dimension (MXFP8-only expert weights, every call):
                      the E4M3 bits and the scale combined into fp32 bits by integer operations, rounded once:
                      the same bits, one read of the bytes and one write (the torch ops: about six passes).
  mx_row_factors      the row factors of MXFP8-only weights' dgrad kernels (cuda_mx.MxColumnWeight): each scale
                      byte as a bf16 power of two, transposed, in one pass
  transposed          [E, R, C] -> [E, C, R] in one pass (the MXFP8 weights' scale pairs, cuda_mx.scale_pairs)
  requantize_rows     fake_quantize along the rows of dequantize's values, from the MXFP8 bytes in one pass (the
                      column-wise MXFP8 weights of the backward with MXFP8-only experts and precision="mxfp8");
                      with hw_e4m3 the dequantisation and the rounding both by the conversion
  activation_forward  h = act(gate, up) for gate_up [n, 2I]
  mlp_backward_rows   one row per program: dw = sum_i dh'_i h_i (the top-k weight's gradient), w h (d W2's
                      operand, optional) and d gate_up = act'(gate, up) applied to w dh'
  topk_indices        the router's selection (router.stable_topk_indices): per row, k rounds of the largest
                      order-preserving integer key, ties to the lowest column; the same ids as the stable sort
                      (a sort of every row, several passes) in one read of the scores
  route               router.route without expert groups as one kernel each way: scores, selection (as
                      topk_indices), weights, renormalisation and scaling forward (the torch ops: about eight
                      kernels); d logits from d weights and d scores backward
  router_forward      the router's fp32 logits of 16-bit x and weight on the tensor cores and route's forward of
                      them in one kernel (router.route_tokens, up to ROUTER_MAX_COLS experts)

The bit-exact kernels (fake_quantize, quantize, dequantize, topk_indices) use no float arithmetic on values below
fp32's normal range, which the compiled code may flush to zero, except where such a value's result is 0 either way
(the quantisers' float forms): powers of two scale the exponent bits, bf16 rounds by integer operations. The
activation and routing kernels compute the torch ops' formulas in fp32 (a score below the normal range may come out
as zero), not their bits: Triton's exp and fused multiply-adds round otherwise (deterministic run to run). act:
"swiglu" silu(g) u, "swiglu_oai" (u + 1) g sigmoid(alpha g); with a limit g is clamped above at it and u to [-limit,
limit], and the gradient does not pass a clamped element.

Launches go through _Launcher: a form launched before runs its compiled kernel without Triton's Python launcher,
whose host time the GPU would wait for at the start of a layer's forward.

Each kernel form (kernel, dtype, options) is checked on its first use in a process against the torch ops it
replaces, on a few rows of the real inputs (`verified`: the same bits for fake_quantize, quantize, dequantize and
topk_indices, fp32 / storage rounding for the activation and the routing): one synchronisation, once (so not
inside a CUDA graph capture: run a call before capturing). A form that fails to compile or disagrees is not used
again in the process; a warning says which and why, and the torch ops run in its place.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

MX_BLOCK = 32
MX_ROWS = 64  # MXFP8 blocks per program
MX_ROWS_WARPS = 2  # warps of a fake_quantize_rows program (blocks along the rows; measured: 4 and 8 are slower)
# (MXFP8 blocks, warps) of a dequantize program; (columns, warps) of a requantize_rows program, whose row block is
# MX_BLOCK rows: every form writes the same bits; the fastest on one H100 (benchmarks/mx_kernel_forms.py,
# docs/benchmarks/2026-12-05_h100_mx_kernel_forms.jsonl): dequantize 2.33 TB/s at (64, 8) against 2.00 at (64, 4);
# requantize_rows 0.88 TB/s at (64, 2) before its bound check (kernels.requantize_rows_kernel: with it the frozen
# MXFP8-only backward at deepseek-v3 took 42.6 ms against 54.8), its one-warp forms the slowest (0.37 TB/s at
# (128, 1): 253 registers a thread)
DEQUANTIZE_FORM = (MX_ROWS, 8)
REQUANTIZE_FORM = (64, 2)
ACT_BLOCK = 1024  # columns of a row per step of the activation kernels
TOPK_MAX_COLS = 4096  # topk_indices holds a whole row in registers: up to this many experts
TOPK_ELEMENTS = 4096  # scores per topk_indices program (rows of a power-of-two width)


@functools.cache
def available() -> bool:
    """Whether Triton is installed here (not imported until a kernel runs)."""
    return importlib.util.find_spec("triton") is not None


def runs_on(t: torch.Tensor) -> bool:
    """The kernels run on t: a CUDA tensor in bf16 / fp16 / fp32, where Triton is installed."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16, torch.float32) and available()


_VERDICTS: dict = {}  # (form, device) -> whether the kernel form agreed with the torch ops on its first use


def verified(form: tuple, device: torch.device, pair, exact: bool) -> bool:
    """Whether the kernel form may run: on its first use (per device) pair() gives (the kernel's result, the torch
    ops' result) on a few rows, each a tensor or a tuple of tensors, which must agree: bit for bit (exact; NaN
    where NaN) or within the storage dtype's rounding (relative L2 below 1e-2 in 16-bit, 1e-5 in fp32)."""
    key = (form, str(device))
    if key not in _VERDICTS:
        try:
            got, want = pair()
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            bad = [i for i, (a, b) in enumerate(zip(got, want)) if not _agree(a, b, exact)]
            why = f"results {bad} disagree with the torch ops" if bad else None
        except Exception as err:  # noqa: BLE001 - a kernel that cannot compile or launch here is not used
            why = f"{type(err).__name__}: {err}"
        if why is not None:
            warnings.warn(f"mok_nn: the Triton kernel form {form} is not used on {device} ({why}); the torch ops run "
                          "instead", RuntimeWarning, stacklevel=3)
        _VERDICTS[key] = why is None
    return _VERDICTS[key]


def _agree(a: torch.Tensor | None, b: torch.Tensor | None, exact: bool) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a[~a.isnan()], b[~b.isnan()]
    if exact:
        return torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
    tol = 1e-5 if b.dtype == torch.float32 else 1e-2
    return bool(((a.double() - b.double()).norm() <= tol * b.double().norm()).item())


def dequantize_runs_on(data: torch.Tensor, axis: int, dtype: torch.dtype) -> bool:
    """dequantize runs on E4M3 data blocked along axis, into dtype: CUDA data blocked along its last dimension,
    into bf16 / fp16 / fp32, where Triton is installed."""
    return (data.is_cuda and axis in (-1, data.dim() - 1) and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and available())


@functools.cache
def _kernels():
    """mok_nn.triton_ops.kernels with each kernel behind a _Launcher."""
    from . import kernels

    return type("Kernels", (), {n: _Launcher(getattr(kernels, n)) for n in dir(kernels) if n.endswith("_kernel")})


# Triton's compile options, given beside a kernel's arguments: part of a form, not arguments
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})


class _Launcher:
    """A Triton kernel, launched as kernel[grid](*args, **meta) like the kernel itself; a form seen before runs its
    compiled kernel without Triton's Python launcher, whose own host time (keys, options, hooks: about 40-70 us a
    launch on an H200 host, inside a layer's forward) the GPU waits for where nothing else is queued.

    A form is what Triton specialises a launch on, kept finer here: each tensor's dtype, device and 16-byte
    alignment, each integer's i32 range, value 1 and divisibility by 16, bools, the meta-parameters. A new form
    goes through Triton (compiling it once), as does every launch while a launch hook is set (profilers) and under
    the interpreter. fast_launches counts the launches that took the compiled kernel directly."""

    def __init__(self, fn):
        from triton.runtime.jit import JITFunction

        self.fn = fn
        self.compiled: dict = {}
        self.fast = isinstance(fn, JITFunction)  # (not the interpreter's InterpretedFunction)
        self.fast_launches = 0

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args, meta):
        key = _form(args, meta) if self.fast else None
        hit = self.compiled.get(key) if key is not None else None
        if hit is not None and not _launch_hooks():
            kernel, names = hit
            g = tuple(grid) + (1,) * (3 - len(grid))
            try:  # (CompiledKernel.run: Triton's launcher of a compiled kernel, as JITFunction.run calls it)
                kernel.run(*g, current_stream(), kernel.function, kernel.packed_metadata, None, None, None, *args,
                           *[meta[n] for n in names])
                self.fast_launches += 1
                return
            except TypeError:  # another Triton's launcher signature: its own path from now on (nothing launched)
                self.fast = False
        kernel = self.fn[grid](*args, **meta)
        names = self.fn.arg_names[len(args):]
        if key is not None and kernel is not None and set(names) == set(meta) - _LAUNCH_OPTIONS:
            self.compiled[key] = (kernel, names)


def _form(args, meta):
    """The launch's form (_Launcher), or None for an argument of another kind (Triton's own path then)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            out.append(a)
        elif isinstance(a, int):
            out.append((-2**31 <= a < 2**31, a == 1, a % 16 == 0))
        elif isinstance(a, float):
            out.append(float)
        else:
            return None
    return tuple(out), tuple(sorted(meta.items()))


def _launch_hooks() -> bool:
    """Whether a launch hook is set (a profiler's): Triton's own launcher then calls it."""
    hooks = (_runtime_knobs().launch_enter_hook, _runtime_knobs().launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)  # (an empty HookChain calls nothing)


@functools.cache
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


# torch.cuda.current_stream().cuda_stream without building a torch.cuda.Stream (~5 us a call)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_stream() -> int:
    """cudaStream_t of the current stream of the current device: what Triton launches on, and the CUDA backend's
    kernels (cuda_backend._stream)."""
    if _raw_stream is None or _get_device is None or not torch.cuda.is_initialized():
        return torch.cuda.current_stream().cuda_stream  # CPU builds; CUDA not initialised yet
    return _raw_stream(_get_device())


@functools.cache
def hw_e4m3(device: torch.device) -> bool:
    """The fake_quantize kernels round by the GPU's E4M3 conversion (NVIDIA sm_89 and later: about 8 SASS
    instructions an element on the float branch against 12 for the arithmetic rounding, the same bits); elsewhere
    (ROCm included), and under Triton's interpreter, by arithmetic."""
    return (device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fake_quantize(x: torch.Tensor, axis: int) -> torch.Tensor:
    """mxfp8.fake_quantize_fast(x, axis) ("rceil", blocks of 32 along axis, normalised, its size a multiple of
    32), bit for bit: a new contiguous tensor in x's dtype and shape."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    axis %= x.dim()
    inner = 1
    for d in x.shape[axis + 1:]:
        inner *= d
    if inner > 1:  # blocks along the rows of x viewed as [x.numel() / inner, inner]: rows r * 32 ..
        _launch_rows(x.view(-1, inner), out.view(-1, inner), x, x, x.numel() // inner // MX_BLOCK, segments=False)
        return out
    n_blocks = x.numel() // MX_BLOCK
    _kernels().fake_quantize_kernel[(-(-n_blocks // MX_ROWS),)](x, out, n_blocks, IN_BF16=x.dtype == torch.bfloat16,
                                                                 HW_E4M3=hw_e4m3(x.device), ROWS=MX_ROWS,
                                                                 BLOCK=MX_BLOCK)
    return out


def quantize_runs_on(x: torch.Tensor, axis: int) -> bool:
    """quantize runs on x blocked along axis: a CUDA bf16 / fp16 / fp32 tensor blocked along its last dimension
    (a multiple of 32), where Triton is installed."""
    return (x.is_cuda and x.dim() > 0 and axis in (-1, x.dim() - 1) and x.shape[-1] % MX_BLOCK == 0
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and available())


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp8.quantize(x, -1) ("rceil", blocks of 32 along the last dimension) bit for bit, in one read of x: (the
    E4M3 bytes [..., K] as float8_e4m3fn, the E8M0 scale bytes [..., K / 32] uint8)."""
    x = x.contiguous()
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*x.shape[:-1], x.shape[-1] // MX_BLOCK, dtype=torch.uint8, device=x.device)
    n_blocks = scale.numel()
    if n_blocks:
        _kernels().quantize_kernel[(-(-n_blocks // MX_ROWS),)](x, data, scale, n_blocks,
                                                               IN_BF16=x.dtype == torch.bfloat16,
                                                               HW_E4M3=hw_e4m3(x.device), ROWS=MX_ROWS, BLOCK=MX_BLOCK)
    return data.view(torch.float8_e4m3fn), scale


def fake_quantize_rows(x: torch.Tensor, row0: torch.Tensor, nrows: torch.Tensor) -> torch.Tensor:
    """The MXFP8 values ("rceil") of x [N, C] in blocks of 32 rows given as row blocks: block r is rows row0[r] ..
    row0[r] + nrows[r] - 1 (int64; nrows at most 32, 0 for a block that holds none), the rows it lacks taken as
    zeros; every row in exactly one block. The bits of fake_quantize(axis 0) on a copy of x with each block padded
    to 32 rows by zeros (torch_backend.Groups.quantize_rows): a new tensor in x's dtype and shape."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() and row0.numel():
        _launch_rows(x, out, row0, nrows, row0.numel(), segments=True)
    return out


def _launch_rows(x, out, row0, nrows, blocks: int, segments: bool):
    """fake_quantize_rows_kernel over `blocks` row blocks of x [N, C] into out: a program per block and MX_ROWS
    columns."""
    cols = x.shape[1]
    _kernels().fake_quantize_rows_kernel[(blocks * -(-cols // MX_ROWS),)](
        x, out, row0, nrows, cols, IN_BF16=x.dtype == torch.bfloat16, HW_E4M3=hw_e4m3(x.device), ROWS=MX_ROWS,
        BLOCK=MX_BLOCK, SEGMENTS=segments,
        num_warps=MX_ROWS_WARPS)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mxfp8.dequantize of E4M3 data [..., K] and E8M0 scales [..., K / 32] (blocks of 32 along the last dimension)
    in dtype, bit for bit: a new contiguous tensor."""
    data, scale = data.contiguous(), scale.contiguous()
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    n_blocks = data.numel() // MX_BLOCK
    if n_blocks:
        blocks, warps = DEQUANTIZE_FORM
        _kernels().dequantize_kernel[(-(-n_blocks // blocks),)](data.view(torch.uint8), scale, out, n_blocks,
                                                                ROWS=blocks, BLOCK=MX_BLOCK, num_warps=warps)
    return out


def requantize_runs_on(data: torch.Tensor, dtype: torch.dtype) -> bool:
    """requantize_rows runs on E4M3 data [..., N, K] into dtype: CUDA, bf16 / fp32, N and K multiples of 32, where
    Triton is installed."""
    return (data.is_cuda and dtype in (torch.bfloat16, torch.float32) and data.dim() >= 2
            and data.shape[-2] % MX_BLOCK == 0 and data.shape[-1] % MX_BLOCK == 0 and available())


def requantize_rows(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mxfp8.fake_quantize_fast(mxfp8.dequantize(data, scale, dtype), -2) of E4M3 data [..., N, K] with E8M0 scales
    [..., N, K / 32] (blocks along K), bit for bit: the MXFP8 values along N (blocks of 32 rows) of the stored
    values, in one kernel (one read of the bytes and one write of dtype, no dequantised copy)."""
    data, scale = data.contiguous(), scale.contiguous()
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    cols = data.shape[-1]
    row_blocks = data.numel() // cols // MX_BLOCK
    if row_blocks:
        tile_cols, warps = REQUANTIZE_FORM
        _kernels().requantize_rows_kernel[(row_blocks * -(-cols // tile_cols),)](
            data.view(torch.uint8), scale, out, cols, ROUND_BF16=dtype == torch.bfloat16, HW_E4M3=hw_e4m3(data.device),
            ROWS=tile_cols, BLOCK=MX_BLOCK, num_warps=warps)
    return out


MX_FACTORS_TILE = 64


def transposed(x: torch.Tensor) -> torch.Tensor:
    """x [E, R, C] -> [E, C, R] (contiguous) in one pass, a tile of MX_FACTORS_TILE x MX_FACTORS_TILE a program:
    cuda_mx.scale_pairs' 16-bit words, which torch's copy moves at a fraction of the bandwidth (a permuted copy of
    bytes: 1.2 ms a training step of deepseek-v3's weights on an H100)."""
    x = x.contiguous()
    e, rows, cols = x.shape
    out = torch.empty(e, cols, rows, dtype=x.dtype, device=x.device)
    if out.numel():
        t = MX_FACTORS_TILE
        _kernels().transpose_kernel[(e, -(-rows // t), -(-cols // t))](x, out, x, rows, cols, FACTORS=False, BIAS=0,
                                                                      MARKS=False, TILE=t)
    return out


def mx_row_factors(scale: torch.Tensor, bias: int, marks: torch.Tensor | None = None) -> torch.Tensor:
    """E8M0 scales [E, R, B] (bytes at most 134) -> [E, B, R] int16, (S + bias) << 7 in one pass: the row factors
    cuda_mx.MxColumnWeight gives the dgrad kernels (bias 120: the bf16 bits of 2**(S - 7)); with marks [E, R / 32,
    B] int16, factor [e, b, r] or'ed with marks[e, r // 32, b]."""
    scale = scale.contiguous()
    e, rows, blocks = scale.shape
    out = torch.empty(e, blocks, rows, dtype=torch.int16, device=scale.device)
    if marks is not None:
        if rows % 32 or marks.shape != (e, rows // 32, blocks) or marks.dtype != torch.int16:
            raise ValueError(f"marks must be int16 [{e}, {rows} / 32, {blocks}], got {marks.dtype} {list(marks.shape)}")
        marks = marks.contiguous()
    if out.numel():
        t = MX_FACTORS_TILE
        _kernels().transpose_kernel[(e, -(-rows // t), -(-blocks // t))](
            scale, out, scale if marks is None else marks, rows, blocks, FACTORS=True, BIAS=bias,
            MARKS=marks is not None, TILE=t)
    return out


def _activation_options(activation: str, swiglu_limit) -> dict:
    from .. import reference

    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    return dict(limit=0.0 if swiglu_limit is None else float(swiglu_limit), HAS_LIMIT=swiglu_limit is not None,
                OAI=activation == "swiglu_oai", ALPHA=reference.OAI_ALPHA)


def activation_forward(gate_up: torch.Tensor, activation: str, swiglu_limit) -> torch.Tensor:
    """h [n, I] in gate_up's dtype from gate_up [n, 2I]."""
    gate_up = gate_up.contiguous()
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        opts = _activation_options(activation, swiglu_limit)
        _kernels().activation_forward_kernel[(n,)](gate_up, h, inter, opts.pop("limit"), **opts, BLOCK=ACT_BLOCK)
    return h


def mlp_backward_rows(gate_up, dh_raw, row_weights, activation: str, swiglu_limit, write_wh: bool, dgu_out=None):
    """(dw [n] fp32, w h [n, I] or None, d gate_up [n, 2I]) of the rows (the last two in gate_up's dtype): dw =
    sum_i dh'_i h_i and d gate_up = act'(gate_up) applied to w dh'; dh' [n, I], row_weights (w) [n]. h is made
    again from gate_up, the bits of activation_forward's (the forward need not keep it). dgu_out: a contiguous
    [n, 2I] tensor d gate_up goes into, gate_up itself included (each program reads its row's values before it
    writes them)."""
    gate_up, dh_raw = gate_up.contiguous(), dh_raw.contiguous()
    n, inter = dh_raw.shape
    dw = torch.empty(n, dtype=torch.float32, device=gate_up.device)
    wh = torch.empty_like(dh_raw, dtype=gate_up.dtype) if write_wh else None
    dgu = torch.empty_like(gate_up) if dgu_out is None else dgu_out
    if dgu.shape != gate_up.shape or dgu.dtype != gate_up.dtype or not dgu.is_contiguous():
        raise ValueError(f"mlp_backward_rows: dgu_out must be a contiguous {tuple(gate_up.shape)} {gate_up.dtype}")
    if n:
        opts = _activation_options(activation, swiglu_limit)
        _kernels().mlp_backward_rows_kernel[(n,)](
            gate_up, dh_raw, row_weights.float().contiguous(), dw, wh if write_wh else dgu, dgu, inter,
            opts.pop("limit"), **opts, WRITE_WH=write_wh, BLOCK=ACT_BLOCK)
    return dw, wh, dgu


def topk_runs_on(values: torch.Tensor, k: int) -> bool:
    """topk_indices runs on values [T, E]: CUDA, 2-D, E <= TOPK_MAX_COLS, 1 <= k <= E, where Triton is installed."""
    return (runs_on(values) and values.dim() == 2 and 0 < k <= values.shape[1] <= TOPK_MAX_COLS)


def topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64: per row the columns of the k largest values, largest first, ties to the lower column (-0
    equals +0, NaN above everything, NaNs equal): router.topk_by_sort's ids."""
    values = values.contiguous()
    rows, cols = values.shape
    ids = torch.empty(rows, k, dtype=torch.int64, device=values.device)
    if rows:
        grid, meta = _row_launch(rows, cols, k)
        _kernels().topk_kernel[grid](values, ids, rows, cols, **meta)
    return ids


def _row_launch(rows: int, cols: int, k: int):
    """(grid, meta-parameters) of the kernels that hold whole rows of [rows, cols] (topk_kernel, the routing
    kernels): TOPK_ELEMENTS values a program, rows padded to a power-of-two width."""
    import triton

    block = triton.next_power_of_2(cols)
    per = max(1, TOPK_ELEMENTS // block)
    return (-(-rows // per),), dict(K=k, ROWS=per, BLOCK=block)


def route_runs_on(logits: torch.Tensor, top_k: int, n_group) -> bool:
    """route runs on logits [T, E]: fp32 on CUDA, no expert groups, E <= TOPK_MAX_COLS, where Triton is installed."""
    return logits.dtype == torch.float32 and (n_group or 1) == 1 and topk_runs_on(logits, top_k)


def route(logits: torch.Tensor, top_k: int, score_func: str, norm_topk_prob: bool, routed_scaling_factor: float,
          bias: torch.Tensor | None):
    """(topk_ids int64 [T, k], topk_weights fp32 [T, k], scores fp32 [T, E]) of router.route without expert groups;
    the weights and the scores differentiable with respect to the logits."""
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    bias = None if bias is None else bias.float().contiguous()
    return _Route.apply(logits, bias, top_k, score_func == "softmax", bool(norm_topk_prob), float(routed_scaling_factor))


def _route_launch(rows: int, cols: int, k: int):
    """_row_launch's, and KP: k padded to a power of two (the routing kernels' [rows, k] tiles)."""
    import triton

    grid, meta = _row_launch(rows, cols, k)
    return grid, dict(meta, KP=triton.next_power_of_2(k))


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, k, softmax, norm, scale):
        logits = logits.contiguous()
        rows, cols = logits.shape
        ids, weights, scores = _route_outputs(rows, cols, k, logits.device)
        if rows:
            grid, meta = _route_launch(rows, cols, k)
            _kernels().route_forward_kernel[grid](logits, logits if bias is None else bias, ids, weights, scores,
                                                  rows, cols, scale, SOFTMAX=softmax, HAS_BIAS=bias is not None,
                                                  NORM=norm, **meta)
        ctx.save_for_backward(scores, ids)
        ctx.opts = (k, softmax, norm, scale)
        ctx.mark_non_differentiable(ids)
        ctx.set_materialize_grads(False)  # (scores unused without aux losses: None, not a tensor of zeros)
        return ids, weights, scores

    @staticmethod
    def backward(ctx, _d_ids, d_weights, d_scores):
        scores, ids = ctx.saved_tensors
        return route_backward(scores, ids, d_weights, d_scores, *ctx.opts)[0], None, None, None, None, None


def _route_outputs(rows: int, cols: int, k: int, device):
    """(ids int64 [rows, k], weights fp32 [rows, k], scores fp32 [rows, cols]), uninitialised."""
    return (torch.empty(rows, k, dtype=torch.int64, device=device),
            torch.empty(rows, k, dtype=torch.float32, device=device),
            torch.empty(rows, cols, dtype=torch.float32, device=device))


def route_backward(scores, ids, d_weights, d_scores, k: int, softmax: bool, norm: bool, scale: float,
                   d_logits_in=None, parts: bool = False):
    """(d logits [T, E] fp32, parts) of route's (and router_forward's) routing from d weights and d scores (either
    None), plus d_logits_in where given. parts: where asked, d logits' three bf16 parts side by side [T, 3E]
    (router._bf16_parts concatenated, the router's backward GEMM operand) from the same kernel; else None."""
    rows, cols = scores.shape
    if d_weights is None:
        d_weights = scores.new_zeros(rows, k)
    d_logits = torch.empty_like(scores)
    split = torch.empty(rows, 3 * cols, dtype=torch.bfloat16, device=scores.device) if parts else None
    if rows:
        grid, meta = _route_launch(rows, cols, k)
        ds = None if d_scores is None else d_scores.float().contiguous()
        dl_in = None if d_logits_in is None else d_logits_in.float().contiguous()
        _kernels().route_backward_kernel[grid](scores, ids, d_weights.float().contiguous(),
                                               scores if ds is None else ds, d_logits,
                                               scores if dl_in is None else dl_in,
                                               d_logits if split is None else split, rows, cols, scale,
                                               SOFTMAX=softmax, HAS_DS=ds is not None, NORM=norm,
                                               HAS_DL=dl_in is not None, PARTS=parts, **meta)
    return d_logits, split


# router_forward: programs of 64 rows x all E columns, K steps of 128, 8 warps, 4 stages. Measured on an H100 at
# 8192 tokens (kernel us, against the cuBLAS GEMM + route's kernel): qwen3 (E 128) 28.0 vs 53.4, mixtral (E 8) 27.3
# vs 35.5; at E = 256 (deepseek-v3) the best fitting form took 139 us against 134, so above 128 experts the two
# steps run.
ROUTER_MAX_COLS = 128
ROUTER_ROWS, ROUTER_BLOCK_K, ROUTER_WARPS, ROUTER_STAGES = 64, 128, 8, 4


def router_runs_on(x: torch.Tensor, weight: torch.Tensor, top_k: int, n_group) -> bool:
    """router_forward runs on x [T, H] and the router weight [E, H]: both bf16 or both fp16 on one CUDA device, no
    expert groups, 1 <= top_k <= E <= ROUTER_MAX_COLS, where Triton is installed."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.device == x.device and x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and 0 < top_k <= weight.shape[0] <= ROUTER_MAX_COLS and (n_group or 1) == 1 and available())


def router_forward(x, weight, logit_bias, bias, k: int, softmax: bool, norm: bool, scale: float):
    """(logits fp32 [T, E], ids int64 [T, k], weights fp32 [T, k], scores fp32 [T, E]): the router's logits x @
    weight^T (+ logit_bias) in fp32 and route's routing of them (bias: the selection-only correction) in one
    kernel; not differentiable (router.route_tokens wraps it)."""
    import triton

    x, weight = x.contiguous(), weight.contiguous()
    rows, hidden = x.shape
    cols = weight.shape[0]
    ids, weights, scores = _route_outputs(rows, cols, k, x.device)
    logits = torch.empty_like(scores)
    if rows:
        lb = None if logit_bias is None else logit_bias.contiguous()
        sb = None if bias is None else bias.float().contiguous()
        _kernels().router_forward_kernel[(-(-rows // ROUTER_ROWS),)](
            x, weight, x if lb is None else lb, logits if sb is None else sb, logits, ids, weights, scores, rows, cols,
            hidden, scale, K=k, KP=triton.next_power_of_2(k), SOFTMAX=softmax, HAS_LBIAS=lb is not None,
            HAS_BIAS=sb is not None, NORM=norm, ROWS=ROUTER_ROWS, BLOCK=max(16, triton.next_power_of_2(cols)),
            BLOCK_K=ROUTER_BLOCK_K, num_warps=ROUTER_WARPS, num_stages=ROUTER_STAGES)
    return logits, ids, weights, scores
