"""Expert-parallel row movement on a few CTAs (the comm SMs) beside the grouped GEMMs.

DispatchRows (beside the gate/up GEMM) fills the GEMM's A rows (dst [M, H] bf16, the schedule's row order)
tile by tile, on a few CTAs (the comm SMs), while the GEMM runs on the others:

  row_peer[r] >= 0:  dst[r] = tokens section of rank row_peer[r], row row_src[r]
                     (src_base[p] is that section's address as mapped on this GPU:
                     a peer's row is pulled over NVLink, the own rank's is a local copy)
  row_peer[r] == -1: dst[r] = 0 (padding row)
  row_peer[r] == -2: dst[r] = dst[row_src[r]], an earlier row of the same remote token
                     (each remote token row crosses NVLink once per destination rank)

CTA c walks the tiles c, c + grid, ... in ascending order, the order in which the
persistent GEMM consumes them. Tiles with tile_expert < 0 (past the last segment)
are skipped. A tile's own pulls and zero rows come first; after a CTA barrier its
duplicate rows copy from rows of the same tile or, after an acquire of that tile's
ready flag, of an earlier tile. Then thread 0 publishes ready[tile] = epoch with a
release store (gpu scope); the GEMM's producer acquires it and issues a proxy fence
before its TMA reads the rows. Every dependency points to a lower tile, and every
CTA handles its tiles in ascending order, so the waits cannot cycle; each is
bounded by timeout_us (%globaltimer), after which err[0] = 1 and the kernel goes on:
wrong numbers and a flag, never a hang.

PushRows (beside the down GEMM) sends each finished output row to its source rank:

  row_rank[r] >= 0:  slots section of rank row_rank[r], row row_slot[r] = src[r]
                     (dst_base[p]: that section's address on this GPU; own rank: local)

CTA c walks the tiles c, c + grid, ... ascending; thread 0 acquire-waits until
done[tile] >= target (the down GEMM adds 1 per finished (m, n) tile once its TMA
stores are complete, so target = its column tiles), then the CTA pushes the tile's
rows. Bounded like the dispatch (err[0] = 1 on timeout).

Copies move 16 bytes per thread per access with UNROLL accesses in flight per
thread (a pull over NVLink is latency-bound: bytes in flight decide its rate).
Every dst row is written once by one warp: results do not depend on timing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .readiness import publish_tile_ready, wait_flag
from .registry import TILE_M

VEC = 8  # bf16 per 16-byte access
UNROLL = 8  # 16-byte loads in flight per thread
THREADS = 512
WARPS = THREADS // 32


@cute.jit
def copy_row(src_addr: cutlass.Int64, dst_addr: cutlass.Int64, n_vec: cutlass.Int32, lane: cutlass.Int32,
             zero: cutlass.Constexpr):
    """One warp copies (or, zero=True, zero-fills) one row of n_vec 16-byte vectors."""
    frag = cute.make_rmem_tensor((VEC, UNROLL), cutlass.BFloat16)
    frag.fill(0.0)
    src = cute.make_tensor(
        cute.make_ptr(cutlass.BFloat16, src_addr, cute.AddressSpace.gmem, assumed_align=16),
        cute.make_layout((VEC, n_vec)),
    )
    dst = cute.make_tensor(
        cute.make_ptr(cutlass.BFloat16, dst_addr, cute.AddressSpace.gmem, assumed_align=16),
        cute.make_layout((VEC, n_vec)),
    )
    for c0 in range(lane, n_vec, 32 * UNROLL):
        # all loads first (in flight together), then the stores
        for u in cutlass.range_constexpr(UNROLL):
            c = c0 + 32 * u
            if c < n_vec:
                if cutlass.const_expr(not zero):
                    cute.autovec_copy(src[(None, c)], frag[(None, u)])
        for u in cutlass.range_constexpr(UNROLL):
            c = c0 + 32 * u
            if c < n_vec:
                cute.autovec_copy(frag[(None, u)], dst[(None, c)])


@cute.jit
def copy_row_to_lanes(src_addr: cutlass.Int64, dst_addr: cutlass.Int64, ok_i: cutlass.Int32, count: cutlass.Int32,
                      n_vec: cutlass.Int32, lane: cutlass.Int32):
    """One warp reads the row at src_addr once and stores it to dst_addr of every lane j < count with ok_i = 1
    (the whole warp calls it: the addresses come by shuffle), UNROLL 16-byte loads per lane in flight."""
    frag = cute.make_rmem_tensor((VEC, UNROLL), cutlass.BFloat16)
    src = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, src_addr, cute.AddressSpace.gmem, assumed_align=16),
                           cute.make_layout((VEC, n_vec)))
    for c0 in range(0, n_vec, 32 * UNROLL):  # every lane takes every step (the shuffles need the whole warp)
        for u in cutlass.range_constexpr(UNROLL):
            c = c0 + lane + 32 * u
            if c < n_vec:
                cute.autovec_copy(src[(None, c)], frag[(None, u)])
        for j in range(count):
            if cute.arch.shuffle_sync(ok_i, j) != 0:
                dst = cute.make_tensor(
                    cute.make_ptr(cutlass.BFloat16, cute.arch.shuffle_sync(dst_addr, j), cute.AddressSpace.gmem,
                                  assumed_align=16),
                    cute.make_layout((VEC, n_vec)),
                )
                for u in cutlass.range_constexpr(UNROLL):
                    c = c0 + lane + 32 * u
                    if c < n_vec:
                        cute.autovec_copy(frag[(None, u)], dst[(None, c)])


class DispatchRows:
    @cute.jit
    def __call__(
        self,
        dst: cute.Tensor,  # (M, H) bf16: the GEMM's A rows
        src_base: cute.Tensor,  # (P,) int64: address of each rank's tokens section on this GPU
        row_peer: cute.Tensor,  # (M,) int32: source rank, -1 zero row, -2 duplicate of dst[row_src]
        row_src: cute.Tensor,  # (M,) int64: row in that rank's tokens section, or in dst
        tile_expert: cute.Tensor,  # (M / TILE_M,) int32: < 0 past the last segment
        ready: cute.Tensor,  # (M / TILE_M,) int32: set to epoch when the tile's rows are in dst
        err: cute.Tensor,  # (1,) int32: set to 1 if a wait timed out
        epoch: cutlass.Int32,
        timeout_us: cutlass.Int32,
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(dst, src_base, row_peer, row_src, tile_expert, ready, err, epoch, timeout_us).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        dst: cute.Tensor,
        src_base: cute.Tensor,
        row_peer: cute.Tensor,
        row_src: cute.Tensor,
        tile_expert: cute.Tensor,
        ready: cute.Tensor,
        err: cute.Tensor,
        epoch: cutlass.Int32,
        timeout_us: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        warp = tidx // 32
        lane = tidx % 32
        n_tiles = cute.size(tile_expert, mode=[0])
        n_vec = cute.size(dst, mode=[1]) // VEC
        row_bytes = cutlass.Int64(cute.size(dst, mode=[1])) * 2
        dst_base = dst.iterator.toint()
        dst_stride = cutlass.Int64(dst.stride[0]) * 2  # bytes between rows
        ready_base = ready.iterator.toint()
        for tile in range(cta, n_tiles, n_ctas):
            if tile_expert[tile] >= 0:
                # 1. pulls, local copies and zero rows of this tile
                for i in range(warp, TILE_M, WARPS):
                    r = tile * TILE_M + i
                    p = row_peer[r]
                    d_addr = dst_base + cutlass.Int64(r) * dst_stride
                    if p >= 0:
                        s_addr = src_base[p] + row_src[r] * row_bytes
                        copy_row(s_addr, d_addr, n_vec, lane, False)
                    elif p == -1:
                        copy_row(d_addr, d_addr, n_vec, lane, True)
                cute.arch.sync_threads()
                # 2. duplicates of rows pulled earlier (this tile: visible after the barrier)
                for i in range(warp, TILE_M, WARPS):
                    r = tile * TILE_M + i
                    if row_peer[r] == -2:
                        f = row_src[r]
                        f_tile = cutlass.Int32(f // TILE_M)
                        if f_tile != tile:
                            wait_flag(ready_base + cutlass.Int64(f_tile) * 4, epoch, timeout_us, err)
                        s_addr = dst_base + f * dst_stride
                        d_addr = dst_base + cutlass.Int64(r) * dst_stride
                        copy_row(s_addr, d_addr, n_vec, lane, False)
                # 3. publish: rows written with generic stores, read by TMA (async proxy)
                cute.arch.fence_proxy("async.global")
                cute.arch.sync_threads()
                if tidx == 0:
                    publish_tile_ready(ready, tile, epoch)


class PushRows:
    @cute.jit
    def __call__(
        self,
        src: cute.Tensor,  # (M, H) bf16: the down GEMM's output rows
        dst_base: cute.Tensor,  # (P,) int64: address of each rank's slots section on this GPU
        row_rank: cute.Tensor,  # (M,) int32: source rank of the row's token, -1 (padding): nothing
        row_slot: cute.Tensor,  # (M,) int64: slot t*k + j in that rank's slots section
        tile_expert: cute.Tensor,  # (M / TILE_M,) int32: < 0 past the last segment
        done: cute.Tensor,  # (M / TILE_M,) int32: finished column tiles of each row tile
        err: cute.Tensor,  # (1,) int32: set to 1 if a wait timed out
        target: cutlass.Int32,  # column tiles per row tile
        timeout_us: cutlass.Int32,
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(src, dst_base, row_rank, row_slot, tile_expert, done, err, target, timeout_us).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        src: cute.Tensor,
        dst_base: cute.Tensor,
        row_rank: cute.Tensor,
        row_slot: cute.Tensor,
        tile_expert: cute.Tensor,
        done: cute.Tensor,
        err: cute.Tensor,
        target: cutlass.Int32,
        timeout_us: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        warp = tidx // 32
        lane = tidx % 32
        n_tiles = cute.size(tile_expert, mode=[0])
        n_vec = cute.size(src, mode=[1]) // VEC
        row_bytes = cutlass.Int64(cute.size(src, mode=[1])) * 2
        src_base = src.iterator.toint()
        src_stride = cutlass.Int64(src.stride[0]) * 2
        done_base = done.iterator.toint()
        for tile in range(cta, n_tiles, n_ctas):
            if tile_expert[tile] >= 0:
                if tidx == 0:
                    wait_flag(done_base + cutlass.Int64(tile) * 4, target, timeout_us, err)
                cute.arch.sync_threads()  # the acquire of thread 0 covers the CTA's reads below
                for i in range(warp, TILE_M, WARPS):
                    r = tile * TILE_M + i
                    p = row_rank[r]
                    if p >= 0:
                        s_addr = src_base + cutlass.Int64(r) * src_stride
                        d_addr = dst_base[p] + row_slot[r] * row_bytes
                        copy_row(s_addr, d_addr, n_vec, lane, False)
