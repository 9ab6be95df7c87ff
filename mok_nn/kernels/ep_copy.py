"""Grid-stride row copies of the EP path (dispatch pull, combine push) and of the gathers, warp per row.

PullPeers:     dst[p*Tc + t] = section p [pull_src[p, t]] for pull_src[p, t] >= 0, where
               section p starts at src_base[p] (rank p's tokens section as mapped here) and
               has dst's row stride: the pulls of every peer in one launch.
PushPeers:     section row_rank[r] [row_slot[r]] = src[r] for row_rank[r] >= 0, where section
               p starts at dst_base[p] and its rows are contiguous (H elements): the combine
               push to every rank (own one included) in one launch.
GatherRows:    dst[r] = src[idx[r]] where idx[r] < src rows, else a zero row: the GEMM's A rows
               in schedule order (padding rows zero), from x at EP = 1 and from the tokens / dy
               sections at EP > 1 (cuda_backend.take_rows). Rows of the tiles past the last segment
               (tile_expert < 0; the GEMMs skip them) are not written: at EP = 2 with the default
               capacity (2x the balanced load) they are about half the rows.
ScatterRows:   the same rows as GatherRows, walked from the source side: warp per source row u, which
               it reads once and stores to each of its slots' rows slot_row[u, j] (those whose
               row_src is u); then zero rows where row_src is not a source row. A source row used by
               k' slots is read once instead of k' times, which matters where src does not fit in L2
               (the EP tokens sections: P*Tc rows).
ScatterRowsPeers: ScatterRows reading source row p*Tc + t from rank p's own section (over NVLink for a
               peer): the EP forward's dispatch and gather in one launch (cuda_ep.token_rows_mode
               'scatter'), each peer row that some row here takes crossing NVLink once.

A fixed grid of a few CTAs per SM (num_ctas, chosen by the caller) walks the rows, so rows with an
index -1 cost no CTA launch; each warp copies whole rows with every lane issuing all its 16-byte
loads of the row before its stores (copy_row: UNROLL = 8 loads per lane, a 4 KiB row per warp in
flight), which is what a pull over NVLink needs (latency bound: bytes in flight decide its rate). The indices are read
ahead: lane l of a warp loads the indices of the warp's (b + l)-th row, all 32 loads in flight
at once, and the warp then walks those 32 rows taking the addresses by shuffle, so a skipped
row costs a shuffle and a branch, not a dependent global load.

Warp w of the grid (W warps) takes rows w, w + W, w + 2W, ... Every dst row is written once by
one warp (the caller's indices are unique): the result does not depend on timing or on the grid.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .mx_quant import mx_values_of_lane_block
from .registry import EP_COPY_THREADS as THREADS
from .registry import TILE_M

VEC = 8  # bf16 per 16-byte access
UNROLL = 8  # 16-byte loads in flight per lane
WARPS = THREADS // 32
SKIP, COPY, ZERO = 0, 1, 2  # what a warp does with the row one of its lanes holds (_act_batch)


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
                      n_vec: cutlass.Int32, lane: cutlass.Int32, mx: cutlass.Int32 = 0):
    """One warp reads the row at src_addr once and stores it to dst_addr of every lane j < count with ok_i = 1
    (the whole warp calls it: the addresses come by shuffle), UNROLL 16-byte loads per lane in flight.
    mx != 0: it stores the row's MXFP8 values along the row instead (blocks of 32 columns: 4 lanes' vectors),
    with mok_mx_quant's arithmetic (mode 0), so the same bits as gathering mx_values' rows."""
    frag = cute.make_rmem_tensor((VEC, UNROLL), cutlass.BFloat16)
    src = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, src_addr, cute.AddressSpace.gmem, assumed_align=16),
                           cute.make_layout((VEC, n_vec)))
    for c0 in range(0, n_vec, 32 * UNROLL):  # every lane takes every step (the shuffles need the whole warp)
        for u in cutlass.range_constexpr(UNROLL):
            c = c0 + lane + 32 * u
            if c < n_vec:
                cute.autovec_copy(src[(None, c)], frag[(None, u)])
        if mx != 0:
            _mx_values_in_place(frag, c0 + lane, n_vec)
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


@cute.jit
def _mx_values_in_place(frag: cute.Tensor, c_first: cutlass.Int32, n_vec: cutlass.Int32):
    """frag's vectors (u: this lane's vector c_first + 32 u of the row) as their MXFP8 values along the row. A
    block of 32 columns is the vectors of 4 adjacent lanes (n_vec % 4 == 0: the caller's rows are whole blocks),
    so its largest magnitude takes two shuffles; lanes past the row hold no vector (amax 0) and store nothing."""
    x = cute.make_rmem_tensor((VEC,), cutlass.Float32)
    for u in cutlass.range_constexpr(UNROLL):
        mx_values_of_lane_block(frag[(None, u)], x, c_first + 32 * u < n_vec)


@cute.jit
def _copy_batch(s_addr: cutlass.Int64, d_addr: cutlass.Int64, ok: cutlass.Boolean, count: cutlass.Int32,
                n_vec: cutlass.Int32, lane: cutlass.Int32):
    """The warp copies the rows its lanes 0..count-1 hold (lane j: src / dst address, ok)."""
    act = cutlass.Int32(SKIP)
    if ok:
        act = cutlass.Int32(COPY)
    _act_batch(s_addr, d_addr, act, count, n_vec, lane)


@cute.jit
def _act_batch(s_addr: cutlass.Int64, d_addr: cutlass.Int64, act: cutlass.Int32, count: cutlass.Int32,
               n_vec: cutlass.Int32, lane: cutlass.Int32):
    """For each lane j < count in turn, the warp copies its row (act COPY: src / dst address), zero-fills its
    dst row (ZERO) or does nothing (SKIP)."""
    for j in range(count):
        a = cute.arch.shuffle_sync(act, j)
        if a == COPY:
            s = cute.arch.shuffle_sync(s_addr, j)
            d = cute.arch.shuffle_sync(d_addr, j)
            copy_row(s, d, n_vec, lane, False)
        else:
            if a == ZERO:
                d = cute.arch.shuffle_sync(d_addr, j)
                copy_row(d, d, n_vec, lane, True)


@cute.jit
def _live_row(r: cutlass.Int32, tile_expert: cute.Tensor) -> cutlass.Boolean:
    """False for a row of a tile past the last segment (tile_expert < 0, where the table covers the row):
    the GEMMs skip those tiles, so the gathers leave their rows unwritten."""
    t = r // TILE_M
    live = True
    if t < cute.size(tile_expert, mode=[0]):
        if tile_expert[t] < 0:
            live = False
    return live


@cute.jit
def _rows_geometry(src: cute.Tensor, dst: cute.Tensor):
    """(16-byte vectors per row, src address, bytes between src rows, dst address, bytes between dst rows)
    of two bf16 row tensors."""
    return (cute.size(dst, mode=[1]) // VEC, src.iterator.toint(), cutlass.Int64(src.stride[0]) * 2,
            dst.iterator.toint(), cutlass.Int64(dst.stride[0]) * 2)


@cute.jit
def _warp_slice(n: cutlass.Int32):
    """(this warp's first row, rows per grid step W, number of rows this warp copies, lane)."""
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    n_ctas, _, _ = cute.arch.grid_dim()
    w = cutlass.Int32(cta) * WARPS + cutlass.Int32(tidx) // 32
    step = cutlass.Int32(n_ctas) * WARPS
    mine = cutlass.Int32(0)
    if w < n:
        mine = (n - w + step - 1) // step
    return w, step, mine, cutlass.Int32(tidx) % 32


class PullPeers:
    @cute.jit
    def __call__(
        self,
        src_base: cute.Tensor,  # (P,) int64: address of each rank's section on this GPU
        pull_src: cute.Tensor,  # (P, Tc) int64: row of rank p's section, or -1
        dst: cute.Tensor,  # (R, H) bf16: the local section, R >= P*Tc
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(src_base, pull_src, dst).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src_base: cute.Tensor, pull_src: cute.Tensor, dst: cute.Tensor):
        tc = cute.size(pull_src, mode=[1])
        n = cute.size(pull_src, mode=[0]) * tc
        n_vec = cute.size(dst, mode=[1]) // VEC
        dst_base = dst.iterator.toint()
        stride = cutlass.Int64(dst.stride[0]) * 2  # bytes between rows, the same in every rank's section
        w, step, mine, lane = _warp_slice(n)
        for b in range(0, mine, 32):
            k = b + lane
            s_addr = cutlass.Int64(0)
            d_addr = cutlass.Int64(0)
            ok = False
            if k < mine:
                i = w + k * step
                p = i // tc
                s = pull_src[(p, i - p * tc)]
                if s >= 0:
                    ok = True
                    s_addr = src_base[p] + s * stride
                    d_addr = dst_base + cutlass.Int64(i) * stride
            _copy_batch(s_addr, d_addr, ok, cutlass.min(mine - b, 32), n_vec, lane)


class PushPeers:
    @cute.jit
    def __call__(
        self,
        src: cute.Tensor,  # (M, H) bf16: rows to send
        dst_base: cute.Tensor,  # (P,) int64: address of each rank's section on this GPU (rows of H)
        row_rank: cute.Tensor,  # (M,) int64: destination rank of row r, -1: not sent
        row_slot: cute.Tensor,  # (M,) int64: row of that rank's section
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(src, dst_base, row_rank, row_slot).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1],
                                                              stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst_base: cute.Tensor, row_rank: cute.Tensor, row_slot: cute.Tensor):
        n = cute.size(row_rank, mode=[0])
        n_vec = cute.size(src, mode=[1]) // VEC
        src_base = src.iterator.toint()
        src_stride = cutlass.Int64(src.stride[0]) * 2
        row_bytes = cutlass.Int64(cute.size(src, mode=[1])) * 2
        w, step, mine, lane = _warp_slice(n)
        for b in range(0, mine, 32):
            k = b + lane
            s_addr = cutlass.Int64(0)
            d_addr = cutlass.Int64(0)
            ok = False
            if k < mine:
                i = w + k * step
                p = row_rank[i]
                if p >= 0:
                    ok = True
                    s_addr = src_base + cutlass.Int64(i) * src_stride
                    d_addr = dst_base[p] + row_slot[i] * row_bytes
            _copy_batch(s_addr, d_addr, ok, cutlass.min(mine - b, 32), n_vec, lane)


class GatherRows:
    @cute.jit
    def __call__(
        self,
        src: cute.Tensor,  # (R, H) bf16
        idx: cute.Tensor,  # (M,) int64: row of src, or >= R for a zero row
        tile_expert: cute.Tensor,  # (n,) int32: rows of tiles t < n with tile_expert[t] < 0 are not written
        dst: cute.Tensor,  # (M, H) bf16
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(src, idx, tile_expert, dst).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, idx: cute.Tensor, tile_expert: cute.Tensor, dst: cute.Tensor):
        n = cute.size(idx, mode=[0])
        num_src = cutlass.Int64(cute.size(src, mode=[0]))
        n_vec, src_base, src_stride, dst_base, dst_stride = _rows_geometry(src, dst)
        w, step, mine, lane = _warp_slice(n)
        for b in range(0, mine, 32):
            k = b + lane
            s_addr = cutlass.Int64(0)
            d_addr = cutlass.Int64(0)
            act = cutlass.Int32(SKIP)
            if k < mine:
                i = w + k * step
                if _live_row(i, tile_expert):
                    act = cutlass.Int32(ZERO)
                    t = idx[i]
                    d_addr = dst_base + cutlass.Int64(i) * dst_stride
                    if (t >= 0) & (t < num_src):
                        act = cutlass.Int32(COPY)
                        s_addr = src_base + t * src_stride
            _act_batch(s_addr, d_addr, act, cutlass.min(mine - b, 32), n_vec, lane)

class ScatterRows:
    """dst[r] = src[row_src[r]] where 0 <= row_src[r] < N, else a zero row (GatherRows' result, rows of tiles
    past the last segment also left unwritten), given
    slot_row [N, k]: the dst row of each slot (u, j), where row_src of that row is u (other values: the
    slot has no row here). Work units: the N source rows (warp per row, read once, stored to each of its
    rows), then batches of 32 dst rows (zero rows). Every dst row is written once (row_src names one
    source row per row, and the schedule gives it by exactly one slot). mx != 0: the source rows' MXFP8
    values along the row (H % 32 == 0; precision="mxfp8": the GEMM operand made in the gather, no pass over
    src before it)."""

    @cute.jit
    def __call__(
        self,
        src: cute.Tensor,  # (R, H) bf16, R >= N
        slot_row: cute.Tensor,  # (N, k) int64: dst row of slot (u, j), or a value past dst
        row_src: cute.Tensor,  # (M,) int64: src row of dst row r; outside [0, N): a zero row
        tile_expert: cute.Tensor,  # (n,) int32: rows of tiles t < n with tile_expert[t] < 0 are not written
        dst: cute.Tensor,  # (M, H) bf16
        mx: cutlass.Int32,  # nonzero: MXFP8 values of the source rows
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(src, slot_row, row_src, tile_expert, dst, mx).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=3,
            preferred_smem_carveout=0, stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, slot_row: cute.Tensor, row_src: cute.Tensor, tile_expert: cute.Tensor,
               dst: cute.Tensor, mx: cutlass.Int32):
        n_src = cute.size(slot_row, mode=[0])
        m = cute.size(row_src, mode=[0])
        n_vec, src_base, src_stride, dst_base, dst_stride = _rows_geometry(src, dst)
        w, step, mine, lane = _warp_slice(n_src + (m + 31) // 32)
        for b in range(mine):
            unit = w + b * step
            if unit < n_src:
                _scatter_source_row(unit, src_base + cutlass.Int64(unit) * src_stride, slot_row, row_src, dst_base,
                                    dst_stride, n_vec, lane, mx)
            else:
                _zero_rows_batch((unit - n_src) * 32, n_src, row_src, tile_expert, dst_base, dst_stride, n_vec, lane)


class ScatterRowsPeers:
    """ScatterRows over every rank's tokens (or dy) section as mapped on this GPU: source row u = p*Tc + t
    is read from rank p's own section (src_base[p] + u * row stride; each rank keeps its own rows at rows
    p*Tc.. of its section, and the row stride is the same in every rank's section), so a peer's token row
    crosses NVLink once, straight into this rank's GEMM rows, and only where some row here takes it: the
    rows need not be pushed into the local section before the barrier. Work units interleave the ranks
    (unit i: rank i % P, token i // P) so that the NVLink reads run beside the local ones, not after them.
    The same rows as ScatterRows over a section holding every rank's rows."""

    @cute.jit
    def __call__(
        self,
        src: cute.Tensor,  # (R, H) bf16: this rank's section (its row stride is every rank's)
        src_base: cute.Tensor,  # (P,) int64: address of each rank's section on this GPU
        slot_row: cute.Tensor,  # (P*Tc, k) int64: dst row of slot (u, j), or a value past dst
        row_src: cute.Tensor,  # (M,) int64: src row of dst row r; outside [0, P*Tc): a zero row
        tile_expert: cute.Tensor,  # (n,) int32: rows of tiles t < n with tile_expert[t] < 0 are not written
        dst: cute.Tensor,  # (M, H) bf16
        num_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(src, src_base, slot_row, row_src, tile_expert, dst).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, src_base: cute.Tensor, slot_row: cute.Tensor, row_src: cute.Tensor,
               tile_expert: cute.Tensor, dst: cute.Tensor):
        n_src = cute.size(slot_row, mode=[0])
        n_ranks = cute.size(src_base, mode=[0])
        tc = n_src // n_ranks
        m = cute.size(row_src, mode=[0])
        n_vec, _, src_stride, dst_base, dst_stride = _rows_geometry(src, dst)
        w, step, mine, lane = _warp_slice(n_src + (m + 31) // 32)
        for b in range(mine):
            i = w + b * step
            if i < n_src:
                p = i % n_ranks
                unit = p * tc + i // n_ranks
                _scatter_source_row(unit, src_base[p] + cutlass.Int64(unit) * src_stride, slot_row, row_src,
                                    dst_base, dst_stride, n_vec, lane)
            else:
                _zero_rows_batch((i - n_src) * 32, n_src, row_src, tile_expert, dst_base, dst_stride, n_vec, lane)


@cute.jit
def _scatter_source_row(unit: cutlass.Int32, s_addr: cutlass.Int64, slot_row: cute.Tensor, row_src: cute.Tensor,
                        dst_base: cutlass.Int64, dst_stride: cutlass.Int64, n_vec: cutlass.Int32,
                        lane: cutlass.Int32, mx: cutlass.Int32 = 0):
    """The warp reads source row `unit` (at s_addr) once, if any of its slots' rows takes it, and stores it (mx:
    its MXFP8 values) to each of those rows (lane j < k: slot j's row, kept where that row's row_src really is
    this unit)."""
    top_k = cute.size(slot_row, mode=[1])
    m = cute.size(row_src, mode=[0])
    d_addr = cutlass.Int64(0)
    ok_i = cutlass.Int32(0)
    if lane < top_k:
        r = slot_row[(unit, lane)]
        if (r >= 0) & (r < m):
            if row_src[r] == unit:
                d_addr = dst_base + r * dst_stride
                ok_i = cutlass.Int32(1)
    count = cutlass.Int32(0)
    for j in range(top_k):
        count = count + cute.arch.shuffle_sync(ok_i, j)
    if count > 0:  # a row with no slot here is not read
        copy_row_to_lanes(s_addr, d_addr, ok_i, top_k, n_vec, lane, mx)


@cute.jit
def _zero_rows_batch(first: cutlass.Int32, n_src: cutlass.Int32, row_src: cute.Tensor, tile_expert: cute.Tensor,
                     dst_base: cutlass.Int64, dst_stride: cutlass.Int64, n_vec: cutlass.Int32, lane: cutlass.Int32):
    """dst rows first .. first + 31, lane l checking row first + l: the warp zero-fills those without a
    source row (row_src outside [0, n_src)), leaving the rows of tiles past the last segment unwritten."""
    m = cute.size(row_src, mode=[0])
    r = first + lane
    d_addr = cutlass.Int64(0)
    act = cutlass.Int32(SKIP)
    if r < m:
        if _live_row(r, tile_expert):
            t = row_src[r]
            if (t < 0) | (t >= cutlass.Int64(n_src)):
                act = cutlass.Int32(ZERO)
                d_addr = dst_base + cutlass.Int64(r) * dst_stride
    _act_batch(d_addr, d_addr, act, cutlass.min(m - first, 32), n_vec, lane)
