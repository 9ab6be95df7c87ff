"""Per-row-tile flags between the EP comm kernels (ep_overlap.py) and the grouped GEMMs beside them.

The dispatch kernel writes a tile's A rows with generic stores, then publishes
ready[tile] = epoch with a release store (gpu scope). A consumer calls
wait_tile_ready before its TMA reads those rows: an acquire-spin on the flag,
then a proxy fence (generic writes -> async-proxy reads). The spin is bounded:
after timeout_us it sets err[0] = 1 and returns, so a lost signal gives a flag
and wrong numbers, never a hang; a wait that finds err[0] already set returns at
once, so the other waiting tiles do not each add a timeout. Epochs only grow, so a flag is never reset.

The other direction (the down GEMM's output rows to the combine push): the GEMM's
store warp calls signal_tile_done once the TMA stores of an output tile are
complete; done[m_tile] counts finished column tiles (zeroed before each GEMM), and
the push waits for done[m_tile] >= column tiles (wait_flag).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def wait_flag(flag_addr: cutlass.Int64, epoch: cutlass.Int32, timeout_us: cutlass.Int32, err: cute.Tensor):
    """Acquire-spin until the int32 at flag_addr is >= epoch, at most timeout_us (then err[0] = 1).

    Gives up at once while err[0] is set (a wait of this step, or of an earlier step on the same
    workspace: the flag is sticky, those outputs are poisoned anyway): a lost signal costs one
    timeout, not one per waiting tile in turn (minutes at the benchmark shapes)."""
    ptr = cute.make_ptr(cutlass.Int32, flag_addr, cute.AddressSpace.gmem, assumed_align=4)
    err_ptr = cute.make_ptr(cutlass.Int32, err.iterator.toint(), cute.AddressSpace.gmem, assumed_align=4)
    seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
    if seen < epoch:
        limit_ns = cutlass.Int64(timeout_us) * 1000
        start = cute.arch.globaltimer()
        waited = cutlass.Int64(0)
        failed = cute.arch.load(err_ptr, cutlass.Int32, sem="relaxed", scope="gpu")
        while (seen < epoch) & (waited < limit_ns) & (failed == 0):
            seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
            waited = cute.arch.globaltimer() - start
            failed = cute.arch.load(err_ptr, cutlass.Int32, sem="relaxed", scope="gpu")
        if seen < epoch:
            err[0] = cutlass.Int32(1)


@cute.jit
def wait_tile_ready(ready: cute.Tensor, tile: cutlass.Int32, epoch: cutlass.Int32, timeout_us: cutlass.Int32,
                    err: cute.Tensor):
    """Before a TMA load of row tile `tile`: its rows are published, and visible to the async proxy."""
    wait_flag(ready.iterator.toint() + cutlass.Int64(tile) * 4, epoch, timeout_us, err)
    cute.arch.fence_proxy("async.global")


@cute.jit
def publish_tile_ready(ready: cute.Tensor, tile: cutlass.Int32, epoch: cutlass.Int32):
    """One thread, after a CTA barrier that follows every write of the tile's rows."""
    cute.arch.fence_acq_rel_gpu()
    flag = cute.make_ptr(cutlass.Int32, ready.iterator.toint() + cutlass.Int64(tile) * 4, cute.AddressSpace.gmem,
                         assumed_align=4)
    cute.arch.store(flag, epoch, sem="release", scope="gpu")


@cute.jit
def signal_tile_done(done: cute.Tensor, tile: cutlass.Int32):
    """Whole store warp, after it issued (and committed) every TMA store of one (row tile, column
    tile) of its output: wait until those writes are complete, order them before generic-proxy
    reads, then done[tile] += 1 (release, gpu scope) from one lane. Nothing for tile < 0."""
    if tile >= 0:
        cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.fence_proxy("async.global")
        if cute.arch.lane_idx() == 0:
            ptr = cute.make_ptr(cutlass.Int32, done.iterator.toint() + cutlass.Int64(tile) * 4,
                                cute.AddressSpace.gmem, assumed_align=4)
            cute.arch.atomic_add(ptr, cutlass.Int32(1), sem="release", scope="gpu")
