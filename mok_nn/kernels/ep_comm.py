"""Expert-parallel signalling over symmetric memory (NVLink, unicast stores).

PeerSignal: a two-party barrier with one peer, through unicast stores only (no
            NVLink multicast). Thread 0 fences the earlier writes of this stream
            (fence.acq_rel.sys), stores `epoch` into the peer's pad slot with
            release semantics, then spins with acquire loads on its own pad slot
            (local memory) until the peer's epoch has arrived. After `timeout_us`
            microseconds (%globaltimer) it gives up and sets err[0] = 1: a peer
            that never signals makes the kernel exit in bounded time with a flag,
            never a hang or a trap. The same protocol ends mok_ep_publish (ep_publish.py),
            from the last of its CTAs to finish, with every peer.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda


@cute.jit
def signal_peer(slot_addr: cutlass.Int64, epoch: cutlass.Int32):
    """Store epoch into a peer's pad slot with release semantics at system scope (the caller has
    fenced its earlier writes: fence.acq_rel.sys)."""
    ptr = cute.make_ptr(cutlass.Int32, slot_addr, cute.AddressSpace.gmem, assumed_align=4)
    cute.arch.store(ptr, epoch, sem="release", scope="sys")


@cute.jit
def wait_for_peer(slot_addr: cutlass.Int64, epoch: cutlass.Int32, timeout_us: cutlass.Int32, err: cute.Tensor):
    """Acquire-spin (system scope) on this rank's pad slot of a peer until it holds epoch or more; after
    timeout_us microseconds (%globaltimer) give up and set err[0] = 1."""
    ptr = cute.make_ptr(cutlass.Int32, slot_addr, cute.AddressSpace.gmem, assumed_align=4)
    seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="sys")
    start = cute.arch.globaltimer()
    limit = cutlass.Int64(timeout_us) * 1000
    waited = cutlass.Int64(0)
    while (seen < epoch) & (waited < limit):
        seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="sys")
        waited = cute.arch.globaltimer() - start
    if seen < epoch:
        err[0] = cutlass.Int32(1)


class PeerSignal:
    @cute.jit
    def __call__(
        self,
        peer_slot: cute.Tensor,  # (1,) int32: this rank's slot in the peer's pad (peer memory)
        my_slot: cute.Tensor,  # (1,) int32: the peer's slot in this rank's pad
        err: cute.Tensor,  # (1,) int32: set to 1 on timeout
        epoch: cutlass.Int32,
        timeout_us: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(peer_slot, my_slot, err, epoch, timeout_us).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, peer_slot: cute.Tensor, my_slot: cute.Tensor, err: cute.Tensor, epoch: cutlass.Int32,
               timeout_us: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            cute.arch.fence_acq_rel_sys()
            signal_peer(peer_slot.iterator.toint(), epoch)
            wait_for_peer(my_slot.iterator.toint(), epoch, timeout_us, err)
