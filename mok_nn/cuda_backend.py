"""Routed experts on one CUDA GPU (EP = 1) with the CuTe DSL kernels.

Same signatures and formulas as reference.experts_forward / experts_backward
(see reference.py for the math). What runs where:

  schedule        mok_schedule_mc (per-chunk counts, one scan CTA, placement over many CTAs;
                  MOK_SCHEDULE=mc_pdl: overlapped launches, =single: the one-CTA mok_schedule,
                  =torch: torch ops); no host sync
  gather of x     mok_scatter_rows into the padded expert order (each x row read once, stored to its
                  slots' rows; zero padding rows; rows past the last segment not written;
                  MOK_GATHER_ROWS=kernel: mok_gather_rows, warp per row; =torch: index_select);
                  in the forward launched by the schedule's host call (mok_schedule_gather,
                  make_schedule(gather_x=); MOK_SCHEDULE_GATHER=0: its own launch)
  gate/up GEMM    mok_gemm_bk  (CuTe DSL varlen-M grouped GEMM, TMA + wgmma); with the activation in it
                  (MOK_GEMM_ACT, below): mok_gemm_gate_up_<act>_ppc where H <= 2048, _ef where H <= 8192
  activation      mok_act_fwd_<act> (one pass over gate_up)
  down GEMM       mok_gemm_bk; where I <= 1024 mok_gemm_bk_ppc (MOK_GEMM_PINGPONG, below); its cooperative
                  mok_gemm_bk_ef with dynamic tiles (mok_gemm_bk_ef_dyn, MOK_GEMM_TILES, below)
  combine         mok_combine_cp (top_k <= 16), mok_combine_k2 (top_k = 2), mok_combine (fixed tree over expert
                  groups, j ascending within a group; the same tree as the EP path's per-rank partial sums:
                  kernels/combine.py)
  dgrad of down   mok_gemm_bn_f32_dyn (fp32 out, feeds d topk-weight and dSwiGLU; dynamic tiles, MOK_GEMM_TILES)
  dSwiGLU, dw     mok_act_bwd_<act> (d gate_up, w*h and the per-row top-k weight gradient)
                  Where H <= 4096 (MOK_GEMM_DACT=auto): both in one kernel, mok_gemm_dact_<act>_ppc
                  (the dgrad GEMM with the activation backward in its epilogue, on the clustered
                  ping-pong kernel whose epilogue runs beside the MMA; I % 256 == 0; same d gate_up
                  and w*h bits, d topk-weight summed per 128 columns then pairwise_sum).
                  MOK_GEMM_DACT=fused / split force one form (the cooperative fused kernel,
                  mok_gemm_dact_<act> with MOK_GEMM_PINGPONG=0, is slower than the two kernels)
  dgrad gate/up   mok_gemm_bn; its cooperative mok_gemm_bn_ef with dynamic tiles (mok_gemm_bn_ef_dyn, MOK_GEMM_TILES)
  reverse combine the combine kernels (w = 1)
  weight grads    mok_gemm_wgrad_defer_c2 (varlen-K grouped GEMM over each expert's rows, on
                  2-CTA clusters sharing B by TMA multicast; WGRAD_KERNEL); mok_gemm_wgrad_pp where
                  experts have few rows and the output few columns (wgrad_kernel); macrobatch passes
                  after the first add into the first one's by its twin mok_gemm_wgrad_defer_c2_acc

MOK_GEMM_TILES: the cooperative GEMMs mok_gemm_bk_ef / mok_gemm_bn_ef / mok_gemm_bn_f32 with tiles
claimed by atomic add and the routed rows, so an all-padding consumer warp group skips its MMA
(their _dyn twins: gemm_tiles_suffix); auto (default): all three (DYNAMIC_TILES_AUTO); static: none.

Every step has a fixed reduction order, so results are bitwise reproducible.
Set MOK_GEMM=torch to run the GEMMs through torch._grouped_mm instead of the
CuTe kernels (weight gradients included), MOK_WGRAD=torch for the weight
gradients only (MOK_WGRAD_KERNEL=<registry name> picks a weight-gradient variant),
MOK_ACT=torch to run the activations with torch ops (debugging aids).
MOK_GEMM_EPI picks the epilogue of the bf16 grouped GEMMs: "full" (the whole
output tile staged in shared memory, stores drained during the next tile:
mok_gemm_bk_ef / mok_gemm_bn_ef), "split" (4 sub-tile buffers: mok_gemm_bk /
mok_gemm_bn), default "auto": full where K <= GEMM_FULL_EPI_MAX_K (measured on
H200: short K gains up to 10%, long K loses the fourth A/B stage). Same results
bitwise. MOK_GEMM_ACT=fused runs the forward's gate/up GEMM and activation as one kernel
(mok_gemm_gate_up_<act>[_ppc], I % 128 == 0, no gate/up bias; bitwise equal to the two
kernels); auto (default): where the clustered ping-pong kernel runs it (H <= 2048), and where H <= 8192
on the cooperative kernel whose idle producer warps compute the activation (mok_gemm_gate_up_<act>_ef).
MOK_GEMM_GATHER=1 runs the forward's gate/up GEMM on x itself: the kernel reads
each expert row's token through the schedule (mok_gemm_bk[_ef]_gather, cp.async),
so no permuted copy of x is made or saved for backward (the backward gathers x
rows for the weight gradient then). MOK_GEMM_GATHER_DY=1 does the same for the
backward's dgrad of down (mok_gemm_bn_f32_gather on d y, then mok_act_bwd: the fused
dSwiGLU GEMM has no gather variant; the dy rows are still gathered for the weight
gradient of down_proj). Same bits as the permuted copy (with MOK_GEMM_DACT=split);
off by default: on H200 the forward is 1-5% slower than with the copy, but the
activation memory is smaller (deepseek-v3, EP = 1: 0.86 vs 2.17 GB).
MOK_GEMM_PINGPONG picks the form of the bf16 grouped GEMMs and of the fused gate/up + activation
and dgrad + dSwiGLU kernels: "0" cooperative (both consumer warp groups on one 128 x 256 tile),
"1" ping-pong (_pp: each consumer warp group computes whole 128 x 128 tiles, so one's epilogue
runs beside the other's MMA), "cluster" ping-pong on 2-CTA clusters whose CTAs share A by TMA
multicast (_ppc), "auto" (default) _ppc where K is short (PINGPONG_AUTO_MAX_K). Same K order per
output element in every form: the same bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .envvars import getenv
from .kernels.registry import COMBINE_LEAVES, COMBINE_STAGED_ENTRIES, EP_COPY_THREADS, combine_leaves
from .kernels.registry import (
    GEMM_TILE_N, PINGPONG_TILE_N, SCHEDULE_MAX_EXPERTS, SCHEDULE_MC_MAX_CHUNKS, SCHEDULE_MC_WARPS, TILE_M, WGRAD_KERNELS, tile_n_of,
    WGRAD_ACC_KERNELS,
)  # fmt: skip
from .kernels import loader
from .kernels.registry import GEMM_GATHER_KERNELS, SPECS_BY_NAME

# Weight-gradient GEMM (MOK_WGRAD_KERNEL overrides): deferred epilogue on 2-CTA clusters sharing B.
# Fastest over the three benchmark shapes on H200, all variants bitwise equal
# (docs/benchmarks/2026-11-30_h200_ep1_v26_wgrad_cluster*.txt: 21.2 ms vs 22.4-23.3 for the others).
WGRAD_KERNEL = "mok_gemm_wgrad_defer_c2"
# Except where the experts have few rows and the output few columns (deepseek-v3's d down at EP = 1: 256 rows
# per expert, I = 2048 columns): there the ping-pong kernel, whose epilogue runs beside the other warp group's
# short mainloop, measured 4.12 vs 4.36 ms and 3.87 vs 4.15 (..._v70_wgrad_pp.txt, ..._v61_wgrad_pp.txt);
# qwen3's d down (512 rows per expert) and every d gate_up are slower with it. Same bits (tests/gpu).
WGRAD_SHORT_KERNEL = "mok_gemm_wgrad_pp"
WGRAD_SHORT_MAX_ROWS = 256  # mean routed rows per expert, at most
WGRAD_SHORT_MAX_COLS = 2048  # output columns (b_rows' width), at most
# Longest reduction for which the full-tile epilogue GEMM variants win on H200
# (bench_gemm_variants: deepseek K=2048/4096/7168 and qwen3 gain, mixtral K=14336/28672 loses).
GEMM_FULL_EPI_MAX_K = 8192
# MOK_GEMM_TILES=auto: the cooperative GEMMs that run with dynamic tiles (gemm_tiles_suffix): all three twins.
# Ranked by sustained readings (~1 s of back-to-back calls, the GPU at its power limit as in training;
# tests/gpu/diag_tail_skip.py --energy), deepseek-v3 on H200, static -> dynamic + skip: down 4.09-4.19 ->
# 3.97-3.98 ms, dgrad of down 4.07-4.12 -> 4.01, dgrad of gate/up (mok_gemm_bn_ef) 7.94-8.09 -> 7.73-7.74 (v181,
# v182); qwen3's dgrad of gate/up 0.80 -> 0.77. In the layer (v182, tests/gpu/diag_energy.py, two rounds) all
# dynamic vs the earlier auto (mok_gemm_bn_ef static): deepseek-v3 forward+backward 38.80 / 38.85 vs 39.05 / 39.11
# ms, qwen3 4.173 / 4.173 vs 4.192 / 4.196. Medians of 20-call bursts ranked the dgrad of gate/up the other way
# (v175, v178): they follow the GPU's clock state more than the kernel.
DYNAMIC_TILES_AUTO = frozenset({"mok_gemm_bk_ef", "mok_gemm_bn_ef", "mok_gemm_bn_f32"})
# MOK_SCHEDULE -> schedule kernel ("torch": make_schedule_torch); "" is the default
SCHEDULE_KERNELS = {"": "mok_schedule_mc", "mc": "mok_schedule_mc", "mc_pdl": "mok_schedule_mc_pdl",
                    "single": "mok_schedule"}

SUPPORTED_ACTIVATIONS = ("swiglu", "swiglu_oai")


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
    # (x, x_rows): x gathered in schedule order by the call that made the schedule (make_schedule(gather_x=x));
    # taken once (take_gathered), so the schedule does not keep x_rows alive after the forward
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
        """[E] int32 seg_rows for grouped GEMM `kernel`: the real rows for the ping-pong kernels (_pp, _ppc)
        where MOK_GEMM_HALF_TILES is on (half_tiles: a tile whose rows past the first 64 are all padding
        runs one 64-row MMA block) and for the kernels with dynamic tiles (_dyn: all-padding consumer warp groups skip
        their MMA, gemm_tiles_suffix), else the padded sizes (gemm_seg_rows). Same bits either way in every row
        that is read (the real rows; padding rows too where A's padding rows are zero, i.e. unless a gate/up
        bias made h's padding rows act(bias): the down GEMM's padding rows, which nothing reads, then differ)."""
        if (half_tiles() and kernel.endswith(("_pp", "_ppc"))) or kernel.endswith("_dyn"):
            return self.seg_rows
        return self.gemm_seg_rows()

    def take_gathered(self, x: torch.Tensor) -> torch.Tensor | None:
        """x_rows (= gather_rows(x, self, skip_tail=True)) where make_schedule gathered this very x, else None;
        forgets them either way."""
        gathered, self.gathered = self.gathered, None
        return gathered[1] if gathered is not None and gathered[0] is x else None

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
                  gather_x: torch.Tensor | None = None) -> Schedule:
    """Count -> pad -> prefix sum on the device, no host sync.

    On CUDA: mok_schedule_mc (multi-CTA); MOK_SCHEDULE=mc_pdl: the same with
    overlapping launches, =single: the one-CTA mok_schedule. All equal
    make_schedule_torch exactly. MOK_SCHEDULE=torch, CPU tensors or more than
    SCHEDULE_MAX_EXPERTS experts: make_schedule_torch. capacity: rows of the
    schedule (default the worst case, schedule_capacity; more only adds padding rows).
    gather_x [T, H]: also gather x in schedule order from the same host call where the default kernels run
    (mok_schedule_gather: mok_schedule_mc + mok_scatter_rows); the schedule holds the rows until
    take_gathered(x) takes them. Elsewhere nothing is gathered (take_gathered gives None).
    """
    num_tokens, top_k = topk_ids.shape
    dev = topk_ids.device
    cap = _checked_capacity(num_tokens, top_k, num_experts, capacity)
    mode = getenv("MOK_SCHEDULE", "")
    if mode != "torch" and mode not in SCHEDULE_KERNELS:
        raise ValueError(f"MOK_SCHEDULE={mode!r}: expected one of {sorted(SCHEDULE_KERNELS) + ['torch']}")
    if topk_ids.is_cuda and num_experts <= SCHEDULE_MAX_EXPERTS and mode != "torch":
        n = num_tokens * top_k
        name = SCHEDULE_KERNELS[mode]
        chunk, chunks = schedule_chunk(n)
        pos, row_token, tile_expert, seg_end, seg_rows, padded_rows, scratch = _schedule_buffers(
            n, cap, num_experts, 0 if name == "mok_schedule" else chunks * num_experts, dev)
        ids = topk_ids.reshape(-1).contiguous()
        outs = (ids, pos, row_token, tile_expert, seg_end, seg_rows, padded_rows)
        sched = Schedule(pos.view(num_tokens, top_k), row_token, tile_expert, seg_end, seg_rows,
                         padded_rows=padded_rows)
        if name == "mok_schedule":
            _lib().launch(name, *outs, top_k, stream=_stream())
            return sched
        if gather_x is not None and name == "mok_schedule_mc" and _gathers_with_schedule(gather_x, sched.pos):
            x_rows = torch.empty(cap, gather_x.shape[1], dtype=gather_x.dtype, device=dev)
            _lib().launch("mok_schedule_gather", *outs, scratch, top_k, chunk, gather_x, sched.pos, x_rows,
                          _scatter_rows_grid(num_tokens, cap, num_sms(dev)), stream=_stream())
            sched.gathered = (gather_x, x_rows)
        else:
            _lib().launch(name, *outs, scratch, top_k, chunk, stream=_stream())
        return sched
    return make_schedule_torch(topk_ids, num_experts, cap)


def _schedule_buffers(num_slots: int, capacity: int, num_experts: int, scratch: int, device) -> tuple:
    """(pos [num_slots] i64, row_token [capacity] i64, tile_expert [capacity / TILE_M] i32, seg_end, seg_rows,
    padded_rows [num_experts] i32, scratch [scratch] i32): make_schedule's buffers as views of one int32
    allocation, the two int64 ones first, so every view keeps the alignment its kernels take (8 and 4
    bytes, registry). Seven torch.empty calls cost the host ~4 us each where the GPU waits for the
    forward's first launch; one allocation, one split and two dtype views cost less."""
    sizes = (2 * num_slots, 2 * capacity, capacity // TILE_M, num_experts, num_experts, num_experts, scratch)
    parts = torch.empty(sum(sizes), dtype=torch.int32, device=device).split_with_sizes(sizes)
    return (parts[0].view(torch.int64), parts[1].view(torch.int64), *parts[2:])


def _gathers_with_schedule(x: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether make_schedule can gather x in the schedule's call: x holds the schedule's tokens (pos [T, k])
    and take_rows would run mok_scatter_rows on them (_gather_rows_kernel).
    MOK_SCHEDULE_GATHER=0: never (the gather gets its own launch, as before; the same bits)."""
    return (env_choice("MOK_SCHEDULE_GATHER", ("1", "0"), "1") == "1" and x.dim() == 2 and x.shape[0] == pos.shape[0] > 0
            and _gather_rows_kernel(x, pos) == "mok_scatter_rows")


def make_schedule_torch(topk_ids: torch.Tensor, num_experts: int, capacity: int | None = None) -> Schedule:
    """The same schedule from torch ops (CPU, or more experts than the kernel holds)."""
    num_tokens, top_k = topk_ids.shape
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    cap = _checked_capacity(num_tokens, top_k, num_experts, capacity)
    # scatter_add_ of ints, not bincount: bincount reads min/max back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
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
    return env_choice("MOK_GEMM", ("kernel", "torch"), "kernel") == "torch"


def _use_torch_wgrad() -> bool:
    return _use_torch_gemm() or env_choice("MOK_WGRAD", ("kernel", "torch"), "kernel") == "torch"


def _use_torch_act() -> bool:
    return env_choice("MOK_ACT", ("kernel", "torch"), "kernel") == "torch"


PINGPONG_MODES = ("auto", "0", "1", "cluster")  # MOK_GEMM_PINGPONG; the first is the default
# auto: the clustered ping-pong kernel (_ppc) where the reduction length K is at most this, per GEMM
# kind, else the cooperative one. Measured on H200 call by call (docs/kernels.md, "..._v55"):
# dgrad of down + dSwiGLU fused, K = H: qwen3 (2048) 0.50 vs 0.62 ms for the two kernels, mixtral
# (4096) 3.45 vs 4.11, deepseek-v3 (7168) 4.59 vs 4.50; gate/up + SwiGLU fused, K = H: qwen3 0.70 vs
# 0.75, mixtral 6.71 vs 6.75 (equal), deepseek-v3 11.5 vs 8.2; plain GEMMs: qwen3 down (K 768) 0.385
# vs 0.409, every K >= 1536 equal or slower.
PINGPONG_AUTO_MAX_K = {"gemm": 1024, "act": 2048, "dact": 4096}


def half_tiles() -> bool:
    """MOK_GEMM_HALF_TILES ("1", the default, or "0"): the ping-pong GEMMs (a warp group computes a whole
    128-row tile as two 64-row MMA blocks) skip the second block of a tile whose rows past the first 64
    are all padding (the last tile of an expert with at most 64 rows in it). Same bits in the rows that are
    read: the skipped block's accumulators keep the zeros that zero padding rows of A give (Schedule.seg_rows_for)."""
    return env_choice("MOK_GEMM_HALF_TILES", ("1", "0"), "1") == "1"


def env_choice(var: str, choices: tuple, default: str) -> str:
    """The setting in environment variable `var`: one of `choices`, `default` where unset or empty;
    any other value raises ValueError naming the variable."""
    mode = getenv(var, "")
    if mode and mode not in choices:
        raise ValueError(f"{var}={mode!r}: expected one of {choices}")
    return mode or default


def pingpong_suffix(kind: str, k: int) -> str:
    """Suffix of the grouped GEMM variant for a GEMM of this kind ("gemm": plain bf16, "act": gate/up +
    activation, "dact": dgrad of down + activation backward) and reduction length k, by
    MOK_GEMM_PINGPONG: "" (cooperative), "_pp" (ping-pong), "_ppc" (ping-pong on 2-CTA clusters
    sharing A). "auto" (default): _ppc where k <= PINGPONG_AUTO_MAX_K[kind]; "0", "1", "cluster": one
    form everywhere."""
    mode = env_choice("MOK_GEMM_PINGPONG", PINGPONG_MODES, PINGPONG_MODES[0])
    if mode == "auto":
        return "_ppc" if k <= PINGPONG_AUTO_MAX_K[kind] else ""
    return {"0": "", "1": "_pp", "cluster": "_ppc"}[mode]


def _fused_kernel(base: str, kind: str, k: int, tiles: int) -> str:
    """Registry name of a fused-epilogue GEMM: base + pingpong_suffix. The clustered kernels (_ppc) pair
    column tiles, and their epilogues write gate / up blocks by column: a last, unpaired tile would
    write into other columns, so with an odd count of column tiles the unclustered _pp kernel runs
    (I % 128 == 0 / I % 256 == 0, which fused_act_supported / fused_dact_supported require, keep it even)."""
    suffix = pingpong_suffix(kind, k)
    if suffix == "_ppc" and tiles % 2:
        suffix = "_pp"
    return base + suffix


def _fused_mode(var: str, kind: str, k: int) -> bool:
    """MOK_GEMM_ACT / MOK_GEMM_DACT: "fused", "split", or "auto" (default): fused where the ping-pong
    kernels run it (pingpong_suffix), and the gate/up + activation also where the cooperative kernel keeps
    its whole tile in smem (_full_epilogue: mok_gemm_gate_up_<act>_ef, whose helper warps hide the
    activation). The other cooperative fused kernels are slower than the two kernels."""
    mode = env_choice(var, ("auto", "fused", "split"), "auto")
    if mode == "auto":
        return pingpong_suffix(kind, k) != "" or (kind == "act" and _full_epilogue(k))
    return mode == "fused"



def _use_gather(var: str = "MOK_GEMM_GATHER") -> bool:
    return env_choice(var, ("0", "1"), "0") == "1" and not _use_torch_gemm()


def _lib():
    """The kernel library (loader.load: a dict lookup, no lock, once it is loaded)."""
    return loader.load("sm_90a")


# torch.cuda.current_stream().cuda_stream without building a torch.cuda.Stream (~5 us a call)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _stream() -> int:
    """cudaStream_t of the current stream of the current device."""
    if _raw_stream is None or _get_device is None or not torch.cuda.is_initialized():
        return torch.cuda.current_stream().cuda_stream  # CPU builds; CUDA not initialised yet
    return _raw_stream(_get_device())


# MOK_GATHER_ROWS (first: the default). mok_gather_rows ("kernel") measured faster than index_select call by
# call on H200 (docs/benchmarks/..._v65_gather_rows.txt) and in the qwen3 layer (..._v66_gatherrows_modes);
# mok_scatter_rows faster than it (..._v89_gather_rows_276e9aa.txt, the layer's rows, 8 CTAs per SM: qwen3
# 0.099 vs 0.126 ms at EP = 1, deepseek-v3 0.379 vs 0.519; EP = 2, whose source does not fit in L2, 0.107 vs
# ~0.12 and 0.375 vs 0.495; mixtral 0.070 vs 0.071) and in the EP = 2 layer forward (..._v89_scatter_modes).
GATHER_ROWS_MODES = ("scatter", "kernel", "torch")
GATHER_CTAS_PER_SM = 8  # grid of mok_gather_rows / mok_scatter_rows: CTAs of 8 warps per SM (8 <= 4 in v89)


def gather_rows(x: torch.Tensor, sched: Schedule, skip_tail: bool = False) -> torch.Tensor:
    """x rows in schedule order [M_cap, H]; padding rows (row_token = T) are zero. skip_tail: the rows of
    the tiles past the last segment are left unwritten (see take_rows)."""
    return take_rows(x, sched.row_token, slots=sched.pos, tile_expert=sched.tile_expert if skip_tail else None)


def take_rows(src: torch.Tensor, idx: torch.Tensor, has_zero_row: bool = False,
              slots: torch.Tensor | None = None, tile_expert: torch.Tensor | None = None) -> torch.Tensor:
    """[len(idx), H]: row idx[r] of src, a zero row where idx[r] == src rows (the padding rows of a
    schedule), or, has_zero_row, src's own last row (zero, as the EP tokens sections keep it) where
    idx[r] points there.

    tile_expert (a schedule's, one entry per TILE_M rows): the kernels leave the rows of tiles with
    tile_expert < 0 (past the last segment) unwritten. Only for rows that nothing but the GEMMs and the
    weight gradients read (both stop at the last segment): at EP > 1 with the default capacity these
    are about half the rows, zero-filled for nothing otherwise. The torch path writes them anyway.

    MOK_GATHER_ROWS: 'scatter' (default on CUDA: mok_scatter_rows, warp per src row, read once and stored
    to each of its rows, then the zero rows; needs slots [N, k], the row of each slot (u, j) of src row u,
    as Schedule.pos / EPSchedule.token_slots give it; without them, or k > 32, the gather kernel), 'kernel'
    (mok_gather_rows: warp per dst row) or 'torch' (index_select, after a cat of a zero row unless
    has_zero_row; also on CPU). Same bits in every written row."""
    name = _gather_rows_kernel(src, slots)
    if name is not None:
        out = torch.empty(idx.shape[0], src.shape[1], dtype=src.dtype, device=src.device)
        if not idx.shape[0]:
            return out
        tiles = tile_expert if tile_expert is not None else _cached_zero_tile(src.device)
        if name == "mok_scatter_rows":
            grid = _scatter_rows_grid(slots.shape[0], idx.shape[0], num_sms(src.device))
            _lib().launch(name, src, slots.contiguous(), idx, tiles, out, grid, stream=_stream())
        else:
            grid = row_copy_grid(idx.shape[0], num_sms(src.device), GATHER_CTAS_PER_SM)
            _lib().launch(name, src, idx, tiles, out, grid, stream=_stream())
        return out
    if has_zero_row:
        return src.index_select(0, idx)
    return torch.cat([src, src.new_zeros(1, src.shape[1])]).index_select(0, idx)


def _gather_rows_kernel(src: torch.Tensor, slots: torch.Tensor | None) -> str | None:
    """The kernel take_rows runs on src (MOK_GATHER_ROWS): mok_scatter_rows where slots [N, k] are given,
    k <= 32 and N <= src rows, else mok_gather_rows; None where index_select runs (=torch, CPU, or rows
    that are not 16-byte vectors)."""
    mode = env_choice("MOK_GATHER_ROWS", GATHER_ROWS_MODES, GATHER_ROWS_MODES[0])
    if not (src.is_cuda and mode != "torch" and rows_of_16_byte_vectors(src)):
        return None
    if mode == "scatter" and slots is not None and slots.shape[1] <= 32 and slots.shape[0] <= src.shape[0]:
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
    """rows r: a[r] @ W[e(r)]^T (transpose_w=False, W [E, N, K]) or a[r] @ W[e(r)] (True, W [E, K, N])."""
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
    name = gemm_kernel(transpose_w, out_dtype, k=a.shape[1])
    launch_gemm(name + gemm_tiles_suffix(name), a, b, out, sched)
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


def grouped_gemm_gather(x: torch.Tensor, w: torch.Tensor, sched: Schedule, transpose_w: bool, out_dtype=torch.bfloat16):
    """grouped_gemm(gather_rows(x, sched), w, sched, ...) without the permuted copy: the kernel
    (mok_gemm_*_gather) reads row r of A as x[sched.row_token[r]], zero-filled where that is T (padding)."""
    if _use_torch_gemm() or x.shape[0] == 0:
        return grouped_gemm(gather_rows(x, sched), w, sched, transpose_w, out_dtype)
    x = x.contiguous()
    if x.data_ptr() % 16:  # a view at an odd offset: the kernel's 16-byte copies need an aligned base
        x = x.clone()
    n = w.shape[2] if transpose_w else w.shape[1]
    out = torch.empty(sched.capacity, n, dtype=out_dtype, device=x.device)
    b = w.permute(2, 1, 0) if transpose_w else w.permute(1, 2, 0)  # as grouped_gemm
    name = gemm_kernel(transpose_w, out_dtype, k=x.shape[1], pingpong=False) + "_gather"
    if name not in GEMM_GATHER_KERNELS:
        raise ValueError(f"no gather variant {name} (have {GEMM_GATHER_KERNELS})")
    _lib().launch(
        name, x.unsqueeze(-1), sched.row_token, b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end,
        sched.gemm_seg_rows(), gemm_group_m(n), stream=_stream(),
    )  # fmt: skip
    return out


def fused_act_supported(inter: int, activation: str, has_bias: bool) -> bool:
    """Whether gate_up_act runs these (the SwiGLU-epilogue GEMM): I a multiple of its 128-column halves."""
    return inter % (GEMM_TILE_N // 2) == 0 and activation in SUPPORTED_ACTIVATIONS and not has_bias


def gate_up_act(a: torch.Tensor, w: torch.Tensor, sched: Schedule, activation: str, swiglu_limit):
    """(gate_up [M, 2I], h [M, I]) bf16: a[r] @ W13[e(r)]^T and act of it in one kernel.

    Rows past the last segment are left unwritten (as act_forward leaves h).
    """
    m, two_i = a.shape[0], w.shape[1]
    gate_up = torch.empty(m, two_i, dtype=torch.bfloat16, device=a.device)
    h = torch.empty(m, two_i // 2, dtype=torch.bfloat16, device=a.device)
    base = f"mok_gemm_gate_up_{activation}"
    name = _fused_kernel(base, "act", a.shape[1], two_i // 2 // (PINGPONG_TILE_N // 2))
    if name == base and _full_epilogue(a.shape[1]):  # the cooperative kernel: whole tile in smem (_ef)
        name += "_ef"
    group_m = gemm_group_m(two_i, tile_n_of(name))
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    _lib().launch(
        name, a.unsqueeze(-1), w.permute(1, 2, 0), gate_up.unsqueeze(-1),
        h.unsqueeze(-1), sched.tile_expert, sched.seg_end, sched.seg_rows_for(name), limit, group_m, stream=_stream(),
    )  # fmt: skip
    return gate_up, h


def gemm_kernel(
    transpose_w: bool, out_dtype=torch.bfloat16, epi: str | None = None, k: int = 0, pingpong: bool = True,
) -> str:
    """Registry name of the grouped GEMM variant; epi "split", "full" or "auto" (MOK_GEMM_EPI).

    auto: full where the reduction length k is at most GEMM_FULL_EPI_MAX_K. pingpong: the ping-pong form of
    a bf16 output where MOK_GEMM_PINGPONG picks one (pingpong_suffix), whatever epi says (it keeps the
    tile whole); False: always a cooperative kernel (callers that append a hook or gather suffix).
    """
    if out_dtype == torch.float32:
        return "mok_gemm_bn_f32"  # an fp32 output tile does not fit smem whole: split only
    suffix = pingpong_suffix("gemm", k) if pingpong else ""
    if suffix:
        return ("mok_gemm_bn" if transpose_w else "mok_gemm_bk") + suffix
    name = "mok_gemm_bn" if transpose_w else "mok_gemm_bk"
    return name + "_ef" if _full_epilogue(k, epi) else name


def _full_epilogue(k: int, epi: str | None = None) -> bool:
    """Whether a cooperative bf16 GEMM of reduction length k keeps its whole output tile in smem (the _ef
    kernels): epi, else MOK_GEMM_EPI, "split", "full" or "auto" (full where k <= GEMM_FULL_EPI_MAX_K)."""
    epi = epi or getenv("MOK_GEMM_EPI", "auto")
    if epi not in ("split", "full", "auto"):
        raise ValueError(f"MOK_GEMM_EPI={epi!r}: expected split, full or auto")
    if epi == "auto":
        return k <= GEMM_FULL_EPI_MAX_K
    return epi == "full"


def launch_gemm(name: str, a, b, out, sched: Schedule) -> None:
    """One varlen-M grouped GEMM: a [M, K], b [N, K, E] (a strided view), out [M, N]. A _dyn kernel gets a
    fresh zeroed tile counter (its CTAs claim tiles from it)."""
    counter = (torch.zeros(1, dtype=torch.int32, device=a.device),) if name.endswith("_dyn") else ()
    _lib().launch(
        name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end, sched.seg_rows_for(name),
        gemm_group_m(out.shape[1], tile_n_of(name)), *counter, stream=_stream(),
    )  # fmt: skip


TILES_MODES = ("auto", "static", "dynamic")  # MOK_GEMM_TILES; the first is the default


def gemm_tiles_suffix(name: str) -> str:
    """"_dyn" where grouped GEMM variant `name` should run with dynamic tiles, else "", by MOK_GEMM_TILES:
    "static" (tile t on CTA t mod grid, padded seg_rows: every warp group runs its MMA), "dynamic" (the
    _dyn twin where the registry has one, i.e. mok_gemm_bk_ef, mok_gemm_bn_ef, mok_gemm_bn_f32: each CTA
    claims its next tile by atomic add, and a consumer warp group whose 64 rows are all padding skips its
    MMA, Schedule.seg_rows_for), "auto" (default): DYNAMIC_TILES_AUTO. Same bits in every row that is read."""
    mode = env_choice("MOK_GEMM_TILES", TILES_MODES, TILES_MODES[0])
    if (name + "_dyn") not in SPECS_BY_NAME:
        return ""
    if mode == "dynamic" or (mode == "auto" and name in DYNAMIC_TILES_AUTO):
        return "_dyn"
    return ""


def band_rule(n: int, tile_n: int = GEMM_TILE_N) -> int:
    """Row tiles per raster band of a GEMM with n output columns. Measured on H200: column
    tiles fastest (1) unless the columns span more than 32 tiles (mixtral's gate/up: bands of 8)."""
    return 8 if (n + tile_n - 1) // tile_n > 32 else 1


def gemm_group_m(n: int, tile_n: int = GEMM_TILE_N) -> int:
    """The varlen-M grouped GEMMs' raster (their group_m argument) for n output columns, by MOK_GEMM_RASTER:
    "expert" 0, one band per expert with its row tiles fastest, so the tiles sharing a B column stripe run
    in the same wave of CTAs (grouped_gemm._tile_coord_one); "bands" band_rule's bands (column tiles
    fastest, or bands of 8 row tiles); "auto" (default) expert bands where band_rule would run column tiles
    fastest, else its bands of 8. Measured on H200 (v169): deepseek-v3's gate/up, down and dgrad of gate/up
    3-5% faster call by call, its forward ~2% faster in the layer; qwen3 equal; the same bits."""
    mode = env_choice("MOK_GEMM_RASTER", ("auto", "expert", "bands"), "auto")
    bands = band_rule(n, tile_n)
    if mode == "expert" or (mode == "auto" and bands == 1):
        return 0
    return bands


def expert_row_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32: routed rows per expert (integer adds: order-free, exact)."""
    flat = topk_ids.reshape(-1)
    ones = torch.ones_like(flat, dtype=torch.int32)
    return torch.zeros(num_experts, dtype=torch.int32, device=flat.device).scatter_add_(0, flat, ones)


def weight_grad(a_rows: torch.Tensor, b_rows: torch.Tensor, sched: Schedule, counts: torch.Tensor,
                into: torch.Tensor | None = None) -> torch.Tensor:
    """[E, Na, Nb] bf16: per expert e, a_rows[seg e]^T @ b_rows[seg e] (fp32 accumulation, rows ascending).

    a_rows [M_cap, Na], b_rows [M_cap, Nb] in schedule order with zero padding rows;
    counts [E] int32 real rows per expert (the kernel stops at the 16-row k-block holding the last one).
    into: add the (bf16-rounded) result into this [E, Na, Nb] tensor and return it (macrobatch passes):
    by the accumulating twin of the kernel where it has one (WGRAD_ACC_KERNELS: the stores add in L2,
    no second gradient buffer), else computed apart and added (bf16 round of the sum either way).
    """
    name = getenv("MOK_WGRAD_KERNEL") or wgrad_kernel(sched, b_rows.shape[1], into is not None)
    if name not in WGRAD_KERNELS:  # (checked first: also where MOK_WGRAD=torch or an accumulation ignores it)
        raise ValueError(f"MOK_WGRAD_KERNEL={name!r} is not a weight-gradient kernel; one of {WGRAD_KERNELS}")
    acc_name = WGRAD_ACC_KERNELS.get(name)
    if into is not None and (_use_torch_wgrad() or acc_name is None or not _accumulates_in_place(into)):
        return into.add_(weight_grad(a_rows, b_rows, sched, counts).to(into.dtype))
    if _use_torch_wgrad():
        return torch._grouped_mm(a_rows.t(), b_rows, offs=sched.seg_end)
    na, nb = a_rows.shape[1], b_rows.shape[1]
    if into is None:
        out = torch.empty(sched.num_experts, na, nb, dtype=torch.bfloat16, device=a_rows.device)
    else:
        out, name = into, acc_name
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


def _accumulates_in_place(t: torch.Tensor) -> bool:
    """The accumulating kernel can add into t: a contiguous bf16 CUDA tensor (as the gradients it made)."""
    return t.is_cuda and t.dtype == torch.bfloat16 and t.is_contiguous()


def wgrad_group_m(name: str, nb: int) -> int:
    """Row tiles (row-tile pairs in the clustered kernels) per raster band of weight-gradient kernel `name`
    with nb output columns: MOK_WGRAD_GROUP_M, else 8 where the columns span more than 32 tiles, else 1
    (column tiles fastest)."""
    forced = getenv("MOK_WGRAD_GROUP_M", "")
    if forced and not (forced.isdigit() and int(forced) > 0):
        raise ValueError(f"MOK_WGRAD_GROUP_M={forced!r}: expected a positive integer")
    return int(forced) if forced else band_rule(nb, tile_n_of(name))


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
    # The same bits from each (kernels/combine.py); call by call on H200 (docs/kernels.md, v148-v149): top-2
    # (mixtral) 0.091 ms with the kernel compiled for two slots, 0.102 staged, 0.117 plain; top-8 staged
    # qwen3 0.097 vs 0.104, deepseek-v3 0.288 vs 0.308.
    # MOK_COMBINE=plain: mok_combine everywhere (the kernel before the fourteenth session; for side-by-side runs)
    k = pos.shape[1]
    name = "mok_combine_k2" if k == 2 else "mok_combine_cp" if k <= COMBINE_STAGED_ENTRIES else "mok_combine"
    if env_choice("MOK_COMBINE", ("auto", "plain"), "auto") == "plain":
        name = "mok_combine"
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


def act_backward(gate_up, dh_raw, w_rows, sched: Schedule, activation: str, swiglu_limit):
    """(d gate_up bf16, w*h bf16, dw fp32 per row) from the saved gate_up and dh = dy @ W2[e]."""
    if _use_torch_act():
        from . import reference

        h = reference.activation_forward(gate_up.float(), activation, swiglu_limit).to(gate_up.dtype)
        w = w_rows.unsqueeze(1)
        dw = (dh_raw * h.float()).sum(dim=1)
        dgu = reference.activation_backward(gate_up.float(), w * dh_raw, activation, swiglu_limit).to(gate_up.dtype)
        return dgu, (w * h.float()).to(gate_up.dtype), dw
    m, inter = dh_raw.shape
    dgu = torch.empty_like(gate_up)
    wh = gate_up.new_empty(m, inter)
    dw = torch.empty(m, dtype=torch.float32, device=gate_up.device)
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    _lib().launch(
        f"mok_act_bwd_{activation}", gate_up, dh_raw, w_rows, dgu, wh, dw, sched.tile_expert, limit,
        stream=_stream(),
    )  # fmt: skip
    return dgu, wh, dw


def fused_dact_supported(inter: int, activation: str) -> bool:
    """Whether dgrad_act runs these: the gate and up blocks of its 256-column tiles must not straddle I."""
    return inter % GEMM_TILE_N == 0 and activation in SUPPORTED_ACTIVATIONS


def _use_fused(var: str, kind: str, hidden: int, supported: bool) -> bool:
    """A fused-epilogue kernel runs: chosen by var (_fused_mode, checked first so that a bad value always
    raises), the CuTe GEMM and act kernels in use (not MOK_GEMM / MOK_ACT=torch), the shapes supported."""
    return _fused_mode(var, kind, hidden) and not _use_torch_gemm() and not _use_torch_act() and supported


def _use_fused_dact(inter: int, activation: str, hidden: int) -> bool:
    return _use_fused("MOK_GEMM_DACT", "dact", hidden, fused_dact_supported(inter, activation))


def use_fused_act(inter: int, activation: str, has_bias: bool, hidden: int) -> bool:
    """Whether the forward runs gate_up_act (MOK_GEMM_ACT; the gate/up GEMM with the activation in its epilogue)."""
    return _use_fused("MOK_GEMM_ACT", "act", hidden, fused_act_supported(inter, activation, has_bias))


def pairwise_sum(parts: torch.Tensor) -> torch.Tensor:
    """[n, M] -> [M]: sum over dim 0 by elementwise halving (p[:h] + p[h:2h], the odd one carried), so
    the order of the additions depends on n only: the same bits for a row wherever it sits (any M)."""
    while parts.shape[0] > 1:
        n, h = parts.shape[0], parts.shape[0] // 2
        halved = parts[:h] + parts[h:2 * h]
        parts = torch.cat([halved, parts[2 * h:]]) if n % 2 else halved
    return parts[0]


def dgrad_act(dy_rows, down_proj, gate_up, w_rows, sched: Schedule, activation: str, swiglu_limit):
    """act_backward(gate_up, dy_rows @ W2[e], ...) in one kernel (mok_gemm_dact_<act>): the dgrad of down
    with the activation backward in its epilogue, so dh never goes to memory. d gate_up and w*h are
    bitwise what the two kernels give; dw sums per 256-column tile (ping-pong: 128) in the kernel, then
    pairwise_sum."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    if not fused_dact_supported(inter, activation):
        raise ValueError(f"mok_gemm_dact: needs I % {GEMM_TILE_N} == 0 and a SwiGLU activation, got I={inter}, "
                         f"{activation!r}")
    dgu = torch.empty_like(gate_up)
    wh = gate_up.new_empty(m, inter)
    name = _fused_kernel(f"mok_gemm_dact_{activation}", "dact", dy_rows.shape[1], inter // PINGPONG_TILE_N)
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


def dgrad_down_act(dy_rows, down_proj, gate_up, w_rows, sched: Schedule, activation: str, swiglu_limit):
    """(d gate_up bf16, w*h bf16, dw fp32 per row) from the dy rows in schedule order: mok_gemm_bn_f32 +
    act_backward, or with MOK_GEMM_DACT=fused dgrad_act where it runs these."""
    if _use_fused_dact(gate_up.shape[1] // 2, activation, dy_rows.shape[1]):
        return dgrad_act(dy_rows, down_proj, gate_up, w_rows, sched, activation, swiglu_limit)
    dh_raw = grouped_gemm(dy_rows, down_proj, sched, transpose_w=True, out_dtype=torch.float32)
    return act_backward(gate_up, dh_raw, w_rows, sched, activation, swiglu_limit)


def segment_sum(rows: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """[E, N] per-expert column sums of rows [M_cap, N] (fixed order, via grouped_mm)."""
    ones = rows.new_ones(8, rows.shape[0])
    return torch._grouped_mm(ones, rows, offs=sched.seg_end)[:, 0, :]


# --------------------------------------------------------------------------
# the experts


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    """(major, minor) of a CUDA device; cached: the query costs the host ~20 us per call."""
    return torch.cuda.get_device_capability(device_index)


def check_supported(x, topk_ids, gate_up_proj, down_proj, activation) -> str | None:
    """None where the CUDA path runs these inputs, else the reason it does not."""
    if not x.is_cuda:
        return "inputs are not on a CUDA device"
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
    sched: Schedule
    x_rows: torch.Tensor | None  # [M_cap, H] x in schedule order (zero padding rows), for the weight
    # gradient; None where the forward gathered inside the GEMM (MOK_GEMM_GATHER=1): backward gathers then
    gate_up: torch.Tensor  # [M_cap, 2I] bf16, schedule order


def experts_forward(
    x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None,
    activation="swiglu", swiglu_limit=None, sched: Schedule | None = None,
):
    """Routed experts on one GPU. Returns (y [T, H] in x.dtype, CudaSaved)."""
    why = check_supported(x, topk_ids, gate_up_proj, down_proj, activation)
    if why is not None:
        raise RuntimeError(f"mok_nn CUDA backend: {why}")
    if sched is None:
        sched = make_schedule(topk_ids, gate_up_proj.shape[0])
    gather = _use_gather()
    fused = use_fused_act(down_proj.shape[2], activation, gate_up_bias is not None, x.shape[1])
    # The SwiGLU-epilogue GEMM has no gather variant: it gets the permuted copy (not saved with gather).
    # (x_rows feeds the gate/up GEMM and the weight gradient only: the tail past the last segment stays unwritten)
    x_rows = sched.take_gathered(x)  # gathered by the schedule's call (build_schedule), or None
    if x_rows is None and not (gather and not fused):
        x_rows = gather_rows(x.contiguous(), sched, skip_tail=True)
    if fused:
        gate_up, h = gate_up_act(x_rows, gate_up_proj, sched, activation, swiglu_limit)
    else:
        if gather:
            gate_up = grouped_gemm_gather(x, gate_up_proj, sched, transpose_w=False)
        else:
            gate_up = grouped_gemm(x_rows, gate_up_proj, sched, transpose_w=False)
        if gate_up_bias is not None:
            gate_up = (gate_up.float() + _bias_rows(gate_up_bias, sched)).to(x.dtype)
        h = act_forward(gate_up, sched, activation, swiglu_limit)
    out_rows = grouped_gemm(h, down_proj, sched, transpose_w=False)
    if down_bias is not None:
        out_rows = (out_rows.float() + _bias_rows(down_bias, sched)).to(x.dtype)
    y = combine(out_rows, sched.pos, topk_weights, topk_ids, gate_up_proj.shape[0], x.dtype)
    return y, CudaSaved(sched, None if gather else x_rows, gate_up)


def _bias_rows(bias: torch.Tensor, sched: Schedule) -> torch.Tensor:
    b = torch.cat([bias.float(), bias.new_zeros(1, bias.shape[1], dtype=torch.float32)])
    return b.index_select(0, sched.expert_of_rows())


def experts_backward(
    grad_y, saved: CudaSaved, x, topk_ids, topk_weights, gate_up_proj, down_proj,
    gate_up_bias=None, down_bias=None, activation="swiglu", swiglu_limit=None, grads_into=None,
):
    """Backward of experts_forward. Returns (dx, d_topk_weights, GroupedMLPGrads).
    grads_into: a GroupedMLPGrads whose parameter gradients this call adds to (reference.add_param_grads)."""
    sched, gate_up = saved.sched, saved.gate_up
    num_tokens, top_k = topk_ids.shape
    gy = grad_y.to(x.dtype).contiguous()
    gather_dy = _use_gather("MOK_GEMM_GATHER_DY")
    # with gather_dy, the dy rows are gathered only where they are needed (less memory alive at once)
    # zero on padding rows; the tail past the last segment unwritten unless the down bias sums the rows
    dy_skip = down_bias is None
    dy_rows = None if gather_dy else gather_rows(gy, sched, skip_tail=dy_skip)
    w_rows = row_weights(sched, topk_weights)
    if gather_dy:  # (the fused dSwiGLU GEMM has no gather variant)
        dh_raw = grouped_gemm_gather(gy, down_proj, sched, transpose_w=True, out_dtype=torch.float32)
        dgu, wh, dw_rows = act_backward(gate_up, dh_raw, w_rows, sched, activation, swiglu_limit)
    else:
        dgu, wh, dw_rows = dgrad_down_act(dy_rows, down_proj, gate_up, w_rows, sched, activation, swiglu_limit)
    if down_bias is not None:
        dy_rows = dy_rows if dy_rows is not None else gather_rows(gy, sched, skip_tail=dy_skip)
        dw_rows = dw_rows + (dy_rows.float() * _bias_rows(down_bias, sched)).sum(dim=1)
    w_rows = w_rows.unsqueeze(1)
    dx_rows = grouped_gemm(dgu, gate_up_proj, sched, transpose_w=True)
    ones = torch.ones(num_tokens, top_k, dtype=torch.float32, device=x.device)
    dx = combine(dx_rows, sched.pos, ones, topk_ids, gate_up_proj.shape[0], x.dtype)
    d_topk = dw_rows.index_select(0, sched.pos.reshape(-1)).view(num_tokens, top_k).to(topk_weights.dtype)

    x_rows = saved.x_rows if saved.x_rows is not None else gather_rows(x.contiguous(), sched, skip_tail=True)
    dy_rows = dy_rows if dy_rows is not None else gather_rows(gy, sched, skip_tail=dy_skip)
    d_down_bias = None
    if down_bias is not None:
        d_down_bias = segment_sum((w_rows * dy_rows.float()).to(x.dtype), sched).to(down_bias.dtype)
    d_gate_up_bias = None if gate_up_bias is None else segment_sum(dgu, sched).to(gate_up_bias.dtype)
    grads = param_grads(dy_rows, wh, dgu, x_rows, sched, gate_up_proj.dtype, dx_rows, dw_rows, d_gate_up_bias,
                        d_down_bias, grads_into)
    return dx, d_topk, grads


def param_grads(dy_rows, wh, dgu, x_rows, sched, wdt, dx_rows, dw_rows, d_gate_up_bias, d_down_bias, grads_into=None):
    """GroupedMLPGrads of one backward: the weight gradients d down = dy_rows^T wh and d gate_up = dgu^T x_rows
    per expert (over sched.seg_rows real rows), with the given bias gradients; grads_into: added to its
    parameter gradients instead (the weight gradients by the accumulating kernel, weight_grad(into=))."""
    from . import reference

    if grads_into is None:
        d_down = weight_grad(dy_rows, wh, sched, sched.seg_rows).to(wdt)
        d_gate_up = weight_grad(dgu, x_rows, sched, sched.seg_rows).to(wdt)
        return reference.GroupedMLPGrads(dx_rows, dw_rows, d_gate_up, d_down, d_gate_up_bias, d_down_bias)
    weight_grad(dy_rows, wh, sched, sched.seg_rows, into=grads_into.down_proj)
    weight_grad(dgu, x_rows, sched, sched.seg_rows, into=grads_into.gate_up_proj)
    biases = reference.GroupedMLPGrads(dx_rows, dw_rows, None, None, d_gate_up_bias, d_down_bias)
    return reference.add_param_grads(grads_into, biases, weights=False)


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
    if not x.is_cuda:
        return f"input is on {x.device.type}"
    e = layer.experts
    return unavailable_reason(x, torch.empty(0, layer.top_k, dtype=torch.int64), e.gate_up_proj, e.down_proj,
                              layer.activation)


def init_workspace(ws) -> None:
    """Check what the kernels need; with expert parallelism, also check the group (cuda_ep)."""
    if ws.precision != "bf16":
        raise ValueError(f"the CUDA kernels take bf16, not {ws.precision}")
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
    # x (the forward's tokens): gathered in schedule order by the same host call, unless the gate/up GEMM
    # reads x itself (MOK_GEMM_GATHER=1)
    return make_schedule(topk_ids, workspace.num_experts, gather_x=None if _use_gather() else x)


def forward(x, topk_ids, topk_weights, params, schedule, workspace):
    if workspace.ep_size > 1:
        from . import cuda_ep

        return cuda_ep.forward(x, topk_ids, topk_weights, params, schedule, workspace)
    return experts_forward(
        x, topk_ids, topk_weights, *params.as_args(), workspace.activation, workspace.swiglu_limit, schedule
    )


def backward(grad_y, saved, x, topk_ids, topk_weights, params, workspace, grads_into=None):
    if workspace.ep_size > 1:
        from . import cuda_ep

        return cuda_ep.backward(grad_y, saved, x, topk_ids, topk_weights, params, workspace, grads_into)
    return experts_backward(
        grad_y, saved, x, topk_ids, topk_weights, *params.as_args(), workspace.activation, workspace.swiglu_limit,
        grads_into,
    )
