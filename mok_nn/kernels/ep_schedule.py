"""The expert-parallel schedule's outputs from its bucket schedule, in one launch.

cuda_ep.make_ep_schedule runs the single-GPU schedule over the P*Tc*k all-gathered slots, the experts
relabelled into buckets (this rank's first), then derives this rank's schedule from it. EPScheduleOutputs
is that derivation (about 15 small torch ops, each a node of the schedule's CUDA graph, where the GPU
waits for them after the forward's first barrier), with the torch ops' values bit for bit. With
F = the bucket schedule (row_token, tile_expert, seg_end, seg_rows over its own capacity), key[g] the
bucket of global slot g (n = P*Tc*k slots), cap this rank's capacity, E_l its experts:

  bounds[b] = 0 (b = 0), F.seg_end[b - 1]                  start row of bucket b
  row_gslot[r] = F.row_token[r] if r < bounds[E_l] else n  r < cap (n: padding, the zero row's slot)
  row_token[r] = row_gslot[r] // k
  row_src[r], row_slot[r] = row_gslot // (Tc*k), row_gslot % (Tc*k); -1 both where row_gslot = n
  tile_expert[i] = F.tile_expert[i] if < E_l else -1        i < cap / TILE_M
  seg_end[e] = min(F.seg_end[e], cap)                        e < E_l
  seg_rows[e] = min(max(cap - bounds[e], 0), F.seg_rows[e])
  padded_rows[e] = seg_end[e] - seg_end[e - 1] (seg_end[-1] = 0)
  pull_src[u] = u if some key[u*k + j] < E_l and u // Tc != rank, else -1   u = s*Tc + t < P*Tc
  load[q] = bounds[(q + 1) E_l] - bounds[q E_l]              q < len(load): P with one bucket per expert
                                                             (every rank's padded rows: the overflow
                                                             test), else 1 (unused)

Work split: every thread of a fixed grid takes indices tid, tid + G, ... of each output in turn.
Integer arithmetic only: the result does not depend on the grid.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .registry import EP_SCHED_THREADS as THREADS


class EPScheduleOutputs:
    @cute.jit
    def __call__(
        self,
        f_row_token: cute.Tensor,  # (FC,) int64: the bucket schedule's row_token (n on padding rows)
        f_tile_expert: cute.Tensor,  # (FC / TILE_M,) int32
        f_seg_end: cute.Tensor,  # (B,) int32: end row of each bucket's padded segment
        f_seg_rows: cute.Tensor,  # (B,) int32: slots of each bucket
        key: cute.Tensor,  # (n,) int64: bucket of each global slot
        row_token: cute.Tensor,  # (cap,) int64 out
        row_gslot: cute.Tensor,  # (cap,) int64 out
        row_src: cute.Tensor,  # (cap,) int64 out
        row_slot: cute.Tensor,  # (cap,) int64 out
        tile_expert: cute.Tensor,  # (cap / TILE_M,) int32 out
        seg_end: cute.Tensor,  # (E_l,) int32 out
        seg_rows: cute.Tensor,  # (E_l,) int32 out
        padded_rows: cute.Tensor,  # (E_l,) int32 out
        pull_src: cute.Tensor,  # (P * Tc,) int64 out
        load: cute.Tensor,  # (P,) int32 out
        rank: cutlass.Int32,
        top_k: cutlass.Int32,
        tokens_cap: cutlass.Int32,
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(f_row_token, f_tile_expert, f_seg_end, f_seg_rows, key, row_token, row_gslot, row_src, row_slot,
                    tile_expert, seg_end, seg_rows, padded_rows, pull_src, load, rank, top_k,
                    tokens_cap).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, f_row_token: cute.Tensor, f_tile_expert: cute.Tensor, f_seg_end: cute.Tensor,
               f_seg_rows: cute.Tensor, key: cute.Tensor, row_token: cute.Tensor, row_gslot: cute.Tensor,
               row_src: cute.Tensor, row_slot: cute.Tensor, tile_expert: cute.Tensor, seg_end: cute.Tensor,
               seg_rows: cute.Tensor, padded_rows: cute.Tensor, pull_src: cute.Tensor, load: cute.Tensor,
               rank: cutlass.Int32, top_k: cutlass.Int32, tokens_cap: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        tid = cutlass.Int32(cta) * THREADS + cutlass.Int32(tidx)
        step = cutlass.Int32(n_ctas) * THREADS
        cap = cute.size(row_token, mode=[0])
        e_l = cute.size(seg_end, mode=[0])
        ep_size = cute.size(pull_src, mode=[0]) // tokens_cap  # (load has one entry without spread buckets)
        n = cutlass.Int64(cute.size(key, mode=[0]))
        per_src = cutlass.Int64(tokens_cap) * cutlass.Int64(top_k)  # slots of one source rank
        local_end = cutlass.Int32(f_seg_end[e_l - 1])  # bounds[E_l]: rows past it are other buckets'
        # rows
        for r in range(tid, cap, step):
            g = n
            if r < local_end:
                g = f_row_token[r]
            row_gslot[r] = g
            row_token[r] = g // cutlass.Int64(top_k)
            src = cutlass.Int64(-1)
            slot = cutlass.Int64(-1)
            if g < n:
                src = g // per_src
                slot = g - src * per_src
            row_src[r] = src
            row_slot[r] = slot
        # row tiles
        for i in range(tid, cute.size(tile_expert, mode=[0]), step):
            te = cutlass.Int32(f_tile_expert[i])
            if te >= e_l:
                te = cutlass.Int32(-1)
            tile_expert[i] = te
        # local experts
        for e in range(tid, e_l, step):
            end = cutlass.min(cutlass.Int32(f_seg_end[e]), cap)
            start = cutlass.Int32(0)  # bounds[e]
            prev_end = cutlass.Int32(0)  # seg_end[e - 1]
            if e > 0:
                start = cutlass.Int32(f_seg_end[e - 1])
                prev_end = cutlass.min(start, cap)
            seg_end[e] = end
            seg_rows[e] = cutlass.min(cutlass.max(cap - start, cutlass.Int32(0)), cutlass.Int32(f_seg_rows[e]))
            padded_rows[e] = end - prev_end
        # token rows to pull: a slot of the token routed to a local expert, from another rank
        for u in range(tid, ep_size * tokens_cap, step):
            need = False
            for j in range(top_k):
                if key[cutlass.Int64(u) * cutlass.Int64(top_k) + j] < cutlass.Int64(e_l):
                    need = True
            v = cutlass.Int64(-1)
            if need & (u // tokens_cap != rank):
                v = cutlass.Int64(u)
            pull_src[u] = v
        # every rank's padded rows (its buckets q E_l .. (q + 1) E_l - 1; spread buckets only: else one entry)
        for q in range(tid, cute.size(load, mode=[0]), step):
            lo = cutlass.Int32(0)
            if q > 0:
                lo = cutlass.Int32(f_seg_end[q * e_l - 1])
            load[q] = cutlass.Int32(f_seg_end[(q + 1) * e_l - 1]) - lo
