"""Step 1 of the EP forward in one launch: this rank's tokens, routing and token count published.

Publish (rank r, token capacity Tc, n = min(num_tokens, Tc), K = top-k), for every rank p
(own rank included; addrs[0/1/2][p] = rank p's ids / weights / ntok section as mapped here):

  tokens[r*Tc + t]                  = x[t]                  t < n   (local rows, 16-byte vectors; push = 1:
                                                                      row r*Tc + t of every rank's tokens
                                                                      section, tokens_all[p], the pull's work
                                                                      done here, as stores to the peers)
  ids_p[(r*Tc + t)*K + j]           = topk_ids[t, j]        t < n
                                    = -1                    n <= t < Tc
  weights_p[(r*Tc + t)*K + j]       = topk_weights[t, j]    t < n   (fp32)
  ntok_p[r]                         = num_tokens

with every published id checked first (kernels/id_check.py): one outside [0, num_experts) is printed
and stops the kernel with a trap, before any rank can read it.

the stores of cuda_ep's torch ops (SymmBuffers.publish_torch), bit for bit: ids are int64 moves;
the fp32 weights are moved as 32-bit words (weights of other dtypes are converted to fp32 by the
caller first, as torch's copy_ into the fp32 section converts them).

Stores into peer memory are plain (weak) stores. They are made visible to the peers by the
barrier that follows (step 2 of the forward): with epoch > 0 this kernel ends with it itself,
else the caller launches mok_ep_signal after it (fence.acq_rel.sys before its release store of
the epoch, and the peer's acquire load); no peer may read ids / weights / ntok before, as with
the torch ops.

The barrier at the end (epoch > 0; the forward's step 2 without a launch of its own): every thread
fences its stores (fence.acq_rel.sys, peer memory included), its CTA synchronises, and thread 0
counts the CTA in arrivals[0] (atom.add.acq_rel.gpu). The CTA that counts last (every other CTA's
stores are ordered before it) resets the counter for the next launch, then does what mok_ep_signal
does, with every peer: epoch into this rank's slot of each peer's pad (st.release.sys, pads[p] + 4 *
rank), then an acquire-spin on the peers' slots of its own pad (pads[rank] + 4 * p), bounded by
timeout_us (err[0] = 1 after it: no hang). Only a launch that does not finish could leave the counter
off (a later launch's last CTA would then be miscounted); that is a device fault, after which the CUDA
context runs nothing more.

Work split over a fixed grid (num_ctas, chosen by the caller): first every thread takes the
(t, j) elements i, i + G, ... (G threads; consecutive threads store consecutive elements, so a
warp's peer stores are whole sectors) and stores each into every rank; CTA 0 stores the token
count; then warp w takes the x rows w, w + W, ... (ep_copy.copy_row: 8 x 16-byte loads per
lane in flight, then the stores). Every destination element is written by one thread with a value
that does not depend on timing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .ep_comm import signal_peer, wait_for_peer
from .ep_copy import VEC, copy_row, copy_row_to_lanes
from .id_check import check_expert_id
from .registry import EP_COPY_THREADS as THREADS

WARPS = THREADS // 32


def _gmem(dtype, addr, n, align: int):
    """A flat (n,) tensor of dtype at a raw global address (traced inline into the kernel)."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align),
                            cute.make_layout((n,)))


class Publish:
    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # (T, H) bf16: this rank's tokens
        topk_ids: cute.Tensor,  # (T, K) int64
        topk_weights: cute.Tensor,  # (T, K) fp32
        tokens: cute.Tensor,  # (R, H) bf16: the local tokens section, R >= (rank + 1) * Tc
        addrs: cute.Tensor,  # (3, P) int64: ids, weights, ntok section of each rank, as mapped here
        rank: cutlass.Int32,
        tokens_cap: cutlass.Int32,
        num_tokens: cutlass.Int32,
        num_ctas: cutlass.Int32,
        pads: cute.Tensor,  # (P,) int64: every rank's pad section as mapped here (the barrier, epoch > 0)
        err: cute.Tensor,  # (1,) int32: set to 1 when a peer does not signal within timeout_us
        arrivals: cute.Tensor,  # (1,) int32: 0 before the launch (the last CTA leaves it 0 again)
        epoch: cutlass.Int32,  # > 0: end with the barrier of this epoch; 0: no barrier
        timeout_us: cutlass.Int32,
        tokens_all: cute.Tensor,  # (P,) int64: every rank's tokens section as mapped here (read if push)
        push: cutlass.Int32,  # 1: the x rows into every rank's tokens section (own included), 0: local only
        num_experts: cutlass.Int32,  # ids of tokens t < n must lie in [0, num_experts): else print, trap (id_check)
        stream: cuda.CUstream,
    ):
        self.kernel(x, topk_ids, topk_weights, tokens, addrs, rank, tokens_cap, num_tokens, pads, err, arrivals,
                    epoch, timeout_us, tokens_all, push, num_experts).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, topk_ids: cute.Tensor, topk_weights: cute.Tensor, tokens: cute.Tensor,
               addrs: cute.Tensor, rank: cutlass.Int32, tokens_cap: cutlass.Int32, num_tokens: cutlass.Int32,
               pads: cute.Tensor, err: cute.Tensor, arrivals: cute.Tensor, epoch: cutlass.Int32,
               timeout_us: cutlass.Int32, tokens_all: cute.Tensor, push: cutlass.Int32, num_experts: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        tid = cutlass.Int32(cta) * THREADS + cutlass.Int32(tidx)
        n_threads = cutlass.Int32(n_ctas) * THREADS
        P = cute.size(addrs, mode=[1])
        K = cute.size(topk_ids, mode=[1])
        n = cutlass.min(cutlass.min(num_tokens, tokens_cap), cute.size(x, mode=[0]))
        n_el = tokens_cap * K  # elements of this rank's row of ids / weights
        first = rank * n_el  # (r*Tc + t)*K + j = first + t*K + j

        # 1. ids and weights into every rank (small: issued first, their latency hides under the rows)
        for i in range(tid, n_el, n_threads):
            t = i // K
            j = i - t * K
            idv = cutlass.Int64(-1)
            wbits = cutlass.Int32(0)
            if t < n:
                idv = topk_ids[(t, j)]
                check_expert_id(idv, i, num_experts)
                wbits = topk_weights[(t, j)].bitcast(cutlass.Int32)
            for p in range(P):
                ids_p = _gmem(cutlass.Int64, addrs[(0, p)], first + n_el, 8)
                ids_p[first + i] = idv
                if t < n:
                    w_p = _gmem(cutlass.Int32, addrs[(1, p)], first + n_el, 4)
                    w_p[first + i] = wbits
        # 2. token count into every rank
        if cutlass.Int32(cta) == 0:
            for p in range(cutlass.Int32(tidx), P, THREADS):
                ntok_p = _gmem(cutlass.Int32, addrs[(2, p)], rank + 1, 4)
                ntok_p[rank] = num_tokens
        # 3. own token rows into the local tokens section (push: into every rank's), warp per row
        lane = cutlass.Int32(tidx) % 32
        w = tid // 32
        n_warps = n_threads // 32
        n_vec = cute.size(x, mode=[1]) // VEC
        x_base = x.iterator.toint()
        dst_base = tokens.iterator.toint()
        x_stride = cutlass.Int64(x.stride[0]) * 2  # bytes between rows
        dst_stride = cutlass.Int64(tokens.stride[0]) * 2
        row0 = cutlass.Int64(rank) * cutlass.Int64(tokens_cap)
        to_rank = cutlass.Int64(0)  # push: lane p < P holds rank p's tokens section (+ the row's offset below)
        push_ok = cutlass.Int32(0)
        if push != 0:
            if lane < P:
                to_rank = tokens_all[lane]
                push_ok = cutlass.Int32(1)
        for t in range(w, n, n_warps):
            src = x_base + cutlass.Int64(t) * x_stride
            off = (row0 + cutlass.Int64(t)) * dst_stride
            if push != 0:  # lane p < P holds rank p's row (P <= 32: SymmBuffers.publish)
                copy_row_to_lanes(src, to_rank + off, push_ok, P, n_vec, lane)
            else:
                copy_row(src, dst_base + off, n_vec, lane, False)
        # 4. (epoch > 0) the barrier: the last CTA to finish signals every peer and waits for them
        if epoch > 0:
            cute.arch.fence_acq_rel_sys()  # this thread's stores, peer memory included, before its CTA counts
            cute.arch.sync_threads()
            if tidx == 0:
                count = cute.make_ptr(cutlass.Int32, arrivals.iterator.toint(), cute.AddressSpace.gmem,
                                      assumed_align=4)
                before = cute.arch.atomic_add(count, cutlass.Int32(1), sem="acq_rel", scope="gpu")
                if before == cutlass.Int32(n_ctas) - 1:  # every other CTA has counted: its stores are ordered
                    arrivals[0] = cutlass.Int32(0)  # for the next launch (stream-ordered after this one)
                    cute.arch.fence_acq_rel_sys()
                    for p in range(P):
                        if p != rank:
                            signal_peer(pads[p] + cutlass.Int64(rank) * 4, epoch)
                    for p in range(P):
                        if p != rank:
                            wait_for_peer(pads[rank] + cutlass.Int64(p) * 4, epoch, timeout_us, err)
