"""The schedule: routed slots -> rows of the expert-ordered, tile-padded GEMM input.

A stable counting sort, a pure function of topk_ids: no atomics, no host synchronisation. Three short
launches over many CTAs (ScheduleMultiCta, registry mok_schedule_mc; see its docstring), and the same
followed by the forward's x gather in one host call (ScheduleGather, mok_schedule_gather).

Outputs: pos[s] (row of slot s = t*k + j), row_token[r] (token of row r; T on padding rows),
tile_expert[r / TILE_M] (-1 past the last segment), seg_end[e] (end row of expert e's padded segment),
seg_rows[e] (routed rows of e), padded_rows[e] (seg_rows rounded up to TILE_M).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .ep_copy import ScatterRows
from .id_check import check_expert_id
from .registry import SCHEDULE_MAX_EXPERTS as MAX_EXPERTS
from .registry import SCHEDULE_MC_WARPS as MC_WARPS
from .registry import TILE_M

SCAN_THREADS = 1024  # the scan CTA of ScheduleMultiCta
SCAN_BATCH = 8  # loads in flight per thread in the scan's rewrite pass
SEARCH_STEPS = 10  # binary search over <= MAX_EXPERTS segment ends (2**10 > 512)
assert MAX_EXPERTS <= SCAN_THREADS and 1 << SEARCH_STEPS > MAX_EXPERTS


@cute.jit
def _expert_of_slot(ids, s, num_experts):
    """ids[s] as Int32, checked (id_check: an id outside [0, num_experts) prints and traps)."""
    v = ids[s]
    check_expert_id(v, s, num_experts)
    return cutlass.Int32(v)


def _match_rank(e):
    """(rank of this lane among the warp's lanes holding e, number of such lanes): one match.any."""
    same = cute.arch.match_sync(cutlass.Uint32(0xFFFFFFFF), e, kind="any")
    rank = cutlass.Int32(cute.arch.popc(same & cute.arch.lanemask_lt()))
    total = cutlass.Int32(cute.arch.popc(same))
    return rank, total


@cute.jit
def _slot_expert(ids, s, hi, num_experts):
    e = cutlass.Int32(-1)
    if s < hi:
        e = _expert_of_slot(ids, s, num_experts)
    return e


class ScheduleMultiCta:
    """The schedule over many CTAs, three launches.

    The flat slots s = t*k + j are cut into C chunks of `chunk` slots (host
    chooses chunk, a multiple of MC_WARPS * 32, so that C <= SCHEDULE_MC_MAX_CHUNKS);
    scratch [C * E] int32 carries per-chunk counts between the launches.

    A. count   one CTA per chunk: per-warp counts per expert (match.any groups
               equal experts of 32 slots; the highest lane of a group adds its
               size), summed over warps in warp order -> scratch[c*E + e].
               The same grid fills row_token with T (padding rows keep it).
    B. scan    one CTA: per expert, exclusive prefix over chunks (threads split
               the chunks into groups, group sums then group offsets);
               seg_rows[e] = total; pad to TILE_M (padded_rows[e]) and prefix-sum over experts
               (warp shuffles) -> seg_end; scratch[c*E + e] becomes the row of
               chunk c's first slot of e; tile_expert by binary search over
               seg_end (= searchsorted(seg_end, tile start, right=True), -1 past E).
    C. place   one CTA per chunk: recount per warp, prefix over warps in warp
               order on top of scratch[c*E + e], then each warp walks its slots
               in order: row = base(warp, e) + rank among equal experts in the
               group. Rows keep slot order within an expert (a stable counting
               sort), exactly as make_schedule_torch.
    """

    @cute.jit
    def __call__(
        self,
        ids: cute.Tensor,  # (N,) int64 flat expert ids, N = T*k
        pos: cute.Tensor,  # (N,) int64 out
        row_token: cute.Tensor,  # (M_cap,) int64 out
        tile_expert: cute.Tensor,  # (M_cap / TILE_M,) int32 out
        seg_end: cute.Tensor,  # (E,) int32 out
        seg_rows: cute.Tensor,  # (E,) int32 out
        padded_rows: cute.Tensor,  # (E,) int32 out: seg_rows rounded up to TILE_M
        scratch: cute.Tensor,  # (C * E,) int32 workspace
        top_k: cutlass.Int32,
        chunk: cutlass.Int32,  # slots per chunk, a multiple of MC_WARPS * 32
        stream: cuda.CUstream,
    ):
        num_chunks = cute.size(scratch, mode=[0]) // cute.size(seg_end, mode=[0])
        self.count_kernel(ids, row_token, scratch, seg_end, top_k, chunk).launch(
            grid=[num_chunks, 1, 1], block=[MC_WARPS * 32, 1, 1], stream=stream
        )
        self.scan_kernel(scratch, tile_expert, seg_end, seg_rows, padded_rows).launch(
            grid=[1, 1, 1], block=[SCAN_THREADS, 1, 1], stream=stream
        )
        self.place_kernel(ids, pos, row_token, scratch, seg_end, top_k, chunk).launch(
            grid=[num_chunks, 1, 1], block=[MC_WARPS * 32, 1, 1], stream=stream
        )

    @cute.jit
    def _warp_counts(self, ids, cnt, chunk, num_experts):
        """cnt[(w, e)] = slots of expert e in warp w's part of this CTA's chunk; ends with a CTA barrier."""
        tidx, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        n = cute.size(ids, mode=[0])
        for i in range(tidx, MC_WARPS * num_experts, MC_WARPS * 32):
            cnt[(i // num_experts, i % num_experts)] = cutlass.Int32(0)
        cute.arch.sync_threads()
        sub = chunk // MC_WARPS
        lo = c * chunk + warp * sub
        hi = cutlass.min(lo + sub, n)
        for g in range(lo, hi, 32):
            e = _slot_expert(ids, g + lane, hi, num_experts)
            rank, total = _match_rank(e)
            if e >= 0:
                if rank == total - 1:
                    cnt[(warp, e)] = cnt[(warp, e)] + total
            cute.arch.sync_warp()
        cute.arch.sync_threads()

    @cute.kernel
    def count_kernel(self, ids, row_token, scratch, seg_end, top_k: cutlass.Int32, chunk: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        nc, _, _ = cute.arch.grid_dim()
        num_experts = cute.size(seg_end, mode=[0])
        num_tokens = cute.size(ids, mode=[0]) // top_k
        cap = cute.size(row_token, mode=[0])

        # Every row starts as padding (token T); launch C overwrites the routed rows.
        for r in range(c * MC_WARPS * 32 + tidx, cap, nc * MC_WARPS * 32):
            row_token[r] = cutlass.Int64(num_tokens)

        smem = cutlass.utils.SmemAllocator()
        cnt = smem.allocate_tensor(cutlass.Int32, cute.make_layout((MC_WARPS, MAX_EXPERTS), stride=(MAX_EXPERTS, 1)), 16)
        self._warp_counts(ids, cnt, chunk, num_experts)
        for e in range(tidx, num_experts, MC_WARPS * 32):
            total = cutlass.Int32(0)
            for w in cutlass.range_constexpr(MC_WARPS):
                total = total + cnt[(w, e)]
            scratch[c * num_experts + e] = total

    @cute.kernel
    def scan_kernel(self, scratch, tile_expert, seg_end, seg_rows, padded_rows):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        num_experts = cute.size(seg_end, mode=[0])
        num_chunks = cute.size(scratch, mode=[0]) // num_experts
        n_tiles = cute.size(tile_expert, mode=[0])

        smem = cutlass.utils.SmemAllocator()
        part = smem.allocate_tensor(cutlass.Int32, cute.make_layout(SCAN_THREADS), 16)  # group sums / offsets
        ends = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS), 16)
        starts = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS), 16)
        warp_sum = smem.allocate_tensor(cutlass.Int32, cute.make_layout(SCAN_THREADS // 32), 16)

        # Thread (g, e): expert e, chunks [g*per, (g+1)*per) of G groups.
        groups = cutlass.min(SCAN_THREADS // num_experts, num_chunks)
        per = (num_chunks + groups - 1) // groups
        e = tidx % num_experts
        g = tidx // num_experts
        c_lo = cutlass.min(g * per, num_chunks)
        c_hi = cutlass.min(c_lo + per, num_chunks)
        if g >= groups:
            c_hi = c_lo  # idle thread

        # 1. group sums
        acc = cutlass.Int32(0)
        for ci in cutlass.range(c_lo, c_hi, unroll=8):  # independent loads in flight
            acc = acc + scratch[ci * num_experts + e]
        if g < groups:
            part[tidx] = acc
        cute.arch.sync_threads()

        # 2. per expert: exclusive prefix over groups (in group order), totals
        total = cutlass.Int32(0)
        if tidx < num_experts:
            for gi in range(groups):
                v = part[gi * num_experts + tidx]
                part[gi * num_experts + tidx] = total
                total = total + v
            seg_rows[tidx] = total

        # 3. padded totals -> inclusive prefix over experts: warp scans, then warp sums
        padded = (total + TILE_M - 1) // TILE_M * TILE_M  # 0 for threads >= E
        incl = padded
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << d)
            if lane >= (1 << d):
                incl = incl + up
        if lane == 31:
            warp_sum[warp] = incl
        cute.arch.sync_threads()
        if tidx < num_experts:
            for w in range(warp):
                incl = incl + warp_sum[w]
            seg_end[tidx] = incl
            padded_rows[tidx] = padded
            ends[tidx] = incl
            starts[tidx] = incl - padded
        cute.arch.sync_threads()

        # 4. scratch[c*E + e] := row of chunk c's first slot of e. Loads of a batch are
        #    issued before its stores (same array: the compiler would not reorder them).
        if g < groups:
            base = starts[e] + part[tidx]
            buf = cute.make_rmem_tensor((SCAN_BATCH,), cutlass.Int32)
            for c0 in range(c_lo, c_hi, SCAN_BATCH):
                for u in cutlass.range_constexpr(SCAN_BATCH):
                    v = cutlass.Int32(0)
                    if c0 + u < c_hi:
                        v = scratch[(c0 + u) * num_experts + e]
                    buf[u] = v
                for u in cutlass.range_constexpr(SCAN_BATCH):
                    if c0 + u < c_hi:
                        scratch[(c0 + u) * num_experts + e] = base
                        base = base + buf[u]

        # 5. tile owners: number of experts whose segment ends at or before the tile start
        for t in range(tidx, n_tiles, SCAN_THREADS):
            row = t * TILE_M
            lo = cutlass.Int32(0)
            hi = num_experts
            for _ in cutlass.range_constexpr(SEARCH_STEPS):
                if lo < hi:
                    mid = (lo + hi) // 2
                    if ends[mid] <= row:
                        lo = mid + 1
                    else:
                        hi = mid
            te = cutlass.Int32(-1)
            if lo < num_experts:
                te = lo
            tile_expert[t] = te

    @cute.kernel
    def place_kernel(self, ids, pos, row_token, scratch, seg_end, top_k: cutlass.Int32, chunk: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        n = cute.size(ids, mode=[0])
        num_experts = cute.size(seg_end, mode=[0])

        smem = cutlass.utils.SmemAllocator()
        cnt = smem.allocate_tensor(cutlass.Int32, cute.make_layout((MC_WARPS, MAX_EXPERTS), stride=(MAX_EXPERTS, 1)), 16)
        self._warp_counts(ids, cnt, chunk, num_experts)

        # per expert: exclusive prefix over warps (warp order) on top of the chunk's base row
        for e in range(tidx, num_experts, MC_WARPS * 32):
            run = scratch[c * num_experts + e]
            for w in cutlass.range_constexpr(MC_WARPS):
                v = cnt[(w, e)]
                cnt[(w, e)] = run
                run = run + v
        cute.arch.sync_threads()

        sub = chunk // MC_WARPS
        lo = c * chunk + warp * sub
        hi = cutlass.min(lo + sub, n)
        for g in range(lo, hi, 32):
            s = g + lane
            e = _slot_expert(ids, s, hi, num_experts)
            rank, total = _match_rank(e)
            if e >= 0:
                row = cnt[(warp, e)] + rank
                pos[s] = cutlass.Int64(row)
                row_token[row] = cutlass.Int64(s // top_k)
            cute.arch.sync_warp()
            if e >= 0:
                if rank == total - 1:
                    cnt[(warp, e)] = cnt[(warp, e)] + total
            cute.arch.sync_warp()


# --------------------------------------------------------------------------
# schedule + the forward's x gather in one exported call


class ScheduleGather:
    """ScheduleMultiCta, then ep_copy.ScatterRows of x by the schedule just made (x_rows [M_cap, H], rows of
    tiles past the last segment unwritten), from one host call: the gather is queued right behind the
    schedule. Launched as two host calls, the EP = 1 forward's GPU waited ~60 us for the host between them
    (the Python of the forward in between, measured with benchmarks/profile_gaps.py). Same kernels,
    same order: the same outputs as make_schedule then gather_rows."""

    @cute.jit
    def __call__(
        self,
        ids: cute.Tensor,  # (N,) int64 flat expert ids, N = T*k
        pos: cute.Tensor,  # (N,) int64 out
        row_token: cute.Tensor,  # (M_cap,) int64 out
        tile_expert: cute.Tensor,  # (M_cap / TILE_M,) int32 out
        seg_end: cute.Tensor,  # (E,) int32 out
        seg_rows: cute.Tensor,  # (E,) int32 out
        padded_rows: cute.Tensor,  # (E,) int32 out
        scratch: cute.Tensor,  # (C * E,) int32 workspace
        top_k: cutlass.Int32,
        chunk: cutlass.Int32,
        x: cute.Tensor,  # (T, H) bf16: the tokens
        slots: cute.Tensor,  # (T, k) int64: pos again, as the scatter reads it (the same memory)
        x_rows: cute.Tensor,  # (M_cap, H) bf16 out
        mx: cutlass.Int32,  # nonzero: x's MXFP8 values along H (ScatterRows)
        num_ctas: cutlass.Int32,  # the scatter's grid (cuda_backend.row_copy_grid)
        stream: cuda.CUstream,
    ):
        ScheduleMultiCta()(ids, pos, row_token, tile_expert, seg_end, seg_rows, padded_rows, scratch, top_k, chunk,
                           stream)
        ScatterRows()(x, slots, row_token, tile_expert, x_rows, mx, num_ctas, stream)
