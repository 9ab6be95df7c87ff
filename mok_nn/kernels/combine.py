"""Combine: out[t, :] = sum_j w[t, j] * rows[pos[t, j], :], in fixed order j = 0..k-1, fp32.

Used for the forward combine (rows = the down-projection outputs in expert
order, w = top-k weights) and for the backward reverse combine into d x
(rows = d x of each routed row, w = 1). One CTA per token; each thread owns
8 consecutive columns (16-byte loads and stores) and walks j in order, so the
sum order never depends on timing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

VEC = 8
THREADS = 128


class Combine:
    @cute.jit
    def __call__(
        self,
        rows: cute.Tensor,  # (R, H) bf16
        pos: cute.Tensor,  # (T, k) int64, row index of (t, j)
        w: cute.Tensor,  # (T, k) fp32
        out: cute.Tensor,  # (T, H) bf16
        stream: cuda.CUstream,
    ):
        num_tokens = cute.size(out, mode=[0])
        self.kernel(rows, pos, w, out).launch(
            grid=[num_tokens, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, rows: cute.Tensor, pos: cute.Tensor, w: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        hidden = cute.size(out, mode=[1])
        top_k = cute.size(pos, mode=[1])
        n_vec = hidden // VEC
        # (VEC, H/VEC) views of one output row and of the rows table.
        out_v = cute.zipped_divide(out[(t, None)], (VEC,))
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        frag = cute.make_rmem_tensor((VEC,), rows.element_type)
        res = cute.make_rmem_tensor((VEC,), out.element_type)
        for c in range(tidx, n_vec, THREADS):
            acc.fill(0.0)
            for j in range(top_k):
                p = pos[(t, j)]
                wj = w[(t, j)]
                src_v = cute.zipped_divide(rows[(p, None)], (VEC,))
                cute.autovec_copy(src_v[(None, c)], frag)
                acc.store(acc.load() + frag.load().to(cutlass.Float32) * wj)
            res.store(acc.load().to(out.element_type))
            cute.autovec_copy(res, out_v[(None, c)])
