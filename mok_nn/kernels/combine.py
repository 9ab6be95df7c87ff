"""Combine in a fixed tree order that does not depend on the expert-parallel degree.

    out[t, :] = tree over leaves l = 0..7 of  sum_{j : leaf(t, j) = l, j ascending}  w[t, j] * rows(t, j)

fp32 throughout, one bf16 (or fp32) rounding at the end. The leaf of slot (t, j) is the group of
its expert: leaf = ids[t, j] // experts_per_leaf, where experts_per_leaf = E / G and
G = gcd(E, 8) (registry.combine_leaves) groups of consecutive experts. The tree is the balanced binary
tree over the 8 leaves, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), in which an empty
leaf (no slot of the token in that group) is skipped, not added as 0.0: a node with one present
child is that child, bit for bit.

Why a tree over expert groups: with expert parallelism over P ranks (P dividing G), rank r owns
the experts of the aligned leaf block [r G / P, (r + 1) G / P), which is one node of the tree.
So an expert rank can send one pre-reduced fp32 row per token (the node of its block: PartialPush)
instead of one bf16 row per slot, and the source finishes the tree from the P nodes
(FinalCombine): every addition happens in the same order as on one GPU, so the results are
bitwise those of EP = 1. The row of every slot is still read once and in ascending j within its
leaf, so the result never depends on timing either.

Kernels (one CTA per token, each thread owns 8 consecutive columns: 16-byte loads; lane j of every
warp loads slot j's row index, leaf and weight once and the loop over j takes them by shuffle, so
no index load sits in the column loop; top_k <= 32. Two forms of Combine's loop, the same additions in
the same order: `mok_combine` one column chunk at a time; `mok_combine_cp`, Combine(staged=True),
top_k <= 16, the loads staged in shared memory by cp.async):
  Combine       the whole tree on one GPU: the forward combine (rows = down-projection outputs,
                w = top-k weights) and the backward's reverse combine into d x (w = 1); also the
                source side of the EP path that pushes one row per slot
  PartialPush   EP, on the expert rank: for every token t of every source rank s, the node of
                this rank's block from its slots routed here, stored (fp32) at row dst_row0 + t of
                part_base[s]: rank s's partials section at [rank, t] (dst_row0 = rank * Tc), or a
                local staging block per source (dst_row0 = 0) that the copy engine sends later;
                tokens without a slot here: nothing stored
  FinalCombine  EP, on the source rank: the tree over the P nodes it received
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cutlass.experimental.primitives import nvvm_wrapper as nv  # cp.async

from .registry import COMBINE_STAGED_ENTRIES as STAGED_ENTRIES  # top_k <= this for Combine(staged=True)
from .registry import COMBINE_LEAVES as LEAVES  # the largest EP degree whose partial sums keep the EP = 1 bits

VEC = 8
THREADS = 128


@dsl_user_op
def _fma(a, b, c, *, loc=None, ip=None) -> cutlass.Float32:
    """a * b + c with one rounding, always: an explicit fma.rn.f32, so that the compiler's choice of
    contracting (or not) a multiply and an add can never differ between the kernels below (it did:
    one fused, one did not), which would break the EP = 1 bits."""
    args = [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c)]
    return cutlass.Float32(
        llvm.inline_asm(T.f32(), args, "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f",
                        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    )


@cute.jit
def _add_to_leaf(acc: cute.Tensor, leaf: cutlass.Int32, vals: cute.Tensor, wj: cutlass.Float32):
    """acc[:, leaf] += wj * vals (fp32 vals; leaf is uniform over the CTA: one branch taken)."""
    for l in cutlass.range_constexpr(LEAVES):
        if leaf == l:
            for v in cutlass.range_constexpr(VEC):
                acc[(v, l)] = _fma(vals[v], wj, acc[(v, l)])


@cute.jit
def _tree(acc: cute.Tensor, mask: cutlass.Int32):
    """acc[:, 0] = the tree sum of the leaves present in mask (bit l: leaf l), empty ones skipped."""
    for level in cutlass.range_constexpr(3):
        width = 1 << level
        for a in cutlass.range_constexpr(0, LEAVES, 2 * width):
            b = a + width
            span = (1 << width) - 1
            if (mask >> b) & span != 0:
                left = acc[(None, a)]
                right = acc[(None, b)]
                if (mask >> a) & span != 0:
                    left.store(left.load() + right.load())
                else:
                    left.store(right.load())


@cute.jit
def _leaf_mask(row_l: cutlass.Int64, leaf_l: cutlass.Int32) -> cutlass.Int32:
    """Bit l set where some lane's slot (row >= 0) sums into leaf l: the same in every warp."""
    bit = cutlass.Int32(0)
    if row_l >= 0:
        bit = cutlass.Int32(1) << leaf_l
    return cute.arch.warp_reduction(bit, lambda a, b: a | b)


SLOTS_IN_FLIGHT = 8  # slots whose 16-byte chunks a thread loads before it adds them (divides 32)


@cute.jit
def _sum_slots(acc: cute.Tensor, frag: cute.Tensor, vals: cute.Tensor, rows: cute.Tensor, c: cutlass.Int32,
               active: cutlass.Boolean, top_k: cutlass.Int32, row_l: cutlass.Int64, leaf_l: cutlass.Int32,
               w_l: cutlass.Float32):
    """acc = the leaf sums of column chunk c over slots j = 0..top_k-1 in order; slot j's row, leaf and
    weight come from lane j by shuffle (every lane of the warp runs the shuffles; only active lanes,
    those with a chunk, load and add; a row < 0 is a slot that does not count here, as are the lanes
    j >= top_k, which hold row -1).

    The chunks of SLOTS_IN_FLIGHT slots are loaded first, all in flight together, then added in
    ascending j (frag holds them): a load per slot waited for before the next was issued left the
    kernel latency bound (deepseek-v3: 0.55 ms for 1 GB, 1.9 TB/s). Same additions, same order."""
    acc.fill(0.0)
    for j0 in range(0, top_k, SLOTS_IN_FLIGHT):
        for u in cutlass.range_constexpr(SLOTS_IN_FLIGHT):
            r = cute.arch.shuffle_sync(row_l, j0 + u)
            if active & (r >= 0):
                src_v = cute.zipped_divide(rows[(r, None)], (VEC,))
                cute.autovec_copy(src_v[(None, c)], frag[(None, u)])
        for u in cutlass.range_constexpr(SLOTS_IN_FLIGHT):
            r = cute.arch.shuffle_sync(row_l, j0 + u)
            leaf = cute.arch.shuffle_sync(leaf_l, j0 + u)
            wj = cute.arch.shuffle_sync(w_l, j0 + u)
            if active & (r >= 0):
                vals.store(frag[(None, u)].load().to(cutlass.Float32))
                _add_to_leaf(acc, leaf, vals, wj)


@cute.jit
def _sum_staged(acc: cute.Tensor, frag: cute.Tensor, vals: cute.Tensor, res: cute.Tensor, buf: cute.Tensor,
                rows: cute.Tensor, out_v: cute.Tensor, c: cutlass.Int32, per: cutlass.Int32, n_vec: cutlass.Int32,
                top_k: cutlass.Int32, row_l: cutlass.Int64, leaf_l: cutlass.Int32, w_l: cutlass.Float32,
                mask: cutlass.Int32):
    """Combine(staged=True)'s loop body: this thread's column chunks c + i * THREADS, i < per
    (= STAGED_ENTRIES // top_k), every slot's 16 bytes of them copied by cp.async into the thread's own entries
    of buf (entry i * top_k + j), all in flight together without holding registers; then each chunk is summed
    exactly as _sum_slots does (zeroed, slots in ascending j, its tree) and stored: the same bits. The entries
    are the thread's own, so its cp.async wait is the only synchronisation."""
    tidx, _, _ = cute.arch.thread_idx()
    for i in range(per):
        ci = c + i * THREADS
        for j in range(top_k):
            r = cute.arch.shuffle_sync(row_l, j)
            if (ci < n_vec) & (r >= 0):
                src_v = cute.zipped_divide(rows[(r, None)], (VEC,))
                nv.cp_async_shared_global(buf[(None, tidx, i * top_k + j)].iterator, src_v[(None, ci)].iterator, 16,
                                          nv.LoadCacheModifier.CG)
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    for i in range(per):
        ci = c + i * THREADS
        acc.fill(0.0)
        for j in range(top_k):
            r = cute.arch.shuffle_sync(row_l, j)
            leaf = cute.arch.shuffle_sync(leaf_l, j)
            wj = cute.arch.shuffle_sync(w_l, j)
            if (ci < n_vec) & (r >= 0):
                cute.autovec_copy(buf[(None, tidx, i * top_k + j)], frag)
                vals.store(frag.load().to(cutlass.Float32))
                _add_to_leaf(acc, leaf, vals, wj)
        if ci < n_vec:
            _tree(acc, mask)
            res.store(acc[(None, 0)].load().to(res.element_type))
            cute.autovec_copy(res, out_v[(None, ci)])


class Combine:
    def __init__(self, staged: bool = False):
        # Two loops, same additions in the same order, so the same bits (which one runs: cuda_backend.combine).
        # Any top_k <= 32, one column chunk at a time (_sum_slots); staged: top_k <= STAGED_ENTRIES, the loads
        # staged in shared memory by cp.async (_sum_staged).
        self.staged = staged

    @cute.jit
    def __call__(
        self,
        rows: cute.Tensor,  # (R, H) bf16
        pos: cute.Tensor,  # (T, k) int64, row index of (t, j)
        w: cute.Tensor,  # (T, k) fp32
        ids: cute.Tensor,  # (T, k) int64, expert of (t, j)
        out: cute.Tensor,  # (T, H) bf16
        experts_per_leaf: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        num_tokens = cute.size(out, mode=[0])
        self.kernel(rows, pos, w, ids, out, experts_per_leaf).launch(
            grid=[num_tokens, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, rows: cute.Tensor, pos: cute.Tensor, w: cute.Tensor, ids: cute.Tensor, out: cute.Tensor,
               experts_per_leaf: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        hidden = cute.size(out, mode=[1])
        top_k = cute.size(pos, mode=[1])
        n_vec = hidden // VEC
        # lane j of every warp holds slot j's row, leaf and weight (top_k <= 32)
        j = cutlass.Int32(tidx) % 32
        row_l, leaf_l, w_l = cutlass.Int64(-1), cutlass.Int32(0), cutlass.Float32(0.0)
        if j < top_k:
            row_l = pos[(t, j)]
            leaf_l = cutlass.Int32(ids[(t, j)] // experts_per_leaf)
            w_l = w[(t, j)]
        mask = _leaf_mask(row_l, leaf_l)
        out_v = cute.zipped_divide(out[(t, None)], (VEC,))
        acc = cute.make_rmem_tensor((VEC, LEAVES), cutlass.Float32)
        frag = cute.make_rmem_tensor((VEC, SLOTS_IN_FLIGHT), rows.element_type)
        vals = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        res = cute.make_rmem_tensor((VEC,), out.element_type)
        if cutlass.const_expr(self.staged):
            smem = cutlass.utils.SmemAllocator()
            # entry-major: at one entry the threads' 16-byte pieces are consecutive (no bank conflicts)
            buf = smem.allocate_tensor(rows.element_type, cute.make_layout(
                (VEC, THREADS, STAGED_ENTRIES), stride=(1, VEC, VEC * THREADS)), 16)
            one = cute.make_rmem_tensor((VEC,), rows.element_type)
            per = STAGED_ENTRIES // top_k
            for c0 in range(0, n_vec, THREADS * per):
                _sum_staged(acc, one, vals, res, buf, rows, out_v, c0 + cutlass.Int32(tidx), per, n_vec, top_k, row_l,
                            leaf_l, w_l, mask)
        else:
            for c0 in range(0, n_vec, THREADS):
                c = c0 + cutlass.Int32(tidx)
                _sum_slots(acc, frag, vals, rows, c, c < n_vec, top_k, row_l, leaf_l, w_l)
                if c < n_vec:
                    _tree(acc, mask)
                    res.store(acc[(None, 0)].load().to(out.element_type))
                    cute.autovec_copy(res, out_v[(None, c)])


class PartialPush:
    @cute.jit
    def __call__(
        self,
        rows: cute.Tensor,  # (R, H) bf16: this rank's rows (schedule order)
        slot_row: cute.Tensor,  # (P*Tc*k,) int64: row of global slot (s*Tc + t)*k + j (valid where routed here)
        w_all: cute.Tensor,  # (>= P*Tc*k,) fp32: the all-gathered top-k weights (read only if weighted)
        ids_all: cute.Tensor,  # (P, Tc, k) int64: the all-gathered top-k ids (-1 past a rank's tokens)
        part_base: cute.Tensor,  # (P,) int64: address of every rank's partials section [P, Tc, H] fp32
        rank: cutlass.Int32,
        experts_per_rank: cutlass.Int32,
        experts_per_leaf: cutlass.Int32,
        weighted: cutlass.Int32,  # 1: w_all[slot] * row (forward), 0: the row itself (backward d x)
        dst_row0: cutlass.Int32,  # the node of (s, t) goes to row dst_row0 + t of part_base[s]
        stream: cuda.CUstream,
    ):
        n = cute.size(ids_all, mode=[0]) * cute.size(ids_all, mode=[1])
        self.kernel(rows, slot_row, w_all, ids_all, part_base, rank, experts_per_rank, experts_per_leaf,
                    weighted, dst_row0).launch(grid=[n, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, rows: cute.Tensor, slot_row: cute.Tensor, w_all: cute.Tensor, ids_all: cute.Tensor,
               part_base: cute.Tensor, rank: cutlass.Int32, experts_per_rank: cutlass.Int32,
               experts_per_leaf: cutlass.Int32, weighted: cutlass.Int32, dst_row0: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        ep_size = cute.size(ids_all, mode=[0])
        tc = cute.size(ids_all, mode=[1])
        top_k = cute.size(ids_all, mode=[2])
        num_rows = cute.size(rows, mode=[0])
        hidden = cute.size(rows, mode=[1])
        n_vec = hidden // VEC
        # CTA b takes token t = b // P of source s = b % P: the sources interleave in launch order, so
        # the stores to every peer (and the local ones) run side by side through the whole kernel, and
        # both directions of each NVLink carry data at once (source-major order sent to one peer at a
        # time: rank 1's nodes crossed during the first half of the grid, rank 0's during the second)
        s = cutlass.Int32(b) % ep_size
        t = cutlass.Int32(b) // ep_size
        i = s * tc + t
        lo = rank * experts_per_rank
        # lane j of every warp holds slot j's row (-1 unless routed here; rows past the capacity: an
        # overflow, flagged), leaf and weight (top_k <= 32)
        j = cutlass.Int32(tidx) % 32
        row_l, leaf_l, w_l = cutlass.Int64(-1), cutlass.Int32(0), cutlass.Float32(1.0)
        if j < top_k:
            e = cutlass.Int32(ids_all[(s, t, j)])
            slot = cutlass.Int64(i) * top_k + j
            r = slot_row[slot]
            if (e >= lo) & (e < lo + experts_per_rank) & (r < num_rows):
                row_l = r
                leaf_l = e // experts_per_leaf
                if weighted != 0:
                    w_l = w_all[slot]
        mask = _leaf_mask(row_l, leaf_l)
        if mask != 0:
            dst = cute.make_tensor(
                cute.make_ptr(cutlass.Float32, part_base[s] + (cutlass.Int64(dst_row0) + t) * hidden * 4,
                              cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout((VEC, n_vec)),
            )
            acc = cute.make_rmem_tensor((VEC, LEAVES), cutlass.Float32)
            frag = cute.make_rmem_tensor((VEC, SLOTS_IN_FLIGHT), rows.element_type)
            vals = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            res = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            for c0 in range(0, n_vec, THREADS):
                c = c0 + cutlass.Int32(tidx)
                _sum_slots(acc, frag, vals, rows, c, c < n_vec, top_k, row_l, leaf_l, w_l)
                if c < n_vec:
                    _tree(acc, mask)
                    res.store(acc[(None, 0)].load())
                    cute.autovec_copy(res, dst[(None, c)])


class FinalCombine:
    @cute.jit
    def __call__(
        self,
        parts: cute.Tensor,  # (P, Tc, H) fp32: this rank's partials section, [q, t] from rank q
        ids: cute.Tensor,  # (T, k) int64: this rank's top-k ids
        flags: cute.Tensor,  # (F,) int32: any non-zero entry -> NaN outputs (the step's error flags)
        out: cute.Tensor,  # (T, H) bf16
        experts_per_rank: cutlass.Int32,
        experts_per_leaf: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        num_tokens = cute.size(out, mode=[0])
        self.kernel(parts, ids, flags, out, experts_per_rank, experts_per_leaf).launch(
            grid=[num_tokens, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, parts: cute.Tensor, ids: cute.Tensor, flags: cute.Tensor, out: cute.Tensor,
               experts_per_rank: cutlass.Int32, experts_per_leaf: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        hidden = cute.size(out, mode=[1])
        top_k = cute.size(ids, mode=[1])
        n_vec = hidden // VEC
        leaves_per_rank = experts_per_rank // experts_per_leaf
        bad = cutlass.Int32(0)
        for f in range(cute.size(flags, mode=[0])):
            bad = bad | flags[f]
        # rank q's node sits at leaf q * leaves_per_rank; present if a slot of t went to rank q
        mask = cutlass.Int32(0)
        for j in range(top_k):
            q = cutlass.Int32(ids[(t, j)]) // experts_per_rank
            mask = mask | (cutlass.Int32(1) << (q * leaves_per_rank))
        out_v = cute.zipped_divide(out[(t, None)], (VEC,))
        acc = cute.make_rmem_tensor((VEC, LEAVES), cutlass.Float32)
        res = cute.make_rmem_tensor((VEC,), out.element_type)
        for c in range(tidx, n_vec, THREADS):
            acc.fill(0.0)
            for l in cutlass.range_constexpr(LEAVES):
                if (mask >> l) & 1 != 0:
                    q = l // leaves_per_rank
                    src_v = cute.zipped_divide(parts[(q, t, None)], (VEC,))
                    # straight into the leaf's registers: the ranks' loads are in flight together (through
                    # one staging fragment each waited for the one before)
                    cute.autovec_copy(src_v[(None, c)], acc[(None, l)])
            _tree(acc, mask)
            if bad != 0:
                acc.fill(float("nan"))
            res.store(acc[(None, 0)].load().to(out.element_type))
            cute.autovec_copy(res, out_v[(None, c)])
