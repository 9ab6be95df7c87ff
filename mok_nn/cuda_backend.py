"""Routed experts on one CUDA GPU (EP = 1) with the CuTe DSL kernels.

Same signatures and formulas as reference.experts_forward / experts_backward (see reference.py for the
math). One forward and backward, kernel by kernel (registry names; K is the GEMM's reduction length):

  schedule + x    mok_schedule_gather: per-chunk counts, one scan CTA, placement over many CTAs (the schedule,
                  by prefix sums: no host sync), then the x rows scattered into the padded expert order, each
                  x row read once (precision="mxfp8": stored as its MXFP8 values); one host call.
                  mok_schedule_mc where there is nothing to gather.
  gate/up + act   the gate/up GEMM with SwiGLU in its epilogue: mok_gemm_gate_up_swiglu_ppc (clustered
                  ping-pong) where H <= 2048, mok_gemm_gate_up_swiglu_ef where H <= 8192. Elsewhere (larger H,
                  gate/up biases, swiglu_oai, I % 128 != 0) the plain GEMM, then mok_act_fwd_<act>.
  down GEMM       the plain GEMM (gemm_kernel)
  combine         mok_combine_cp (top_k <= 16) or mok_combine: a fixed tree over expert groups, the same
                  tree as the EP path's per-rank partial sums (kernels/combine.py)
  dgrad of down   with the activation backward and the top-k weight gradient in its epilogue,
  + dSwiGLU       mok_gemm_dact_<act>_ppc, where H <= dact_max_k (2048; 4096 on H200) and I % 256 == 0;
                  else mok_gemm_bn_f32_dyn (fp32 out), then mok_act_bwd_<act>
  dgrad gate/up   the plain GEMM; d x by the combine kernels with w = 1
  weight grads    mok_gemm_wgrad_defer_c2 (varlen-K grouped GEMM on 2-CTA clusters sharing B by TMA
                  multicast); mok_gemm_wgrad_pp where experts have few rows and the output few columns;
                  macrobatch passes after the first add into the first one's (mok_gemm_wgrad_defer_c2_acc).
                  d down_proj runs right after the dgrad of down, before the dgrad of gate/up; d gate_up_proj
                  last, in column blocks of x, each block's x rows gathered (mok_scatter_rows) for it
  memory          the forward keeps gate_up only (x's rows are freed after the gate/up GEMM); where autograd
                  keeps no graph, d gate_up overwrites it (the dSwiGLU epilogue reads each element before it
                  writes it); every row buffer is freed once used (mlp_rows_backward, benchmarks/memory_model.py)
  precision=      every activation operand's MXFP8 values in bf16 (GemmOperands): x and d y by their gathers
  "mxfp8"         (mok_scatter_rows' mx), h by the gate/up kernel itself where its helper warps compute it;
                  mok_mx_quant gives d gate_up's after its kernel (both of its operands in one launch) and the
                  weight-gradient operands' per expert in blocks of 32 rows (x's and d y's read from x / d y into
                  schedule order by that pass itself: row_segments); Triton's fake_quantize the weights'
                  (once per call, or per change where frozen); the same kernels then run on those values.
                  Trained weights reach the forward's _mx GEMMs (below) as MXFP8 bytes instead, one Triton pass
                  (mxfp8.quantize), where those take the call (cuda_mx.reads_trained_bytes)
  MXFP8-only      the forward's gate/up and plain GEMMs read the stored E4M3 bytes and scales (cuda_mx.MxWeight:
  weights         mok_gemm_gate_up_swiglu_mx, mok_gemm_bk_mx), bitwise the bf16 kernels on W_q; the backward takes W_q,
                  or with precision="mxfp8" its dgrad GEMMs read the bytes too (cuda_mx.MxColumnWeight: mok_gemm_bn_mxq,
                  mok_gemm_bn_mxq_f32 + the activation backward), bitwise the bf16 kernels on W_q's values along K

The plain bf16 grouped GEMM has three forms (gemm_kernel): clustered ping-pong (_ppc) where K <= 1024; the
whole output tile in shared memory with tiles claimed by atomic add (_ef_dyn, whose consumer warp groups skip
the MMA of all-padding rows) where K <= 8192; the output tile stored in four sub-tiles (bk / bn) for longer K.
Every form sums each output element over K in the same order, so the choice never changes the bits.

Every step has a fixed reduction order, so results are bitwise reproducible. MOK_GEMM=torch runs every GEMM
(weight gradients included) through torch._grouped_mm and MOK_ACT=torch the activations through torch ops:
debugging oracles, equal to the kernels within rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from . import cuda_mx, triton_ops
from .cuda_mx import MxColumnWeight, MxWeight
from .envvars import getenv
from .mxfp8 import fake_quantize_fast, quantize, weight_values
from .router import expert_counts
from .triton_ops import current_stream
from .kernels.registry import COMBINE_STAGED_ENTRIES, EP_COPY_THREADS, combine_leaves
from .kernels.registry import (
    COMBINE_LEAVES, GEMM_TILE_N, MX_QUANT_CTAS_PER_SM, MX_QUANT_THREADS, MX_QUANT_UNROLL, SCHEDULE_MAX_EXPERTS, SCHEDULE_MC_MAX_CHUNKS,
    SCHEDULE_MC_WARPS, TILE_M, WGRAD_ACC_KERNELS, tile_n_of,
)  # fmt: skip
from .kernels import loader

# Weight-gradient GEMM: deferred epilogue on 2-CTA clusters sharing B, the fastest over the three benchmark
# shapes on H200 (21.2 ms against 22.4-23.3 ms for the unclustered and eager-epilogue forms).
WGRAD_KERNEL = "mok_gemm_wgrad_defer_c2"
# Except where the experts have few rows and the output few columns (deepseek-v3's d down at EP = 1: 256 rows
# per expert, I = 2048 columns): there the ping-pong kernel, whose epilogue runs beside the other warp group's
# short mainloop, measured 4.12 vs 4.36 ms; qwen3's d down (512 rows per expert) and every d gate_up are
# slower with it. Same bits.
WGRAD_SHORT_KERNEL = "mok_gemm_wgrad_pp"
WGRAD_SHORT_MAX_ROWS = 256  # mean routed rows per expert, at most
WGRAD_SHORT_MAX_COLS = 2048  # output columns (b_rows' width), at most
# Longest reduction for which the whole-tile epilogue wins on H200 (deepseek-v3 and qwen3 gain; mixtral's
# K = 14336 / 28672 lose the fourth A/B stage it costs).
GEMM_FULL_EPI_MAX_K = 8192
# The clustered ping-pong kernels (_ppc) run where K is at most this, per GEMM kind, else the cooperative
# ones. Measured on H200 call by call: gate/up + SwiGLU fused: qwen3 0.70 vs 0.75, deepseek-v3 11.5 vs 8.2;
# plain GEMMs: qwen3 down (K 768) 0.385 vs 0.409, every K >= 1536 equal or slower.
PINGPONG_MAX_K = {"gemm": 1024, "act": 2048}
# The dgrad of down with dSwiGLU fused (mok_gemm_dact_<act>_ppc, K = H) runs where H is at most this on the GPU
# (dact_max_k), else the two kernels. On H200 (earlier kernels, call by call): qwen3 (2048) 0.50 vs 0.62 ms,
# mixtral (4096) 3.45 vs 4.11, deepseek-v3 (7168) 4.59 vs 4.50. On one H100 (kernel time per forward+backward,
# two rounds): qwen3 4.28-4.30 vs 4.36 ms, but mixtral 27.22-27.52 vs 26.56-26.71 (the fused GEMM 4.46-4.58 ms
# against 2.80 + 1.18 for the two kernels).
DACT_MAX_K = {"H200": 4096}  # a fragment of the GPU's name -> the longest H fused there
DACT_MAX_K_DEFAULT = 2048

SUPPORTED_ACTIVATIONS = ("swiglu", "swiglu_oai")
FUSED_ACT_ACTIVATIONS = ("swiglu",)  # the gate/up GEMMs with an activation epilogue (registry)


@dataclass
class Schedule:
    """Routed rows laid out by expert, each expert's segment padded to TILE_M rows.

    pos [T, k] int64:         row of slot (t, j)
    row_token [M_cap] int64:  token of each row; T (a zero row) for padding
    tile_expert [M_cap/TILE_M] int32: expert of each row tile, -1 past the last segment
    seg_end [E] int32:        end row of each expert's segment (offsets for grouped_mm)
    seg_rows [E] int32:       routed (real) rows of each expert, at the start of its segment
    """

    pos: torch.Tensor
    row_token: torch.Tensor
    tile_expert: torch.Tensor
    seg_end: torch.Tensor
    seg_rows: torch.Tensor
    row_expert: torch.Tensor | None = None  # [M_cap] int64, E past the end; derived when absent
    # (x, x_rows, precision): x gathered in schedule order by the call that made the schedule (make_schedule(
    # gather_x=x)), with precision "mxfp8" its MXFP8 values (build_schedule); taken once (take_gathered), so the
    # schedule does not keep x_rows alive after the forward
    gathered: tuple | None = field(default=None, repr=False)
    # gemm_seg_rows: written by the schedule kernels (make_schedule), else computed once on first use; every
    # GEMM of a forward+backward takes it (3 torch ops each time otherwise, host time the GPU can wait for)
    padded_rows: torch.Tensor | None = field(default=None, repr=False)

    def gemm_seg_rows(self) -> torch.Tensor:
        """[E] int32 rows per expert as the GEMMs see them: the padded segment sizes, so no
        consumer warp group skips its MMA (skipping all-padding halves measured slower on H200)."""
        if self.padded_rows is None:
            self.padded_rows = padded_seg_rows(self.seg_end)
        return self.padded_rows

    def seg_rows_for(self, kernel: str) -> torch.Tensor:
        """[E] int32 seg_rows for grouped GEMM `kernel`: the real rows for the clustered ping-pong kernels (_ppc:
        a tile whose rows past the first 64 are all padding runs one 64-row MMA block) and the dynamic-tile
        ones (_dyn: an all-padding consumer warp group skips its MMA), else the padded sizes (gemm_seg_rows).
        Same bits either way in every row that is read (the real rows; padding rows too where A's padding
        rows are zero, i.e. unless a gate/up bias made h's padding rows act(bias): the down GEMM's padding
        rows, which nothing reads, then differ)."""
        if kernel.endswith(("_ppc", "_dyn")):
            return self.seg_rows
        return self.gemm_seg_rows()

    def take_gathered(self, x: torch.Tensor, precision: str = "bf16") -> torch.Tensor | None:
        """x_rows (= gather_rows(x, self, skip_tail=True); precision "mxfp8": of x's MXFP8 values) where the
        schedule's call gathered this very x so, else None; forgets them either way."""
        gathered, self.gathered = self.gathered, None
        return gathered[1] if gathered is not None and gathered[0] is x and gathered[2] == precision else None

    @property
    def capacity(self) -> int:
        return self.row_token.shape[0]

    @property
    def num_experts(self) -> int:
        return self.seg_end.shape[0]

    def expert_of_rows(self) -> torch.Tensor:
        """[M_cap] int64 expert of each row; E for rows past the last segment."""
        if self.row_expert is not None:
            return self.row_expert
        te = self.tile_expert.long()
        te = torch.where(te < 0, self.num_experts, te)
        return te.repeat_interleave(TILE_M)


def padded_seg_rows(seg_end: torch.Tensor) -> torch.Tensor:
    """[E] int32 padded segment sizes: as seg_rows they mark no row as padding."""
    return torch.diff(seg_end, prepend=seg_end.new_zeros(1)).to(torch.int32)


def schedule_capacity(num_tokens: int, top_k: int, num_experts: int, tile: int = TILE_M) -> int:
    """Rows needed in the worst case: every slot plus tile-1 padding per used expert."""
    n = num_tokens * top_k
    m = n + min(num_experts, n) * (tile - 1)
    return max(tile, (m + tile - 1) // tile * tile)


def schedule_chunk(num_slots: int) -> tuple[int, int]:
    """(slots per chunk, chunks) of the multi-CTA schedule: at most SCHEDULE_MC_MAX_CHUNKS chunks,
    each a multiple of 32 slots per warp; at least one chunk."""
    granule = SCHEDULE_MC_WARPS * 32
    per = -(-num_slots // SCHEDULE_MC_MAX_CHUNKS)
    chunk = max(granule, -(-per // granule) * granule)
    return chunk, max(1, -(-num_slots // chunk))


def _checked_capacity(num_tokens: int, top_k: int, num_experts: int, capacity: int | None) -> int:
    """capacity (rows), or the worst case where None; a given one must hold the worst case."""
    need = schedule_capacity(num_tokens, top_k, num_experts)
    if capacity is None:
        return need
    if capacity < need or capacity % TILE_M:
        raise ValueError(f"schedule capacity {capacity}: needs a multiple of {TILE_M} >= {need}")
    return capacity


def make_schedule(topk_ids: torch.Tensor, num_experts: int, capacity: int | None = None,
                  gather_x: torch.Tensor | None = None, gather_mx: bool = False) -> Schedule:
    """Count -> pad -> prefix sum on the device, no host sync.

    On CUDA with at most SCHEDULE_MAX_EXPERTS experts: mok_schedule_mc (three launches: per-chunk counts,
    one scan CTA, placement over many CTAs); elsewhere make_schedule_torch, which gives the same schedule.
    capacity: rows of the schedule (default the worst case, schedule_capacity; more only adds padding rows).
    gather_x [T, H]: also gather x in schedule order from the same host call (mok_schedule_gather:
    mok_schedule_mc + mok_scatter_rows; gather_mx: x's MXFP8 values, gather_rows(mx=True)); the schedule holds
    the rows until take_gathered(x) takes them. Elsewhere nothing is gathered (take_gathered gives None).
    """
    num_tokens, top_k = topk_ids.shape
    dev = topk_ids.device
    cap = _checked_capacity(num_tokens, top_k, num_experts, capacity)
    if not (topk_ids.is_cuda and num_experts <= SCHEDULE_MAX_EXPERTS):
        return make_schedule_torch(topk_ids, num_experts, cap)
    n = num_tokens * top_k
    chunk, chunks = schedule_chunk(n)
    pos, row_token, tile_expert, seg_end, seg_rows, padded_rows, scratch = _schedule_buffers(
        n, cap, num_experts, chunks * num_experts, dev)
    ids = topk_ids.reshape(-1).contiguous()
    outs = (ids, pos, row_token, tile_expert, seg_end, seg_rows, padded_rows)
    sched = Schedule(pos.view(num_tokens, top_k), row_token, tile_expert, seg_end, seg_rows,
                     padded_rows=padded_rows)
    if gather_x is not None and _gathers_with_schedule(gather_x, sched.pos, gather_mx):
        x_rows = torch.empty(cap, gather_x.shape[1], dtype=gather_x.dtype, device=dev)
        _lib().launch("mok_schedule_gather", *outs, scratch, top_k, chunk, gather_x, sched.pos, x_rows,
                      int(gather_mx), _scatter_rows_grid(num_tokens, cap, num_sms(dev)), stream=_stream())
        sched.gathered = (gather_x, x_rows, "mxfp8" if gather_mx else "bf16")
    else:
        _lib().launch("mok_schedule_mc", *outs, scratch, top_k, chunk, stream=_stream())
    return sched


def _schedule_buffers(num_slots: int, capacity: int, num_experts: int, scratch: int, device) -> tuple:
    """(pos [num_slots] i64, row_token [capacity] i64, tile_expert [capacity / TILE_M] i32, seg_end, seg_rows,
    padded_rows [num_experts] i32, scratch [scratch] i32): make_schedule's buffers as views of one int32
    allocation, the two int64 ones first, so every view keeps the alignment its kernels take (8 and 4
    bytes, registry). Seven torch.empty calls cost the host ~4 us each where the GPU waits for the
    forward's first launch; one allocation, one split and two dtype views cost less."""
    sizes = (2 * num_slots, 2 * capacity, capacity // TILE_M, num_experts, num_experts, num_experts, scratch)
    parts = torch.empty(sum(sizes), dtype=torch.int32, device=device).split_with_sizes(sizes)
    return (parts[0].view(torch.int64), parts[1].view(torch.int64), *parts[2:])


def _gathers_with_schedule(x: torch.Tensor, pos: torch.Tensor, mx: bool = False) -> bool:
    """Whether make_schedule can gather x (mx: its MXFP8 values) in the schedule's call: x holds the schedule's
    tokens (pos [T, k]) and take_rows would run mok_scatter_rows on them (_gather_rows_kernel)."""
    return (x.dim() == 2 and x.shape[0] == pos.shape[0] > 0
            and _gather_rows_kernel(x, pos, mx) == "mok_scatter_rows")


def make_schedule_torch(topk_ids: torch.Tensor, num_experts: int, capacity: int | None = None) -> Schedule:
    """The same schedule from torch ops (CPU, or more experts than the kernel holds)."""
    num_tokens, top_k = topk_ids.shape
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    cap = _checked_capacity(num_tokens, top_k, num_experts, capacity)
    counts = expert_counts(flat, num_experts)
    padded = (counts + (TILE_M - 1)) // TILE_M * TILE_M
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices  # slots grouped by expert, stable
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - cnt_start[sorted_e]
    row = seg_start[sorted_e] + rank
    pos = torch.empty(n, dtype=torch.int64, device=dev)
    pos[order] = row  # a permutation: every slot written once
    row_token = torch.full((cap,), num_tokens, dtype=torch.int64, device=dev)
    row_token[row] = order // top_k
    tile_start = torch.arange(0, cap, TILE_M, device=dev)
    te = torch.searchsorted(seg_end, tile_start, right=True)
    tile_expert = torch.where(te < num_experts, te, -1).to(torch.int32)
    return Schedule(pos.view(num_tokens, top_k), row_token, tile_expert, seg_end.to(torch.int32),
                    counts.to(torch.int32))


def row_weights(sched: Schedule, topk_weights: torch.Tensor) -> torch.Tensor:
    """[M_cap] fp32: the top-k weight of each row, 0 on padding rows."""
    w = torch.zeros(sched.capacity, dtype=torch.float32, device=topk_weights.device)
    w[sched.pos.reshape(-1)] = topk_weights.reshape(-1).float()
    return w


# --------------------------------------------------------------------------
# building blocks


def _use_torch_gemm() -> bool:
    """MOK_GEMM=torch: every GEMM, weight gradients included, by torch._grouped_mm (a debugging oracle)."""
    return env_choice("MOK_GEMM", ("kernel", "torch"), "kernel") == "torch"


def _use_torch_act() -> bool:
    """MOK_ACT=torch: the elementwise steps by torch ops (a debugging oracle): the activation and its backward, and
    precision="mxfp8"'s quantisation (mx_values)."""
    return env_choice("MOK_ACT", ("kernel", "torch"), "kernel") == "torch"


def env_choice(var: str, choices: tuple, default: str) -> str:
    """The setting in environment variable `var`: one of `choices`, `default` where unset or empty;
    any other value raises ValueError naming the variable."""
    mode = getenv(var, "")
    if mode and mode not in choices:
        raise ValueError(f"{var}={mode!r}: expected one of {choices}")
    return mode or default


def pingpong(kind: str, k: int) -> bool:
    """Whether a GEMM of this kind ("gemm": plain bf16, "act": gate/up + activation) and reduction length k runs
    on the clustered ping-pong kernel (_ppc)."""
    return k <= PINGPONG_MAX_K[kind]


def dact_max_k(device: torch.device | None) -> int:
    """The longest H for which the dgrad of down runs with dSwiGLU fused on this device (DACT_MAX_K by the GPU's
    name; DACT_MAX_K_DEFAULT elsewhere, and for None or a device that is not a GPU)."""
    if device is None or device.type != "cuda":
        return DACT_MAX_K_DEFAULT
    return _dact_max_k_on(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _dact_max_k_on(index: int) -> int:
    name = torch.cuda.get_device_name(index)
    return next((k for fragment, k in DACT_MAX_K.items() if fragment in name), DACT_MAX_K_DEFAULT)


def _lib():
    """The kernel library (loader.load: a dict lookup, no lock, once it is loaded)."""
    return loader.load("sm_90a")


_stream = current_stream  # cudaStream_t of the current stream of the current device (the tests replace it)


# Row gathers into schedule order: mok_scatter_rows (warp per source row, read once and stored to each of its
# rows) measured faster than mok_gather_rows (warp per destination row) on H200, qwen3 0.099 vs 0.126 ms,
# deepseek-v3 0.379 vs 0.519, and both faster than index_select.
GATHER_CTAS_PER_SM = 8  # grid of mok_gather_rows / mok_scatter_rows: CTAs of 8 warps per SM


def gather_rows(x: torch.Tensor, sched: Schedule, skip_tail: bool = False, mx: bool = False) -> torch.Tensor:
    """x rows in schedule order [M_cap, H]; padding rows (row_token = T) are zero. skip_tail: the rows of
    the tiles past the last segment are left unwritten (see take_rows). mx: the rows of x's MXFP8 values along
    H (mx_values(x, MX_ALONG_COLS); made by the gather kernel where it runs)."""
    return take_rows(x, sched.row_token, slots=sched.pos, tile_expert=sched.tile_expert if skip_tail else None,
                     mx=mx)


def take_rows(src: torch.Tensor, idx: torch.Tensor, has_zero_row: bool = False,
              slots: torch.Tensor | None = None, tile_expert: torch.Tensor | None = None,
              mx: bool = False) -> torch.Tensor:
    """[len(idx), H]: row idx[r] of src, a zero row where idx[r] == src rows (the padding rows of a
    schedule), or, has_zero_row, src's own last row (zero, as the EP tokens sections keep it) where
    idx[r] points there.

    tile_expert (a schedule's, one entry per TILE_M rows): the kernels leave the rows of tiles with
    tile_expert < 0 (past the last segment) unwritten. Only for rows that nothing but the GEMMs and the
    weight gradients read (both stop at the last segment): at EP > 1 with the default capacity these
    are about half the rows, zero-filled for nothing otherwise. The torch path writes them anyway.

    On CUDA: mok_scatter_rows (warp per src row, read once and stored to each of its rows, then the zero
    rows) where slots [N, k], the row of each slot (u, j) of src row u, are given (as Schedule.pos /
    EPSchedule.token_slots give it) and k <= 32; else mok_gather_rows (warp per dst row). Elsewhere (CPU,
    rows that are not 16-byte vectors) index_select, after a cat of a zero row unless has_zero_row.
    Same bits in every written row.

    mx: the rows of src's MXFP8 values along its columns (mx_values(src, MX_ALONG_COLS)), made by
    mok_scatter_rows itself as it stores each source row (no pass over src first), else by mx_values first."""
    name = _gather_rows_kernel(src, slots, mx)
    if mx and name != "mok_scatter_rows":
        src, mx = mx_values(src, MX_ALONG_COLS), False
        name = _gather_rows_kernel(src, slots)
    if name is not None:
        out = torch.empty(idx.shape[0], src.shape[1], dtype=src.dtype, device=src.device)
        if not idx.shape[0]:
            return out
        tiles = tile_expert if tile_expert is not None else _cached_zero_tile(src.device)
        if name == "mok_scatter_rows":
            grid = _scatter_rows_grid(slots.shape[0], idx.shape[0], num_sms(src.device))
            _lib().launch(name, src, slots.contiguous(), idx, tiles, out, int(mx), grid, stream=_stream())
        else:
            grid = row_copy_grid(idx.shape[0], num_sms(src.device), GATHER_CTAS_PER_SM)
            _lib().launch(name, src, idx, tiles, out, grid, stream=_stream())
        return out
    if has_zero_row:
        return src.index_select(0, idx)
    return torch.cat([src, src.new_zeros(1, src.shape[1])]).index_select(0, idx)


def _gather_rows_kernel(src: torch.Tensor, slots: torch.Tensor | None, mx: bool = False) -> str | None:
    """The kernel take_rows runs on src: mok_scatter_rows where slots [N, k] are given, k <= 32 and N <= src
    rows (mx: and the rows are whole blocks of 32 on the mok_mx_quant path, _mx_kernel_runs), else
    mok_gather_rows; None where index_select runs (CPU, or rows that are not 16-byte vectors)."""
    if not (src.is_cuda and rows_of_16_byte_vectors(src)):
        return None
    if (slots is not None and slots.shape[1] <= 32 and slots.shape[0] <= src.shape[0]
            and (not mx or _mx_kernel_runs(src))):
        return "mok_scatter_rows"
    return "mok_gather_rows"


def _scatter_rows_grid(num_src: int, num_rows: int, sms: int) -> int:
    """CTAs of mok_scatter_rows (and mok_scatter_rows_peers) on a GPU of `sms` SMs: its work units are the
    num_src source rows, then batches of 32 of the num_rows dst rows (the zero rows)."""
    return row_copy_grid(num_src + -(-num_rows // 32), sms, GATHER_CTAS_PER_SM)


@functools.lru_cache(maxsize=None)
def _cached_zero_tile(device: torch.device) -> torch.Tensor:
    """A one-entry tile_expert table [0]: the gather kernels then write every row."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def rows_of_16_byte_vectors(t: torch.Tensor) -> bool:
    """bf16 rows that mok_gather_rows copies in 16-byte vectors: H % 8 == 0, unit column stride, a row stride
    of whole vectors and a 16-byte aligned start (a view at an odd offset takes the torch path)."""
    return (t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[1] % 8 == 0 and t.stride(1) == 1
            and (t.shape[0] <= 1 or t.stride(0) % 8 == 0) and t.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_copy_grid(num_rows: int, sms: int, ctas_per_sm: int) -> int:
    """CTAs of a grid-stride row copy, warp per row (kernels/ep_copy.py: mok_gather_rows and the EP copies):
    at most ctas_per_sm per SM, no more than one row per warp, at least one."""
    return max(1, min(-(-num_rows // (EP_COPY_THREADS // 32)), sms * max(1, ctas_per_sm)))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sched: Schedule, transpose_w: bool, out_dtype=torch.bfloat16):
    """rows r: a[r] @ W[e(r)]^T (transpose_w=False, W [E, N, K]) or a[r] @ W[e(r)] (True, W [E, K, N]).
    W may be an MxWeight (transpose_w=False): where cuda_mx.reads_mx, mok_gemm_bk_mx reads it as MXFP8, checked
    on first use against the bf16 kernel on W_q (cuda_mx.verified); else it is dequantised for the bf16 kernel.
    W may be an MxColumnWeight (transpose_w=True, the backward's dgrad): mok_gemm_bn_mxq[_f32] reads it, checked on
    first use against the bf16 kernel on its values, where cuda_mx.reads_mx; else (many rows per expert, or the
    torch oracle MOK_GEMM=torch) its values are made for the bf16 kernel."""
    if isinstance(w, MxColumnWeight):
        if not transpose_w:
            raise ValueError("an MxColumnWeight is read along N (the backward's dgrad GEMMs), transposed")
        name = "mok_gemm_bn_mxq" + ("_f32" if out_dtype == torch.float32 else "")
        if not _use_torch_gemm() and cuda_mx.reads_mx(name, sched, w):
            return cuda_mx.verified(name, sched, lambda: gemm_mx_cols(a, w, sched, name, out_dtype),
                                    lambda: grouped_gemm(a, w.values(), sched, True, out_dtype))
        w = w.values()
    if isinstance(w, MxWeight):
        if transpose_w:
            raise ValueError("an MxWeight is read along K (the forward's GEMMs), not transposed")
        if not _use_torch_gemm() and cuda_mx.reads_mx("mok_gemm_bk_mx", sched, w):
            return cuda_mx.verified("mok_gemm_bk_mx", sched, lambda: gemm_mx(a, w, sched),
                                    lambda: grouped_gemm(a, w.dequantized(), sched, transpose_w=False))
        w = w.dequantized()  # many rows per expert, or the torch oracle (MOK_GEMM=torch)
    m = a.shape[0]
    if _use_torch_gemm():
        wt = w if transpose_w else w.transpose(1, 2)
        return torch._grouped_mm(a, wt, offs=sched.seg_end).to(out_dtype)
    n = w.shape[2] if transpose_w else w.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if transpose_w:  # B[n, k, e] = W[e, k, n]: N-major
        b = w.permute(2, 1, 0)
    else:  # B[n, k, e] = W[e, n, k]: K-major
        b = w.permute(1, 2, 0)
    launch_gemm(gemm_kernel(transpose_w, out_dtype, k=a.shape[1]), a, b, out, sched)
    return out


def gemm_mx_cols(a: torch.Tensor, w: MxColumnWeight, sched: Schedule, name: str, out_dtype) -> torch.Tensor:
    """mok_gemm_bn_mxq[_f32] (name), unchecked: [M, N] out_dtype, row r a[r] @ V[e(r)] with V W_q's MXFP8 values
    along K (w.values()); rows past the last segment unwritten."""
    out = torch.empty(a.shape[0], w.shape[2], dtype=out_dtype, device=a.device)
    launch_gemm(name, a, w.kernel_operands(), out, sched)
    return out


def gemm_mx(a: torch.Tensor, w: MxWeight, sched: Schedule) -> torch.Tensor:
    """mok_gemm_bk_mx, unchecked: [M, N] bf16, row r a[r] @ W_q[e(r)]^T; rows past the last segment unwritten."""
    out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
    launch_gemm("mok_gemm_bk_mx", a, w.kernel_operands(), out, sched)
    return out


def grouped_gemm_push(a: torch.Tensor, w: torch.Tensor, sched: Schedule, dst_base: torch.Tensor,
                      row_rank: torch.Tensor, row_slot: torch.Tensor, transpose_w: bool = False) -> None:
    """The rows of grouped_gemm(a, w, sched, transpose_w) (bf16) sent instead of returned: row r into row
    row_slot[r] of the section at address dst_base[row_rank[r]] (row_rank < 0: nowhere), by
    mok_gemm_bk_ef_push / mok_gemm_bn_ef_push, whose idle producer warps store each finished tile's rows while
    the next tiles are computed (a peer's memory where dst_base holds its address). Same values as
    grouped_gemm's rows."""
    n = w.shape[2] if transpose_w else w.shape[1]
    if n % 8 or a.shape[0] != row_rank.shape[0] or a.shape[0] != row_slot.shape[0]:
        raise ValueError(f"grouped_gemm_push: rows of N % 8 == 0 and one destination per row, got N = {n}, "
                         f"{a.shape[0]} rows, {row_rank.shape[0]} / {row_slot.shape[0]} destinations")
    b = w.permute(2, 1, 0) if transpose_w else w.permute(1, 2, 0)  # as grouped_gemm
    name = "mok_gemm_bn_ef_push" if transpose_w else "mok_gemm_bk_ef_push"
    _lib().launch(name, a.unsqueeze(-1), b, sched.tile_expert, sched.seg_end, sched.gemm_seg_rows(), gemm_group_m(n),
                  dst_base, row_rank, row_slot, stream=_stream())


def fused_act_supported(inter: int, activation: str, has_bias: bool) -> bool:
    """Whether gate_up_act runs these (the SwiGLU-epilogue GEMM): I a multiple of its 128-column halves, an
    activation it has (FUSED_ACT_ACTIVATIONS), no gate/up bias. The clustered kernel pairs column tiles of
    64 gate + 64 up columns, so I % 128 == 0 also keeps their count even."""
    return inter % (GEMM_TILE_N // 2) == 0 and activation in FUSED_ACT_ACTIVATIONS and not has_bias


def gate_up_act(a: torch.Tensor, w, sched: Schedule, activation: str, swiglu_limit, h_mx: bool = False):
    """(gate_up [M, 2I], h [M, I]) bf16: a[r] @ W13[e(r)]^T and act of it in one kernel; h_mx: h as its MXFP8
    values along I (precision="mxfp8": the down GEMM's operand; launch_gate_up_act).

    Rows past the last segment are left unwritten (as act_forward leaves h). W13 may be an MxWeight: where
    cuda_mx.reads_mx its kernel reads it as MXFP8, checked on first use against the bf16 kernel on W_q
    (cuda_mx.verified); else it is dequantised for the bf16 kernel.
    """
    if isinstance(w, MxWeight):
        kernel = f"mok_gemm_gate_up_{activation}_mx"
        if cuda_mx.reads_mx(kernel, sched, w):
            return cuda_mx.verified(
                kernel, sched, lambda: launch_gate_up_act(a, w, sched, activation, swiglu_limit, h_mx),
                lambda: launch_gate_up_act(a, w.dequantized(), sched, activation, swiglu_limit, h_mx))
        w = w.dequantized()  # many rows per expert
    return launch_gate_up_act(a, w, sched, activation, swiglu_limit, h_mx)


def launch_gate_up_act(a: torch.Tensor, w, sched: Schedule, activation: str, swiglu_limit, h_mx: bool = False):
    """gate_up_act's kernel, unchecked: for bf16 W13 mok_gemm_gate_up_<act>_ppc or _ef (pingpong("act", H)), for
    an MxWeight mok_gemm_gate_up_<act>_mx (its E4M3 bytes and scale pairs in B's place). h_mx: the helper-warp
    forms (_ef, _mx) store h's MXFP8 values themselves (mok_mx_quant's arithmetic); after _ppc mx_values makes
    them."""
    m, two_i = a.shape[0], w.shape[1]
    gate_up = torch.empty(m, two_i, dtype=torch.bfloat16, device=a.device)
    h = torch.empty(m, two_i // 2, dtype=torch.bfloat16, device=a.device)
    if isinstance(w, MxWeight):
        name, b = f"mok_gemm_gate_up_{activation}_mx", w.kernel_operands()
    else:
        name = f"mok_gemm_gate_up_{activation}" + ("_ppc" if pingpong("act", a.shape[1]) else "_ef")
        b = (w.permute(1, 2, 0),)
    in_epilogue = h_mx and not name.endswith("_ppc")
    group_m = gemm_group_m(two_i, tile_n_of(name))
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    _lib().launch(
        name, a.unsqueeze(-1), *b, gate_up.unsqueeze(-1), h.unsqueeze(-1), sched.tile_expert, sched.seg_end,
        sched.seg_rows_for(name), int(in_epilogue), limit, group_m, stream=_stream(),
    )  # fmt: skip
    if h_mx and not in_epilogue:
        h = mx_values(h, MX_ALONG_COLS)
    return gate_up, h


def gemm_kernel(transpose_w: bool, out_dtype=torch.bfloat16, k: int = 0) -> str:
    """Registry name of the plain grouped GEMM for reduction length k: fp32 output mok_gemm_bn_f32_dyn (an
    fp32 tile does not fit smem whole); bf16 the clustered ping-pong kernel (_ppc) where k is short, the
    whole-tile epilogue with dynamic tiles (_ef_dyn) where k <= GEMM_FULL_EPI_MAX_K, else the split epilogue."""
    if out_dtype == torch.float32:
        return "mok_gemm_bn_f32_dyn"
    name = "mok_gemm_bn" if transpose_w else "mok_gemm_bk"
    if pingpong("gemm", k):
        return name + "_ppc"
    return name + "_ef_dyn" if k <= GEMM_FULL_EPI_MAX_K else name


def launch_gemm(name: str, a, b, out, sched: Schedule) -> None:
    """One varlen-M grouped GEMM: a [M, K], b [N, K, E] (a strided view; for mok_gemm_bk_mx the pair
    MxWeight.kernel_operands gives), out [M, N]. A _dyn kernel gets a fresh zeroed tile counter (its CTAs claim
    tiles from it)."""
    counter = (torch.zeros(1, dtype=torch.int32, device=a.device),) if name.endswith("_dyn") else ()
    b = b if isinstance(b, tuple) else (b,)
    _lib().launch(
        name, a.unsqueeze(-1), *b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end, sched.seg_rows_for(name),
        gemm_group_m(out.shape[1], tile_n_of(name)), *counter, stream=_stream(),
    )  # fmt: skip


def band_rule(n: int, tile_n: int = GEMM_TILE_N) -> int:
    """Row tiles per raster band of a GEMM with n output columns. Measured on H200: column
    tiles fastest (1) unless the columns span more than 32 tiles (mixtral's gate/up: bands of 8)."""
    return 8 if (n + tile_n - 1) // tile_n > 32 else 1


def gemm_group_m(n: int, tile_n: int = GEMM_TILE_N) -> int:
    """The varlen-M grouped GEMMs' raster (their group_m argument) for n output columns: 0 (one band per
    expert with its row tiles fastest, so the tiles sharing a B column stripe run in the same wave of CTAs:
    grouped_gemm._tile_coord_one) where band_rule would run column tiles fastest, else its bands of 8 row
    tiles. Measured on H200: deepseek-v3's gate/up, down and dgrad of gate/up 3-5% faster than column tiles
    fastest; qwen3 equal; the same bits."""
    bands = band_rule(n, tile_n)
    return 0 if bands == 1 else bands


def expert_row_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32: routed rows per expert (router.expert_counts, as the kernels take them)."""
    return expert_counts(topk_ids, num_experts, torch.int32)


def weight_grad(a_rows: torch.Tensor, b_rows: torch.Tensor, sched: Schedule, counts: torch.Tensor,
                into: torch.Tensor | None = None, out: torch.Tensor | None = None, cols: int | None = None
                ) -> torch.Tensor:
    """[E, Na, Nb] bf16: per expert e, a_rows[seg e]^T @ b_rows[seg e] (fp32 accumulation, rows ascending).

    a_rows [M_cap, Na], b_rows [M_cap, Nb] in schedule order with zero padding rows;
    counts [E] int32 real rows per expert (the kernel stops at the 16-row k-block holding the last one).
    into: add the (bf16-rounded) result into this [E, Na, Nb] tensor and return it (macrobatch passes):
    by the accumulating twin of the kernel where it has one (WGRAD_ACC_KERNELS: the stores add in L2,
    no second gradient buffer), else computed apart and added (bf16 round of the sum either way).
    out: write the result into this [E, Na, Nb] tensor (a view: a column block of a larger gradient) and
    return it. cols: the columns of the whole gradient where b_rows is a block of them (the kernel is chosen
    for the whole, so that every block runs the kernel the whole would: wgrad_kernel).
    """
    name = wgrad_kernel(sched, cols or b_rows.shape[1], into is not None)
    acc_name = WGRAD_ACC_KERNELS.get(name)
    if into is not None and (_use_torch_gemm() or acc_name is None or not _kernel_stores_into(into)):
        return into.add_(weight_grad(a_rows, b_rows, sched, counts, cols=cols).to(into.dtype))
    if out is not None and (_use_torch_gemm() or not _kernel_stores_into(out)):
        return out.copy_(weight_grad(a_rows, b_rows, sched, counts, cols=cols))
    if _use_torch_gemm():
        return torch._grouped_mm(a_rows.t(), b_rows, offs=sched.seg_end)
    na, nb = a_rows.shape[1], b_rows.shape[1]
    if into is not None:
        out, name = into, acc_name
    elif out is None:
        out = torch.empty(sched.num_experts, na, nb, dtype=torch.bfloat16, device=a_rows.device)
    _lib().launch(
        name, a_rows.t().unsqueeze(-1), b_rows.t().unsqueeze(-1), out.permute(1, 2, 0),
        sched.seg_end, counts, wgrad_group_m(name, nb), stream=_stream(),
    )  # fmt: skip
    return out


def wgrad_kernel(sched: Schedule, cols: int, accumulate: bool = False) -> str:
    """The default weight-gradient kernel for a schedule and cols output columns: WGRAD_SHORT_KERNEL where
    the mean routed rows per expert (slots / experts: known on the host) and cols are small, else
    WGRAD_KERNEL; always WGRAD_KERNEL when accumulating (macrobatch passes: its twin adds in its stores)."""
    rows = sched.pos.numel() / max(1, sched.num_experts)
    if not accumulate and rows <= WGRAD_SHORT_MAX_ROWS and cols <= WGRAD_SHORT_MAX_COLS:
        return WGRAD_SHORT_KERNEL
    return WGRAD_KERNEL


def _kernel_stores_into(t: torch.Tensor) -> bool:
    """The weight-gradient kernels (and their accumulating twins) can store into t: a CUDA tensor of
    wgrad_output_layout (a contiguous gradient, or a column block of one)."""
    return t.is_cuda and wgrad_output_layout(t)


def wgrad_output_layout(t: torch.Tensor) -> bool:
    """t [E, Na, Nb] has a layout the weight-gradient kernels store into: bf16, unit column stride, the other
    strides whole 16-byte vectors, a 16-byte aligned start."""
    return (t.dtype == torch.bfloat16 and t.dim() == 3 and t.stride(2) == 1 and t.stride(0) % 8 == 0
            and t.stride(1) % 8 == 0 and t.data_ptr() % 16 == 0)


def wgrad_group_m(name: str, nb: int) -> int:
    """Row tiles (row-tile pairs in the clustered kernels) per raster band of weight-gradient kernel `name`
    with nb output columns: 8 where the columns span more than 32 tiles, else 1 (column tiles fastest)."""
    return band_rule(nb, tile_n_of(name))


MAX_TOP_K = 32  # the combine kernels hold slot j's row index, leaf and weight in lane j of a warp


def experts_per_leaf(num_experts: int) -> int:
    """Experts per leaf of the combine's tree (E / combine_leaves(E)): slot (t, j) sums into leaf ids[t, j] // this."""
    return num_experts // combine_leaves(num_experts)


def combine(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
            out_dtype) -> torch.Tensor:
    """out[t] = the fixed tree over expert groups (kernels/combine.py) of weights[t, j] * rows[pos[t, j]],
    fp32, j ascending within a group; ids [T, k] the experts of the slots."""
    num_tokens, hidden = pos.shape[0], rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=rows.device)
    if num_tokens == 0:
        return out
    w = weights.float().contiguous()
    if out_dtype != torch.bfloat16 or rows.dtype != torch.bfloat16 or hidden % 8:
        raise ValueError("combine kernel takes bf16 rows and output with hidden % 8 == 0")
    if pos.shape[1] > MAX_TOP_K:
        raise ValueError(f"combine kernel takes at most {MAX_TOP_K} slots per token, not {pos.shape[1]}")
    # The same bits from each (kernels/combine.py). The staged kernel (its slots' rows loaded into shared
    # memory by cp.async) is faster on H200: top-8 qwen3 0.097 vs 0.104 ms, deepseek-v3 0.288 vs 0.308,
    # top-2 mixtral 0.102 vs 0.117.
    name = "mok_combine_cp" if pos.shape[1] <= COMBINE_STAGED_ENTRIES else "mok_combine"
    _lib().launch(name, rows, pos.contiguous(), w, ids.contiguous(), out, experts_per_leaf(num_experts),
                  stream=_stream())
    return out


def tree_sum_torch(vals: list, present: list) -> tuple:
    """The combine's tree in torch: vals[l] [T, H] fp32 leaf sums, present[l] [T] bool (COMBINE_LEAVES
    each) -> (root [T, H], present [T]); a node with one present child is that child (no + 0.0)."""
    vals, present = list(vals), list(present)
    width = 1
    while width < COMBINE_LEAVES:
        for a in range(0, COMBINE_LEAVES, 2 * width):
            b = a + width
            both, only_b = (present[a] & present[b])[:, None], (present[b] & ~present[a])[:, None]
            vals[a] = torch.where(both, vals[a] + vals[b], torch.where(only_b, vals[b], vals[a]))
            present[a] = present[a] | present[b]
        width *= 2
    return vals[0], present[0]


def leaf_sums_torch(rows_j, weights: torch.Tensor, leaf: torch.Tensor, use: torch.Tensor) -> tuple:
    """Leaf sums of the combine in torch: rows_j(j) [T, H] the rows of slot j, weights / leaf / use [T, k]
    -> (vals, present) for tree_sum_torch; slot (t, j) adds weights[t, j] * row into leaf[t, j] where use."""
    num_tokens, top_k = leaf.shape
    vals, present = None, [torch.zeros(num_tokens, dtype=torch.bool, device=leaf.device)] * COMBINE_LEAVES
    for j in range(top_k):
        x = rows_j(j).float() * weights[:, j:j + 1].float()
        if vals is None:
            vals = [torch.zeros_like(x) for _ in range(COMBINE_LEAVES)]
        for g in range(COMBINE_LEAVES):
            m = (leaf[:, j] == g) & use[:, j]
            vals[g] = torch.where(m[:, None], vals[g] + x, vals[g])
            present[g] = present[g] | m
    return vals, present


def combine_torch(rows, pos, weights, ids, num_experts, out_dtype) -> torch.Tensor:
    """combine() with torch ops, the same tree (a CPU stand-in: torch rounds w * row and the add apart,
    the kernel fuses them, so the two agree to fp32 rounding, not bitwise)."""
    if pos.shape[0] == 0:
        return rows.new_empty(0, rows.shape[1], dtype=out_dtype)
    leaf = ids // experts_per_leaf(num_experts)
    vals, present = leaf_sums_torch(lambda j: rows[pos[:, j]], weights, leaf, torch.ones_like(leaf, dtype=torch.bool))
    return tree_sum_torch(vals, present)[0].to(out_dtype)


def act_forward(gate_up: torch.Tensor, sched: Schedule, activation: str, swiglu_limit) -> torch.Tensor:
    """h = act(gate_up) [M_cap, I] bf16; rows past the last segment are left unwritten."""
    if _use_torch_act():
        from . import reference

        return reference.activation_forward(gate_up.float(), activation, swiglu_limit).to(gate_up.dtype)
    h = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    _lib().launch(f"mok_act_fwd_{activation}", gate_up, h, sched.tile_expert, limit, stream=_stream())
    return h


def act_backward(gate_up, dh_raw, w_rows, sched: Schedule, activation: str, swiglu_limit, in_place: bool = False,
                 mx: bool = False):
    """(d gate_up bf16, w*h bf16, dw fp32 per row) from the saved gate_up and dh = dy @ W2[e]. in_place: d gate_up
    overwrites gate_up (each element read before it is written, by the thread that writes it). mx: d gate_up comes
    as its MXFP8 values along its columns (mx_values(d gate_up, MX_ALONG_COLS), made by the kernel as it stores)."""
    if mx and gate_up.shape[1] % 64:  # (blocks of 32 columns across gate and up: not the kernel's; a pass after)
        dgu, wh, dw = act_backward(gate_up, dh_raw, w_rows, sched, activation, swiglu_limit, in_place)
        return mx_values(dgu, MX_ALONG_COLS), wh, dw
    if _use_torch_act():
        from . import reference

        h = reference.activation_forward(gate_up.float(), activation, swiglu_limit).to(gate_up.dtype)
        w = w_rows.unsqueeze(1)
        dw = (dh_raw * h.float()).sum(dim=1)
        dgu = reference.activation_backward(gate_up.float(), w * dh_raw, activation, swiglu_limit).to(gate_up.dtype)
        if mx:
            dgu = mx_values(dgu, MX_ALONG_COLS)
        return gate_up.copy_(dgu) if in_place else dgu, (w * h.float()).to(gate_up.dtype), dw
    m, inter = dh_raw.shape
    dgu = gate_up if in_place else torch.empty_like(gate_up)
    wh = gate_up.new_empty(m, inter)
    dw = torch.empty(m, dtype=torch.float32, device=gate_up.device)
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    _lib().launch(
        f"mok_act_bwd_{activation}", gate_up, dh_raw, w_rows, dgu, wh, dw, sched.tile_expert, limit, int(mx),
        stream=_stream(),
    )  # fmt: skip
    return dgu, wh, dw


def fused_dact_supported(inter: int, activation: str) -> bool:
    """Whether dgrad_act runs these: the gate and up blocks of its 256-column tiles must not straddle I."""
    return inter % GEMM_TILE_N == 0 and activation in SUPPORTED_ACTIVATIONS


def _use_fused_dact(inter: int, activation: str, hidden: int, device: torch.device | None = None) -> bool:
    """Whether the dgrad of down runs with the activation backward in its epilogue (dgrad_act): on the
    clustered ping-pong kernel, where it is faster than the two kernels (H <= dact_max_k(device))."""
    return (hidden <= dact_max_k(device) and fused_dact_supported(inter, activation) and not _use_torch_gemm()
            and not _use_torch_act())


def use_fused_act(inter: int, activation: str, has_bias: bool, hidden: int) -> bool:
    """Whether the forward runs gate_up_act (the gate/up GEMM with the activation in its epilogue): where the
    clustered ping-pong kernel runs it, or the cooperative kernel with the whole tile in smem, whose idle
    producer warps hide the activation (H <= GEMM_FULL_EPI_MAX_K)."""
    return (hidden <= GEMM_FULL_EPI_MAX_K and fused_act_supported(inter, activation, has_bias)
            and not _use_torch_gemm() and not _use_torch_act())


def pairwise_sum(parts: torch.Tensor) -> torch.Tensor:
    """[n, M] -> [M]: sum over dim 0 by elementwise halving (p[:h] + p[h:2h], the odd one carried), so
    the order of the additions depends on n only: the same bits for a row wherever it sits (any M)."""
    while parts.shape[0] > 1:
        n, h = parts.shape[0], parts.shape[0] // 2
        halved = parts[:h] + parts[h:2 * h]
        parts = torch.cat([halved, parts[2 * h:]]) if n % 2 else halved
    return parts[0]


def dgrad_act(dy_rows, down_proj, gate_up, w_rows, sched: Schedule, activation: str, swiglu_limit,
              in_place: bool = False):
    """act_backward(gate_up, dy_rows @ W2[e], ...) in one kernel (mok_gemm_dact_<act>_ppc): the dgrad of down
    with the activation backward in its epilogue, so dh never goes to memory. d gate_up and w*h are
    bitwise what the two kernels give; dw sums per 128-column tile in the kernel, then pairwise_sum.
    in_place: d gate_up overwrites gate_up (each output tile's gate / up values are loaded into registers by the
    threads that then store that tile's d gate / d up; no other tile reads them)."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    if not fused_dact_supported(inter, activation):
        raise ValueError(f"mok_gemm_dact: needs I % {GEMM_TILE_N} == 0 and a SwiGLU activation, got I={inter}, "
                         f"{activation!r}")
    dgu = gate_up if in_place else torch.empty_like(gate_up)
    wh = gate_up.new_empty(m, inter)
    name = f"mok_gemm_dact_{activation}_ppc"
    tile_n = tile_n_of(name)
    parts = torch.empty(inter // tile_n, m, dtype=torch.float32, device=gate_up.device)
    if m == 0:
        return dgu, wh, parts.sum(dim=0)
    group_m = gemm_group_m(inter, tile_n)
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    _lib().launch(
        name, dy_rows.unsqueeze(-1), down_proj.permute(2, 1, 0), dgu.unsqueeze(-1),
        wh.unsqueeze(-1), gate_up.unsqueeze(-1), w_rows, parts, sched.tile_expert, sched.seg_end,
        sched.seg_rows_for(name), limit, group_m, stream=_stream(),
    )  # fmt: skip
    return dgu, wh, pairwise_sum(parts)


def dgrad_down_act(dy_rows: list, down_proj, gate_up, w_rows, sched: Schedule, activation: str, swiglu_limit,
                   in_place: bool = False, mx: bool = False):
    """(d gate_up bf16, w*h bf16, dw fp32 per row) from the dy rows in schedule order: dgrad_act where it
    runs these (_use_fused_dact), else mok_gemm_bn_f32_dyn + act_backward. in_place: d gate_up overwrites
    gate_up (the same bits). dy_rows: [the rows], emptied here: they are freed once the GEMM has read them (where
    the caller keeps no other reference), before the activation backward's outputs exist. mx: d gate_up as its
    MXFP8 values along its columns (by act_backward as it stores them; after dgrad_act, one pass)."""
    dy = dy_rows.pop()
    mx_cols = isinstance(down_proj, MxColumnWeight)  # (its kernel has no activation epilogue)
    if _use_fused_dact(gate_up.shape[1] // 2, activation, dy.shape[1], dy.device) and not mx_cols:
        dgu, wh, dw = dgrad_act(dy, down_proj, gate_up, w_rows, sched, activation, swiglu_limit, in_place)
        return (mx_values(dgu, MX_ALONG_COLS) if mx else dgu), wh, dw
    dh_raw = grouped_gemm(dy, down_proj, sched, transpose_w=True, out_dtype=torch.float32)
    del dy
    return act_backward(gate_up, dh_raw, w_rows, sched, activation, swiglu_limit, in_place, mx)


def segment_sum(rows: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """[E, N] per-expert column sums of rows [M_cap, N] (fixed order, via grouped_mm)."""
    ones = rows.new_ones(8, rows.shape[0])
    return torch._grouped_mm(ones, rows, offs=sched.seg_end)[:, 0, :]


# --------------------------------------------------------------------------
# precision="mxfp8": every expert GEMM takes its operands' MXFP8 values (docs/mxfp8.md)


class GemmOperands:
    """What the expert GEMMs take for a precision. "bf16": the tensors themselves. "mxfp8": their MXFP8 values
    ("rceil", blocks of 32) along each GEMM's reduction dimension, in bf16 (mx_values): an E4M3 value times its
    power-of-two scale is a bf16 value, so the bf16 kernels then compute the MX products exactly, with fp32
    sums, and every other step (activation, combine, top-k weight gradient, biases) keeps the unquantised
    values, as the definition says."""

    def __init__(self, precision: str, weight_bytes: bool = False):
        """weight_bytes: forward_weight may give trained weights as MXFP8 bytes (the one-GPU path's _mx kernels)."""
        if precision not in ("bf16", "mxfp8"):
            raise ValueError(f"precision must be 'bf16' or 'mxfp8', got {precision!r}")
        self.mxfp8 = precision == "mxfp8"
        self.weight_bytes = weight_bytes and self.mxfp8

    def tokens(self, t: torch.Tensor, sched: Schedule) -> torch.Tensor:
        """t [T, K] gathered into schedule order as a GEMM's rows, quantised along K: by the gather, once per
        source row (blocks lie inside a row: the same values, over T rows instead of the k-times-as-many rows)."""
        return gather_rows(t, sched, skip_tail=True, mx=self.mxfp8)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """Rows [M, K] in schedule order as a GEMM's A operand: along K."""
        return mx_values(t, MX_ALONG_COLS) if self.mxfp8 else t

    def weight(self, w: torch.Tensor, axis: int) -> torch.Tensor:
        """An expert weight [E, N, K] along `axis` (-1: K, the forward; -2: N, the backward's d x / d h),
        cached while the weight does not change (mxfp8.weight_values). An MxWeight (the forward's MXFP8-only
        weights) holds MXFP8 values along K already: itself."""
        if isinstance(w, MxWeight):
            if axis not in (-1, 2):
                raise ValueError("an MxWeight is read along K (the forward's GEMMs)")
            return w
        if isinstance(w, MxColumnWeight):
            if axis not in (-2, 1) or not self.mxfp8:
                raise ValueError("an MxColumnWeight stands for the values along N of precision='mxfp8'")
            return w
        return weight_values(w, axis, mx_weight) if self.mxfp8 else w

    def forward_weight(self, w: torch.Tensor, sched: Schedule, mx_kernel: str):
        """An expert weight [E, N, K] as a forward GEMM takes it (along K), mx_kernel the registry name of that
        GEMM's _mx form. With weight_bytes, a trained weight that this _mx kernel reads in this call
        (cuda_mx.reads_trained_bytes) comes as an MxWeight of mxfp8.quantize(w): one pass writing a byte a value,
        which the _mx kernel reads, where the values in bf16 cost a pass writing two and the bf16 kernel reads two;
        the same bits (the _mx kernels give the bf16 kernels' bits on dequantize(quantize(w)), i.e. on the values).
        Else weight(w, -1)."""
        if self.weight_bytes and cuda_mx.reads_trained_bytes(w, sched, mx_kernel) and not _use_torch_gemm():
            return weight_values(w, WEIGHT_BYTES, _weight_bytes)
        return self.weight(w, -1)

    def rows_and_segments(self, t: torch.Tensor, sched: Schedule) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows(t), segments(t)) of rows t [M_cap, K] that serve both a dgrad GEMM and a weight gradient (d
        gate_up): mxfp8 makes both from one read, the first in t's own memory (mx_values_both: t is
        overwritten); bf16: (t, t)."""
        if not self.mxfp8:
            return t, t
        segments = mx_values_both(t, sched)
        return t, segments

    def segments(self, t: torch.Tensor, sched: Schedule) -> torch.Tensor:
        """Rows [M_cap, N] in schedule order as an operand of a weight-gradient GEMM, which sums over the
        rows: blocks of 32 rows of each expert from its first row (its segment starts at a multiple of
        TILE_M); the rows that are not routed rows (padding, past the last segment) count as zeros, whatever
        a kernel left there."""
        return mx_values(t, MX_SEGMENTS, sched) if self.mxfp8 else t


WEIGHT_BYTES = "bytes"  # mxfp8.weight_values' key of a weight's MXFP8 bytes (beside its values along an axis)


def _weight_bytes(w: torch.Tensor, _key) -> MxWeight:
    q = quantize(w, -1)
    return MxWeight(q.data, q.scale)


# mok_mx_quant's modes (kernels/mx_quant.py); MX_COLS_AND_SEGMENTS: mx_values_both; MX_ROW_SEGMENTS: row_segments
MX_ALONG_COLS, MX_ALONG_ROWS, MX_SEGMENTS, MX_COLS_AND_SEGMENTS, MX_ROW_SEGMENTS = 0, 1, 2, 3, 4


def mx_values(t: torch.Tensor, mode: int, sched: Schedule | None = None) -> torch.Tensor:
    """The MXFP8 values of t [R, C] (bf16 on CUDA: mok_mx_quant; elsewhere and under MOK_ACT=torch,
    mxfp8.fake_quantize_fast, the same bits) in blocks of 32 along C (MX_ALONG_COLS) or R (MX_ALONG_ROWS;
    MX_SEGMENTS: rows in sched's order, the rows that are not routed rows as zeros)."""
    if mode == MX_SEGMENTS and sched is None:
        raise ValueError("mx_values: MX_SEGMENTS needs the schedule")
    rows, cols = t.shape
    if (cols if mode == MX_ALONG_COLS else rows) % 32:
        raise ValueError(f"mx_values: {tuple(t.shape)} has no whole blocks of 32 along the quantised axis")
    if not _mx_kernel_runs(t):
        if mode == MX_SEGMENTS:
            t = torch.where(real_rows(sched).unsqueeze(1), t, t.new_zeros(()))
        return fake_quantize_fast(t, -1 if mode == MX_ALONG_COLS else 0)
    t = t.contiguous()
    out = torch.empty_like(t)
    _launch_mx_quant(t, out, mode, sched)
    return out


def _launch_mx_quant(src: torch.Tensor, dst: torch.Tensor, mode: int, sched: Schedule | None) -> None:
    """mok_mx_quant on bf16 src [R, C] (contiguous; mode MX_ROW_SEGMENTS: any rows of 16-byte vectors) into dst
    [R, C] (MX_ROW_SEGMENTS: [M_cap, C]; MX_COLS_AND_SEGMENTS: into src too), its grid from the mode's work units;
    the schedule is read in the segment modes only."""
    rows, cols = dst.shape
    if dst.numel() == 0:
        return
    row_src = sched.row_token if mode == MX_ROW_SEGMENTS else _no_row_index(src.device)
    if mode in (MX_SEGMENTS, MX_COLS_AND_SEGMENTS, MX_ROW_SEGMENTS):
        te, se, sr = sched.tile_expert, sched.seg_end, sched.seg_rows
    else:
        te = se = sr = _cached_zero_tile(src.device)
    # work units (kernels/mx_quant.py): UNROLL vectors of 8 columns per thread, or a 32-row block of 2 columns
    units = -(-rows * cols // (8 * MX_QUANT_UNROLL)) if mode == MX_ALONG_COLS else rows // 32 * (cols // 2)
    grid = max(1, min(-(-units // MX_QUANT_THREADS), num_sms(src.device) * MX_QUANT_CTAS_PER_SM))
    _lib().launch("mok_mx_quant", src, dst, te, se, sr, row_src, mode, grid, stream=_stream())


@functools.lru_cache(maxsize=None)
def _no_row_index(device: torch.device) -> torch.Tensor:
    """A one-entry row_src [0] for the mok_mx_quant modes that take no row index (made once per device, as
    _cached_zero_tile: no allocation and fill on every launch)."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def row_segments(src: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """mx_values(gather_rows(src, sched), MX_SEGMENTS, sched): the rows of src [N, C] in schedule order (row
    sched.row_token[r], the padding rows zero) as a weight gradient's operand, in one mok_mx_quant pass where it
    runs (MX_ROW_SEGMENTS: it reads the routed rows of src, so no bf16 rows in schedule order are written and read
    first). src may be a column block of a wider matrix. Same bits either way: the kernel's mode is checked
    against the two passes on its first use in a process (cuda_mx.verified), and not used where they differ."""
    def two_passes():
        return mx_values(take_rows(src, sched.row_token, tile_expert=sched.tile_expert), MX_SEGMENTS, sched)

    if not (_mx_kernel_runs(src) and rows_of_16_byte_vectors(src)):
        return two_passes()

    def one_pass():
        out = torch.empty(sched.capacity, src.shape[1], dtype=src.dtype, device=src.device)
        _launch_mx_quant(src, out, MX_ROW_SEGMENTS, sched)
        return out

    return cuda_mx.verified("mok_mx_quant (row segments)", sched, one_pass, two_passes,
                            instead="the rows are gathered, then quantised")


def mx_values_both(t: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """Both MXFP8 operands of rows t [M_cap, C] in schedule order from one read: returns t's MX_SEGMENTS values
    (the weight gradient's operand) and overwrites t in place with its values along C (MX_ALONG_COLS, every row:
    a dgrad GEMM's A; t is then no longer the rows themselves). Same bits as the two mx_values calls."""
    rows, cols = t.shape
    if cols % 32 or rows % 32:
        raise ValueError(f"mx_values_both: {tuple(t.shape)} has no whole blocks of 32 along both axes")
    if not (_mx_kernel_runs(t) and t.is_contiguous()):
        segments = mx_values(t, MX_SEGMENTS, sched)
        t.copy_(mx_values(t, MX_ALONG_COLS))
        return segments
    out = torch.empty_like(t)
    _launch_mx_quant(t, out, MX_COLS_AND_SEGMENTS, sched)
    return out


def _mx_kernel_runs(t: torch.Tensor) -> bool:
    """mok_mx_quant runs on t: bf16 on CUDA with rows of 16-byte vectors, not under the MOK_ACT=torch oracle."""
    return t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[1] % 32 == 0 and not _use_torch_act()


def mx_weight(w: torch.Tensor, axis: int) -> torch.Tensor:
    """The MXFP8 values of an expert weight [E, N, K] along K (axis -1) or N (-2: blocks of 32 rows of [E N, K],
    none straddling two experts since N % 32 == 0). By Triton's fake_quantize where it runs (fake_quantize_fast:
    the same bits; on one H100, the benchmark shapes' weights, 7% faster than mok_mx_quant along K, 8-10% along N),
    else mok_mx_quant."""
    e, n, k = w.shape
    if axis not in (-1, 2, -2, 1) or n % 32:
        raise ValueError(f"mx_weight: axis {axis} of {tuple(w.shape)}")
    if triton_ops.runs_on(w) and not _use_torch_act():
        return fake_quantize_fast(w.detach(), 2 if axis in (-1, 2) else 1)
    mode = MX_ALONG_COLS if axis in (-1, 2) else MX_ALONG_ROWS
    return mx_values(w.detach().reshape(e * n, k), mode).view(e, n, k)


def real_rows(sched: Schedule) -> torch.Tensor:
    """[M_cap] bool: the routed rows (the first seg_rows of each expert's segment)."""
    start = torch.cat([sched.seg_end.new_zeros(1), sched.seg_end[:-1], sched.seg_end.new_zeros(1)]).long()
    count = torch.cat([sched.seg_rows, sched.seg_rows.new_zeros(1)]).long()  # rows past the last segment: none
    e = sched.expert_of_rows()
    return (torch.arange(sched.capacity, device=e.device) - start[e]) < count[e]


# --------------------------------------------------------------------------
# the experts


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    """(major, minor) of a CUDA device; cached: the query costs the host ~20 us per call."""
    return torch.cuda.get_device_capability(device_index)


def check_supported(x, topk_ids, gate_up_proj, down_proj, activation) -> str | None:
    """None where the CUDA path runs these inputs, else the reason it does not."""
    if not x.is_cuda:
        return f"input is on {x.device.type}, the fused kernels need a CUDA device"
    major, minor = _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if (major, minor) != (9, 0):
        return f"kernels are built for sm_90a, device is sm_{major}{minor}"
    for name, t in (("x", x), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dtype != torch.bfloat16:
            return f"{name} is {t.dtype}, the kernels take bfloat16"
    if activation not in SUPPORTED_ACTIVATIONS:
        return f"activation {activation!r} not supported"
    hidden, inter = down_proj.shape[1], down_proj.shape[2]
    if hidden % 8 or inter % 8:
        return "hidden and intermediate sizes must be multiples of 8"
    if topk_ids.dtype != torch.int64:
        return "topk_ids must be int64"
    if topk_ids.dim() == 2 and topk_ids.shape[1] > MAX_TOP_K:
        return f"top_k = {topk_ids.shape[1]}: the combine kernels take at most {MAX_TOP_K}"
    return None


@dataclass
class CudaSaved:
    """What the forward keeps for the backward: the schedule and gate_up. No x rows (k T x H values): the
    backward gathers x's rows again, a column block at a time, for the gate/up weight's gradient
    (gate_up_weight_grad)."""

    sched: Schedule
    gate_up: torch.Tensor  # [M_cap, 2I] bf16, schedule order


def experts_forward(
    x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None,
    activation="swiglu", swiglu_limit=None, sched: Schedule | None = None, precision: str = "bf16", needs=None,
):
    """Routed experts on one GPU. Returns (y [T, H] in x.dtype, CudaSaved). precision: "bf16", or "mxfp8"
    (every GEMM operand's MXFP8 values: GemmOperands). needs: accepted for the backends' common signature (the
    forward keeps the same tensors whatever the backward computes)."""
    why = check_supported(x, topk_ids, gate_up_proj, down_proj, activation)
    if why is not None:
        raise RuntimeError(f"mok_nn CUDA backend: {why}")
    q = GemmOperands(precision, weight_bytes=True)
    if sched is None:
        sched = make_schedule(topk_ids, gate_up_proj.shape[0])
    # x's rows (precision="mxfp8": of its MXFP8 values) feed the gate/up GEMM only: the tail past the last segment
    # stays unwritten. Gathered by the schedule's call (build_schedule) where it could, else here; not kept.
    a = sched.take_gathered(x, precision)
    if a is None:
        a = q.tokens(x.contiguous(), sched)
    rows = [a]
    del a  # (mlp_rows_forward holds the only reference, and frees the rows after the gate/up GEMM)
    out_rows, gate_up = mlp_rows_forward(rows, sched, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
                                         swiglu_limit, q)
    y = combine(out_rows, sched.pos, topk_weights, topk_ids, gate_up_proj.shape[0], x.dtype)
    return y, CudaSaved(sched, gate_up)


def mlp_rows_forward(rows: list, sched: Schedule, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
                     swiglu_limit, q: GemmOperands):
    """(out_rows [M_cap, H], gate_up [M_cap, 2I]): the experts' MLP of the rows a in schedule order (for
    precision="mxfp8" a holds the MXFP8 values already). rows: [a], emptied here: a is freed once the gate/up GEMM
    has read it (where the caller keeps no other reference), before the down GEMM's output exists (the forward's
    peak with frozen experts: by benchmarks/memory_model.py --frozen, qwen3-30b-a3b 0.975 -> 0.695 GiB, deepseek-v3
    3.74 -> 3.29)."""
    a = rows.pop()
    dtype = a.dtype
    fused = use_fused_act(down_proj.shape[2], activation, gate_up_bias is not None, a.shape[1])
    w13 = q.forward_weight(gate_up_proj, sched, f"mok_gemm_gate_up_{activation}_mx" if fused else "mok_gemm_bk_mx")
    if fused:  # (precision="mxfp8": h's MXFP8 values, made by the kernel where it can)
        gate_up, h_a = gate_up_act(a, w13, sched, activation, swiglu_limit, h_mx=q.mxfp8)
    else:
        gate_up = grouped_gemm(a, w13, sched, transpose_w=False)
        if gate_up_bias is not None:
            gate_up = (gate_up.float() + bias_rows(gate_up_bias, sched)).to(dtype)
        h_a = q.rows(act_forward(gate_up, sched, activation, swiglu_limit))
    del w13, a  # (precision="mxfp8": the gate/up weight's values go before the down weight's are made)
    out_rows = grouped_gemm(h_a, q.forward_weight(down_proj, sched, "mok_gemm_bk_mx"), sched, transpose_w=False)
    if down_bias is not None:
        out_rows = (out_rows.float() + bias_rows(down_bias, sched)).to(dtype)
    return out_rows, gate_up


def bias_rows(bias: torch.Tensor, sched: Schedule) -> torch.Tensor:
    b = torch.cat([bias.float(), bias.new_zeros(1, bias.shape[1], dtype=torch.float32)])
    return b.index_select(0, sched.expert_of_rows())


def experts_backward(
    grad_y, saved: CudaSaved, x, topk_ids, topk_weights, gate_up_proj, down_proj,
    gate_up_bias=None, down_bias=None, activation="swiglu", swiglu_limit=None, grads_into=None, needs=None,
    precision: str = "bf16", consume_saved: bool = False,
):
    """Backward of experts_forward. Returns (dx, d_topk_weights, GroupedMLPGrads; its grad_rows None: the d x
    rows are summed into dx and freed). grads_into: a GroupedMLPGrads whose parameter gradients this call adds
    to (reference.add_param_grads). needs: which parameter gradients to compute (reference.param_grads_needed;
    None: all): frozen ones are None and their weight-gradient GEMMs / bias sums are not launched. precision:
    the forward's. consume_saved: saved is used by this backward only (autograd does not keep the graph), so
    d gate_up overwrites saved.gate_up instead of taking a buffer of its own. The order of the steps:
    mlp_rows_backward."""
    q = GemmOperands(precision)
    sched = saved.sched
    num_tokens, top_k = topk_ids.shape
    into = (grads_into.gate_up_proj, grads_into.down_proj) if grads_into is not None else (None, None)
    ones = torch.ones(num_tokens, top_k, dtype=torch.float32, device=x.device)
    x = x.contiguous()

    dx, dw_rows, *param = mlp_rows_backward(
        grad_y.to(x.dtype).contiguous(), lambda t, skip_tail, mx=False: gather_rows(t, sched, skip_tail, mx),
        row_weights(sched, topk_weights), saved.gate_up, x,
        sched, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit, q, needs, into,
        lambda dx_rows: combine(dx_rows, sched.pos, ones, topk_ids, gate_up_proj.shape[0], x.dtype),
        consume_gate_up=consume_saved,
    )  # fmt: skip
    d_topk = dw_rows.index_select(0, sched.pos.reshape(-1)).view(num_tokens, top_k).to(topk_weights.dtype)
    return dx, d_topk, _grads(None, dw_rows, *param, grads_into)


def mlp_rows_backward(grad_out, gather, w_rows, gate_up, x, sched: Schedule, gate_up_proj, down_proj,
                      gate_up_bias, down_bias, activation, swiglu_limit, q: GemmOperands, needs, into, take_dx,
                      consume_gate_up: bool = False):
    """The backward of the experts' MLP on rows in schedule order, shared by the one-GPU path and the portable
    backend's local experts (cuda_local): returns (take_dx(d x rows), dw per row [M_cap] fp32, d gate_up_proj,
    d down_proj, d gate_up_bias, d down_bias), frozen ones None (needs: reference.param_grads_needed).

    grad_out [N, H]: the d y of the rows' sources (not scaled by w); gather(t, skip_tail, mx=False): t's rows in
    schedule order, zero on padding rows (skip_tail: the tail past the last segment may stay unwritten; mx: the
    rows of t's MXFP8 values along its columns, take_rows), its rows those of sched.row_token; w_rows [M_cap]
    fp32 the top-k weight of each row (0 on padding rows); x [N, H]: the input rows (read only for d gate_up_proj,
    a column block at a time: gate_up_weight_grad); into: (d gate_up_proj, d down_proj) to add to (macrobatch
    passes), or Nones; take_dx: what is made of the d x rows (summed per token, or read back per row) before they
    are freed; consume_gate_up: d gate_up overwrites gate_up (nothing reads it after this backward).

    Order, for the peak memory: the down weight's gradient right after the dgrad of down, so that the d y rows and
    w h are freed before the d x rows exist; the d x rows freed once taken, before the gate/up weight's gradient,
    whose x rows exist a column block at a time. With precision="mxfp8" the dgrad takes d y's MXFP8 values, and
    the weight gradients the values of d y's and x's rows along the rows, each made from d y / x in one pass
    (row_segments); d y's rows themselves only the bias terms need."""
    from . import reference

    need13, need2, need_b13, need_b2 = reference.param_grads_needed(needs)
    dt, wdt = gate_up.dtype, gate_up_proj.dtype
    # the d y rows themselves: bf16's GEMMs take them, and the bias terms read them after the dgrad
    keep_dy = (need2 and not q.mxfp8) or down_bias is not None
    dy_rows = None
    if keep_dy or not q.mxfp8:
        dy_rows = gather(grad_out, down_bias is None)  # (the down bias sums every row, the tail too)
    dy_a = [gather(grad_out, True, mx=True) if q.mxfp8 else dy_rows]  # (handed over: freed after its GEMM)
    if not keep_dy:
        dy_rows = None  # (the dgrad's operand alone)
    # frozen experts without a gate/up bias gradient need d gate_up only as the d x GEMM's operand: with mxfp8 the
    # activation backward stores its MXFP8 values straight away
    dgu_is_a = q.mxfp8 and not need13 and not (gate_up_bias is not None and need_b13)
    dgu, wh, dw_rows = dgrad_down_act(dy_a, q.weight(down_proj, -2), gate_up, w_rows, sched, activation,
                                      swiglu_limit, in_place=consume_gate_up, mx=dgu_is_a)
    del dy_a, gate_up
    if down_bias is not None:
        dw_rows = dw_rows + (dy_rows.float() * bias_rows(down_bias, sched)).sum(dim=1)
    d_down_bias = None
    if down_bias is not None and need_b2:
        d_down_bias = segment_sum((w_rows.unsqueeze(1) * dy_rows.float()).to(dt), sched).to(down_bias.dtype)
    d_down = None
    if need2:
        dy_w = q.segments(dy_rows, sched) if dy_rows is not None else row_segments(grad_out, sched)
        d_down = weight_grad_of(dy_w, q.segments(wh, sched), sched, wdt, into[1])
        del dy_w
    del dy_rows, wh
    d_gate_up_bias = None if gate_up_bias is None or not need_b13 else segment_sum(dgu, sched).to(gate_up_bias.dtype)
    # d gate_up's operands: the dgrad's along 2I, d gate_up_proj's per expert along the rows (mxfp8: one read,
    # the first into dgu's own memory)
    if dgu_is_a:
        dgu_a, dgu_w = dgu, None
    else:
        dgu_a, dgu_w = q.rows_and_segments(dgu, sched) if need13 else (q.rows(dgu), None)
    del dgu
    dx = take_dx(grouped_gemm(dgu_a, q.weight(gate_up_proj, -2), sched, transpose_w=True))
    del dgu_a
    d_gate_up = None
    if need13:
        def x_block(c0, c1):  # x's columns [c0, c1) in schedule order, as d gate_up_proj's GEMM takes them
            return row_segments(x[:, c0:c1], sched) if q.mxfp8 else gather(x[:, c0:c1], True)

        d_gate_up = gate_up_weight_grad(dgu_w, x_block, sched, gate_up_proj, into[0])
    return dx, dw_rows, d_gate_up, d_down, d_gate_up_bias, d_down_bias


# d gate_up_proj = dgu^T x_rows runs in column blocks of x, each block's x rows gathered just for its GEMM (the
# forward keeps no x rows): as few blocks as keep one block's rows within X_BLOCK_BYTES, at most
# X_MAX_COLUMN_BLOCKS, of whole GEMM_TILE_N tiles. Fewer blocks are faster (each block's GEMM has its own launch
# and tail: on an H100 qwen3-30b-a3b's backward took 3.00 ms in 2 blocks, 3.09 in 4, 2.91 in 1), more hold less:
# x's rows at 8192 tokens are 335 MB at qwen3-30b-a3b (2 blocks), 143 MB at mixtral-8x7b (1), 1.4 GB at
# deepseek-v3 (4) (benchmarks/memory_model.py gives the peaks).
X_BLOCK_BYTES = 192 << 20
X_MAX_COLUMN_BLOCKS = 4


def x_column_blocks(hidden: int, rows: int, elem_bytes: int = 2) -> list[tuple[int, int]]:
    """[c0, c1) column blocks of x (H = hidden; rows: the schedule's rows, elem_bytes a value's) for
    gate_up_weight_grad: as few blocks as hold at most X_BLOCK_BYTES of rows each, at most X_MAX_COLUMN_BLOCKS,
    of whole GEMM_TILE_N tiles (fewer where H is small, the last one shorter where H is not a multiple of the
    width)."""
    blocks = min(X_MAX_COLUMN_BLOCKS, max(1, -(-rows * hidden * elem_bytes // X_BLOCK_BYTES)))
    width = -(-hidden // (blocks * GEMM_TILE_N)) * GEMM_TILE_N
    return [(c0, min(c0 + width, hidden)) for c0 in range(0, hidden, width)]


def gate_up_weight_grad(dgu_w, x_cols, sched: Schedule, gate_up_proj, into=None):
    """d gate_up_proj [E, 2I, H] = dgu^T x_rows per expert (weight_grad_of), one column block of H at a time
    (x_column_blocks): x_cols(c0, c1) gives the rows of x's columns [c0, c1) in schedule order as this GEMM takes
    them (precision="mxfp8": their values along the rows, GemmOperands.segments), made for that block alone and
    freed after it. The same bits as one GEMM over every column: each output element's sum over the rows does
    not depend on the blocks, and every block runs the kernel the whole would (cols). dgu_w: d gate_up as this
    GEMM takes it (GemmOperands.rows_and_segments); into: added to instead (macrobatch passes), which is
    returned."""
    hidden = gate_up_proj.shape[2]
    grad = into
    if grad is None:
        grad = torch.empty(gate_up_proj.shape, dtype=gate_up_proj.dtype, device=dgu_w.device)
    for c0, c1 in x_column_blocks(hidden, sched.capacity):
        b = x_cols(c0, c1)
        block = grad[:, :, c0:c1]
        if into is not None:  # (added to the earlier passes' gradient)
            weight_grad_of(dgu_w, b, sched, grad.dtype, into=block, cols=hidden)
        else:
            weight_grad_of(dgu_w, b, sched, grad.dtype, out=block, cols=hidden)
        del b  # (this block's x rows, before the next block's are gathered)
    return grad


def weight_grad_of(a_rows, b_rows, sched: Schedule, wdt, into=None, out=None, cols: int | None = None):
    """d W = a_rows^T b_rows per expert (over sched.seg_rows real rows) in wdt, each operand as the GEMM takes
    it (precision="mxfp8": GemmOperands.segments); into: added to that gradient instead (the accumulating kernel,
    weight_grad(into=)), which is returned; out: written into this tensor (a column block of a gradient),
    which is returned; cols: weight_grad's."""
    if into is not None or out is not None:
        weight_grad(a_rows, b_rows, sched, sched.seg_rows, into=into, out=out, cols=cols)
        return into if into is not None else out
    return weight_grad(a_rows, b_rows, sched, sched.seg_rows, cols=cols).to(wdt)


def _grads(dx_rows, dw_rows, d_gate_up, d_down, d_gate_up_bias, d_down_bias, grads_into):
    """The GroupedMLPGrads of a backward; with grads_into, that one, whose weight gradients were added to in
    place, with the bias gradients added and this call's rows (reference.add_param_grads)."""
    from . import reference

    if grads_into is None:
        return reference.GroupedMLPGrads(dx_rows, dw_rows, d_gate_up, d_down, d_gate_up_bias, d_down_bias)
    biases = reference.GroupedMLPGrads(dx_rows, dw_rows, None, None, d_gate_up_bias, d_down_bias)
    return reference.add_param_grads(grads_into, biases, weights=False)


def param_grads(dy_rows, wh, dgu, x_rows, sched, wdt, dx_rows, dw_rows, d_gate_up_bias, d_down_bias, grads_into=None,
                needs=None):
    """GroupedMLPGrads of one backward (the EP path's): the weight gradients d down = dy_rows^T wh and
    d gate_up = dgu^T x_rows per expert (weight_grad_of), with the given bias gradients; grads_into: added to
    its parameter gradients instead. needs: (gate_up_proj, down_proj, ...) bools (reference.param_grads_needed;
    None: all): a frozen weight's gradient is None and its weight-gradient GEMM is not launched."""
    from . import reference

    need13, need2 = reference.param_grads_needed(needs)[:2]
    into13, into2 = (grads_into.gate_up_proj, grads_into.down_proj) if grads_into is not None else (None, None)
    d_down = weight_grad_of(dy_rows, wh, sched, wdt, into2) if need2 else None
    d_gate_up = weight_grad_of(dgu, x_rows, sched, wdt, into13) if need13 else None
    return _grads(dx_rows, dw_rows, d_gate_up, d_down, d_gate_up_bias, d_down_bias, grads_into)


# --------------------------------------------------------------------------
# entry points of the functional layer (mok_nn.functional, backend="cuda")


def unavailable_reason(x, topk_ids, gate_up_proj, down_proj, activation) -> str | None:
    """None where the kernels can run these operands here (library loaded), else why not.

    The one place that decides; the layer, mok_nn.ops and the integrations ask it.
    """
    why = check_supported(x, topk_ids, gate_up_proj, down_proj, activation)
    if why is not None:
        return why
    try:
        _lib()
    except Exception as err:  # noqa: BLE001 - any load failure means: not available
        return f"kernel library unavailable: {err}"
    return None


def unsupported_reason(layer, x: torch.Tensor) -> str | None:
    """None where the fused path runs this layer on x, else why not (backend="auto" logs it)."""
    e = layer.experts
    w13, w2 = e.gate_up_proj, e.down_proj
    if e.mxfp8_only:  # the GEMMs take W_q dequantised into x's dtype (autograd.expert_weights)
        w13, w2 = (torch.empty(t.shape, dtype=x.dtype, device="meta") for t in (w13, w2))
    return unavailable_reason(x, torch.empty(0, layer.top_k, dtype=torch.int64), w13, w2, layer.activation)


def init_workspace(ws) -> None:
    """Check what the kernels need; with expert parallelism, also check the group (cuda_ep)."""
    if ws.precision == "mxfp8" and ws.ep_size > 1:
        raise ValueError("precision='mxfp8' with expert parallelism has no CUDA path yet: use backend='torch'")
    if ws.activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"activation {ws.activation!r} has no CUDA kernel")
    if ws.ep_size > 1:
        from . import cuda_ep

        cuda_ep.init_workspace(ws)


def build_schedule(topk_ids: torch.Tensor, workspace, x: torch.Tensor | None = None) -> Schedule | None:
    # With EP the schedule needs every rank's routing; cuda_ep.forward builds it after the
    # all-gather it shares with the token exchange.
    if workspace.ep_size > 1:
        return None
    # x (the forward's tokens): gathered in schedule order by the same host call; with precision="mxfp8" its MXFP8
    # values (made by the gather), what the gate/up GEMM takes (the forward then gathers nothing)
    return make_schedule(topk_ids, workspace.num_experts, gather_x=x, gather_mx=workspace.precision == "mxfp8")


def forward(x, topk_ids, topk_weights, params, schedule, workspace, needs=None):
    if workspace.ep_size > 1:
        from . import cuda_ep

        return cuda_ep.forward(x, topk_ids, topk_weights, params, schedule, workspace)
    return experts_forward(
        x, topk_ids, topk_weights, *params.as_args(), workspace.activation, workspace.swiglu_limit, schedule,
        workspace.precision, needs,
    )


def backward(grad_y, saved, x, topk_ids, topk_weights, params, workspace, grads_into=None, needs=None,
             consume_saved=False):
    if workspace.ep_size > 1:
        from . import cuda_ep

        return cuda_ep.backward(grad_y, saved, x, topk_ids, topk_weights, params, workspace, grads_into, needs,
                                consume_saved)
    return experts_backward(
        grad_y, saved, x, topk_ids, topk_weights, *params.as_args(), workspace.activation, workspace.swiglu_limit,
        grads_into, needs, workspace.precision, consume_saved,
    )
