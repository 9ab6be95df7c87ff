"""Schedule: routed slots -> rows of the expert-ordered, tile-padded GEMM input.

One CTA of 32 warps, one launch, no atomics, no host synchronisation:

1. count   each warp owns a contiguous chunk of the flat slots s = t*k + j and
           counts its slots per expert (lanes of one expert agree through warp
           shuffles; one lane per expert adds the group's count).
2. scan    per expert, an exclusive prefix over the warps (chunk order), then
           one thread pads each expert's total to TILE_M and prefix-sums the
           experts: seg_end[e], and tile_expert[] (-1 past the last segment).
3. place   each warp walks its chunk again in slot order: the row of slot s is
           seg_start[e] + (slots of e in earlier warps) + (earlier slots of e in
           this warp). So rows keep slot order within an expert (a stable
           counting sort), and the result is a pure function of topk_ids.

Outputs: pos[s] (row of slot s), row_token[r] (token of row r; T on padding
rows), tile_expert[r / TILE_M], seg_end[e].
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .registry import SCHEDULE_MAX_EXPERTS as MAX_EXPERTS
from .registry import TILE_M

WARPS = 32


def _group_rank(e, lane):
    """(rank of this lane among lanes holding e, number of lanes holding e) in the warp."""
    rank = cutlass.Int32(0)
    total = cutlass.Int32(0)
    for src in range(32):  # a plain helper: unrolled while tracing
        same = cute.arch.shuffle_sync(e, src) == e
        one = cutlass.Int32(cutlass.select_(same, cutlass.Int32(1), cutlass.Int32(0)))
        total = total + one
        rank = rank + cutlass.Int32(cutlass.select_(lane > src, one, cutlass.Int32(0)))
    return rank, total


class Schedule:
    @cute.jit
    def __call__(
        self,
        ids: cute.Tensor,  # (N,) int64 flat expert ids, N = T*k
        pos: cute.Tensor,  # (N,) int64 out
        row_token: cute.Tensor,  # (M_cap,) int64 out
        tile_expert: cute.Tensor,  # (M_cap / TILE_M,) int32 out
        seg_end: cute.Tensor,  # (E,) int32 out
        top_k: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(ids, pos, row_token, tile_expert, seg_end, top_k).launch(
            grid=[1, 1, 1], block=[WARPS * 32, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        ids: cute.Tensor,
        pos: cute.Tensor,
        row_token: cute.Tensor,
        tile_expert: cute.Tensor,
        seg_end: cute.Tensor,
        top_k: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        n = cute.size(ids, mode=[0])
        num_experts = cute.size(seg_end, mode=[0])
        cap = cute.size(row_token, mode=[0])
        n_tiles = cute.size(tile_expert, mode=[0])
        num_tokens = n // top_k

        smem = cutlass.utils.SmemAllocator()
        cnt = smem.allocate_tensor(cutlass.Int32, cute.make_layout((WARPS, MAX_EXPERTS), stride=(MAX_EXPERTS, 1)), 16)
        seg = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS + 1), 16)

        for i in range(tidx, WARPS * MAX_EXPERTS, WARPS * 32):
            cnt[(i // MAX_EXPERTS, i % MAX_EXPERTS)] = cutlass.Int32(0)
        for r in range(tidx, cap, WARPS * 32):
            row_token[r] = cutlass.Int64(num_tokens)
        cute.arch.sync_threads()

        chunk = (n + WARPS - 1) // WARPS
        lo = warp * chunk
        hi = cutlass.min(lo + chunk, n)

        # 1. per-warp counts
        for g in range(lo, hi, 32):
            s = g + lane
            e = cutlass.Int32(-1)
            if s < hi:
                e = cutlass.Int32(ids[s])
            rank, total = _group_rank(e, lane)
            if e >= 0:
                if rank == total - 1:
                    cnt[(warp, e)] = cnt[(warp, e)] + total
            cute.arch.sync_warp()
        cute.arch.sync_threads()

        # 2a. per expert: exclusive prefix over warps; total into seg[e]
        if tidx < num_experts:
            running = cutlass.Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                c = cnt[(w, tidx)]
                cnt[(w, tidx)] = running
                running = running + c
            seg[tidx] = running
        cute.arch.sync_threads()

        # 2b. padded segment starts (one thread, E steps)
        if tidx == 0:
            start = cutlass.Int32(0)
            for e in range(num_experts):
                t = seg[e]
                seg[e] = start
                start = start + (t + TILE_M - 1) // TILE_M * TILE_M
                seg_end[e] = start
            seg[MAX_EXPERTS] = start
        cute.arch.sync_threads()

        # 2c. warp bases += segment start; tile owners
        if tidx < num_experts:
            st = seg[tidx]
            for w in cutlass.range_constexpr(WARPS):
                cnt[(w, tidx)] = cnt[(w, tidx)] + st
            en = seg[MAX_EXPERTS]
            if tidx + 1 < num_experts:
                en = seg[tidx + 1]
            for t in range(st // TILE_M, en // TILE_M):
                tile_expert[t] = tidx
        for t in range(seg[MAX_EXPERTS] // TILE_M + tidx, n_tiles, WARPS * 32):
            tile_expert[t] = cutlass.Int32(-1)
        cute.arch.sync_threads()

        # 3. placement in slot order
        for g in range(lo, hi, 32):
            s = g + lane
            e = cutlass.Int32(-1)
            if s < hi:
                e = cutlass.Int32(ids[s])
            rank, total = _group_rank(e, lane)
            if e >= 0:
                row = cnt[(warp, e)] + rank
                pos[s] = cutlass.Int64(row)
                row_token[row] = cutlass.Int64(s // top_k)
            cute.arch.sync_warp()
            if e >= 0:
                if rank == total - 1:
                    cnt[(warp, e)] = cnt[(warp, e)] + total
            cute.arch.sync_warp()
