"""Varlen-M grouped GEMM for Hopper (sm_90a): persistent, warp-specialised, TMA + wgmma.

    C[m, n] = sum_k A[m, k] * B[n, k, e(m)]      e(m) = tile_expert[m // TILE_M]

A holds the rows of all experts one after the other, each expert's segment
padded to a multiple of TILE_M (the schedule does the padding), so every
M-tile belongs to exactly one expert; `tile_expert` names it, or is negative
for tiles past the last segment (those tiles are skipped). B is the stacked
expert weights [N, K, E]; it may be K-major (gate_up_proj / down_proj in the
forward) or N-major (the same weights read transposed in the backward dgrad).

Structure: warp group 0 is the producer (one warp issues TMA loads of the A
and B tiles into a ring of shared-memory stages); warp groups 1 and 2 are the
consumers (each owns 64 rows of the 128-row tile, issues wgmma, and stores its
bf16 result through shared memory with TMA). Both sides walk the same static
persistent schedule of (m-tile, n-tile) pairs, so no inter-role queue is needed
beyond the stage ring. Every output element is written once by one CTA with a
fixed K order: results are bitwise reproducible.

seg_end / seg_rows: each expert's padded segment end and its rows. A cooperative
consumer warp group whose 64 rows all lie past seg_rows issues no wgmma for that
tile (it still waits on and releases every stage, and stores its zero accumulator).
The callers pass the static cooperative kernels the padded segment sizes as seg_rows
(Schedule.seg_rows_for), so none skips: with static tiles, skipping the padding halves
measured slower on H200 (docs/kernels.md). The kernels with dynamic tiles (class
VarlenMGroupedGemmDyn, tile_queue.py: a CTA whose tile ran short claims the next one)
get the routed rows and skip. The ping-pong kernels get the routed rows too: a warp
group whose tile has at most 64 of them runs the first 64-row MMA block only
(mma_mainloop's first_m_only; the same bits, a little faster at qwen3).

Full-tile epilogue (full_epi=True, bf16 output): the shared-memory epilogue
buffer holds the whole output tile, so the consumers write all of it, issue the
TMA stores, and go on to the next tile's mainloop; the wait for those stores to
have read shared memory comes at the start of the next tile's epilogue. The
default (full_epi=False) cycles 4 buffers of 128 x 32 and waits for buffer
reuse inside the epilogue. The stores are the same either way: bitwise equal.

SwiGLU epilogue (act="swiglu" / "swiglu_oai", class VarlenMGroupedGemmAct; the
forward's gate/up GEMM, B = gate_up_proj K-major, I % 128 == 0): output tile n
loads B as two 128-row halves, gate rows n*128.. and up rows I + n*128.., so
the accumulator holds matching gate (columns 0-127) and up (128-255) values.
The epilogue stores both into gate_up (columns n*128.. and I + n*128..) and
h = act(gate, up) from the bf16-rounded values with the formulas of
swiglu._act: bitwise what mok_gemm_bk followed by mok_act_fwd_* gives. With
full_epi (cooperative only) the consumers only put the whole gate/up tile into
smem and go on to the next mainloop; the producer warp group's idle warps 1-3
store it, compute h from it and store h (hand_tile_to_helpers, _act_helper, two
mbarriers between them). Without it the consumers store 12 sub-tiles through 4
rotating buffers and compute h themselves while the tensor cores wait. With the
run-time argument h_mx (precision="mxfp8") the helpers store h's MXFP8 values
along I instead (mx_quant.py's arithmetic); the split epilogue ignores it.

dSwiGLU epilogue (dact="swiglu" / "swiglu_oai", class VarlenMGroupedGemmDact; the backward's
dgrad of down: A = dy rows, B = down_proj N-major, I % 256 == 0): the accumulator is
dh = dy @ W2[e] (fp32), never stored. Each thread loads the bf16 gate and up values at its
accumulator positions straight from the forward's gate_up (sub-tile 0 before the mainloop,
sub-tile e + 1 during sub-tile e's stores) and computes, with the formulas of
swiglu.ActBackward, d gate = dg * (dh * w), d up = du * (dh * w) and w * h (h rounded to
bf16 as the forward stored it): three bf16 sub-tile stores per 32 columns (smem buffers
0-2, one bulk group, waited for before the next sub-tile reuses them), bitwise what
mok_gemm_bn_f32 + mok_act_bwd_* give. The top-k weight gradient needs sum(dh * h) over all
of I: each thread sums its columns of a row, the 4 lanes holding a row reduce by a fixed
butterfly, and lane 0 writes dw_part[n_tile, row]; the caller sums the I/256 partials in a
fixed order (cuda_backend.pairwise_sum), so the result depends on the row only.

The GEMMs on MXFP8 weights (the forward's, and precision="mxfp8"'s dgrad on MXFP8-only weights) are mx_swapped.py's.

All extents (M, N, K, E) are run-time values, so one compiled variant serves
every model shape; only the operand majorness and the tile shape are baked in.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import cuda.bindings.driver as cuda

from .tile_queue import RING_STAGES, DynamicTileScheduler, make_tile_pipe
from .gemm_layouts import mma_and_smem_layouts, smem_tensors, stage_count, tile_views
from .gemm_consumer import (
    consumer_roles, epilogue_stores, epilogue_views, hand_tile_to_helpers, helpers_send_h, mma_mainloop, mma_operands,
    pingpong_turn, smem_storage, step_over, store_sync, store_tile_full, store_tile_split, subtile_to_smem,
)
from .registry import TILE_M
from .swiglu import _act, act_piece


@cute.jit
def segment_extent(expert, seg_end, seg_rows):
    """(first row, rows, row tiles) of an expert's segment: its seg_rows rounded up to TILE_M end at seg_end."""
    rows = seg_rows[expert]
    tiles = (rows + TILE_M - 1) // TILE_M
    return seg_end[expert] - tiles * TILE_M, rows, tiles


@cute.jit
def expert_band_tile(linear, other_tiles, tile_expert, seg_end, seg_rows):
    """Linear tile index -> (row tile, other tile, expert) in expert bands: each expert's schedule row tiles make one
    band, row tiles fastest inside it, so the tiles that read the same weight tile (the same B column stripe, or the
    same W rows of the swapped MX kernels) run in the same wave of persistent CTAs. The band of the expert owning
    row tile linear // other_tiles spans row tiles [first, first + its tiles) with first its segment's start tile:
    the same range of linear as in the other-tiles-fastest order, which a row tile outside its own expert's segment
    (not a schedule this kernel is given) or past the last segment keeps."""
    row = linear // other_tiles
    other = linear - row * other_tiles
    expert = tile_expert[row]
    if expert >= 0:
        seg_start, _, band = segment_extent(expert, seg_end, seg_rows)
        first = seg_start // TILE_M
        if row >= first:
            if row < first + band:
                within = linear - first * other_tiles
                row = first + within % band
                other = within // band
    return row, other, expert


class VarlenMGroupedGemm:
    """One compiled variant: tile (128, tile_n, 64), B K-major or N-major, split or full-tile epilogue."""

    def __init__(
        self, tile_n: int = 256, num_sms: int = 132, full_epi: bool = False, act: str | None = None,
        dact: str | None = None, pingpong: bool = False, cluster_n: int = 1, push: bool = False,
    ):
        assert tile_n in (128, 256)
        # pingpong: each consumer warp group owns whole 128 x tile_n tiles, alternating with the other
        # (module docstring); the plain, act and dact epilogues only.
        assert not pingpong or tile_n == 128, "ping-pong: 128 x 128 tiles per warp group"
        self.pingpong = pingpong
        # cluster_n = 2 (ping-pong only): CTA pairs take column tiles 2q, 2q + 1 of one row tile and share
        # its A by TMA multicast (each loads half of every A stage into both CTAs), which brings the
        # ping-pong tile's L2 -> smem bytes per FLOP back to the cooperative kernel's.
        assert cluster_n in (1, 2) and (cluster_n == 1 or pingpong)
        self.cluster_n = cluster_n
        assert act is None or not (full_epi and pingpong), "the ping-pong SwiGLU epilogue is split"
        assert dact is None or not (full_epi or act), "the dSwiGLU epilogue: split"
        self.full_epi = full_epi
        self.act = act
        self.dact = dact  # VarlenMGroupedGemmDact: the backward's activation in the dgrad-of-down epilogue
        # push (VarlenMGroupedGemmPush): each output row goes straight to its destination row of some rank's
        # section (row_rank / row_slot / dst_base, e.g. the EP combine's slots) instead of the output
        assert not push or (full_epi and not (pingpong or act or dact)), "push: the cooperative _ef kernel"
        self.push = push
        # The consumers hand the whole output tile (in smem) to the producer warp group's idle warps 1-3
        # (hand_tile_to_helpers), which send it beside the next mainloop: with act, the gate/up tile, stored, and h
        # computed from it and stored (_act_helper); with push, the rows to their destinations (_push_helper).
        self.epi_helper = (act is not None and full_epi) or push
        self.dynamic = False  # VarlenMGroupedGemmDyn: tiles claimed by atomic add (tile_queue.py)
        self.tile_mnk = (TILE_M, tile_n, 64)
        self.num_sms = num_sms
        self.acc_dtype = cutlass.Float32
        # Two consumer warp groups split the 128 rows (64 each); ping-pong: one warp group's MMA
        # covers all 128 rows (two m64 wgmma per k block).
        self.mma_atom_layout = (1, 1, 1) if pingpong else (2, 1, 1)
        self.num_consumer_wg = 2
        self.threads_per_wg = 128
        self.num_threads = (1 + self.num_consumer_wg) * self.threads_per_wg
        self.num_consumer_threads = self.num_consumer_wg * self.threads_per_wg
        self.producer_regs = 40
        self.consumer_regs = 232
        self.full_arrivals = 1  # a stage's full barrier waits for the TMA thread's expect-tx arrive
        # Ping-pong: sub-tiles of one warp group's 64-row MMA blocks (the accumulator holds them in order).
        self.epi_tile = (64, 32) if pingpong else (TILE_M, 32)
        # full_epi: one buffer per sub-tile, the whole output tile in smem.
        self.epi_stages = TILE_M * tile_n // (self.epi_tile[0] * self.epi_tile[1]) if full_epi else 4
        # Ping-pong: each warp group has its own epi_stages buffers, barrier and storing warp.
        self.epi_buffers = self.epi_stages * (2 if pingpong else 1)
        # Warps that release each A/B stage: both consumer warp groups, or (ping-pong) the one whose tile it is.
        self.stage_consumer_warps = 4 if pingpong else self.num_consumer_wg * 4
        self.smem_bytes = utils.get_smem_capacity_in_bytes("sm_90")

    def _stages(self, ab_dtype, c_dtype) -> int:
        return stage_count(self.smem_bytes, self.tile_mnk, ab_dtype, c_dtype, self.epi_tile, self.epi_buffers)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, K, 1) K-major
        mB: cute.Tensor,  # (N, K, E) K- or N-major
        mC: cute.Tensor,  # (M, N, 1) N-major
        tile_expert: cute.Tensor,  # (M // TILE_M,) int32
        seg_end: cute.Tensor,  # (E,) int32 end row of each expert's padded segment
        seg_rows: cute.Tensor,  # (E,) int32 real (routed) rows of each expert
        group_m: cutlass.Int32,  # row tiles per raster band (1: column tiles fastest; 0: one band per expert)
        stream: cuda.CUstream,
    ):
        self._launch(mA, mB, mC, mC, tile_expert, seg_end, seg_rows, cutlass.Float32(0.0), group_m, stream)

    @cute.jit
    def _launch(self, mA, mB, mC, mH, tile_expert, seg_end, seg_rows, limit, group_m, stream, tile_counter=None,
                gate_up=None, w_rows=None, dw_part=None, dst_base=None, row_rank=None, row_slot=None, h_mx=None):
        """mH / limit: h output and clamp of the SwiGLU epilogue (unused without act).

        The kernel has three auxiliary tensor slots (row_idx, ready, ready_err) and one int (epoch), each
        variant passing its own operands in them (tile_expert and 0 where unused: kernel arguments cannot
        be None):
        tile_counter (dynamic): the tile claims counter, in the row_idx slot.
        gate_up / w_rows / dw_part (dact): the forward's gate_up, each row's top-k weight and the
        per-column-tile partial d topk-weights, in the row_idx / ready / ready_err slots.
        dst_base / row_rank / row_slot (push): the destinations of the rows, in the ready_err / row_idx / ready
        slots, and the row width in epoch.
        h_mx (act): nonzero where h is to be stored as its MXFP8 values along I (_act_helper), in epoch.
        """
        row_idx, ready, ready_err, epoch = tile_expert, tile_expert, tile_expert, cutlass.Int32(0)
        if cutlass.const_expr(self.dynamic):
            row_idx = tile_counter
        if cutlass.const_expr(self.dact is not None):
            row_idx, ready, ready_err = gate_up, w_rows, dw_part
        if cutlass.const_expr(self.push):
            row_idx, ready, ready_err = row_rank, row_slot, dst_base
        if cutlass.const_expr(h_mx is not None):
            epoch = h_mx
        self.ab_dtype = mA.element_type
        self.c_dtype = mC.element_type
        self.a_layout = utils.LayoutEnum.from_tensor(mA)
        self.b_layout = utils.LayoutEnum.from_tensor(mB)
        self.c_layout = utils.LayoutEnum.from_tensor(mC)
        if cutlass.const_expr(self.ab_dtype != mB.element_type):
            raise TypeError("A and B must share a dtype")
        if cutlass.const_expr(self.full_epi and self.c_dtype.width != 16):
            raise TypeError("the full-tile epilogue takes a 16-bit output (an fp32 tile does not fit)")
        if cutlass.const_expr(self.act is not None and self.b_layout != utils.LayoutEnum.ROW_MAJOR):
            raise TypeError("the SwiGLU epilogue reads B K-major (its half-tile smem view relies on it)")

        bm, bn, bk = self.tile_mnk
        self.ab_stages = self._stages(self.ab_dtype, self.c_dtype)
        tiled_mma, a_smem, b_smem, c_smem = mma_and_smem_layouts(self, self.ab_stages)

        if cutlass.const_expr(self.cluster_n > 1):  # each CTA of a pair loads half of A into both
            tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), mA, cute.slice_(a_smem, (None, None, 0)),
                (bm, bk), num_multicast=self.cluster_n,
            )  # fmt: skip
        else:
            tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                mA,
                cute.slice_(a_smem, (None, None, 0)),
                (bm, bk),
            )
        # With act, B arrives as two (bn/2, bk) boxes per stage. K-major, the smem layout of
        # a (bn, bk) stage is two (bn/2, bk) layouts back to back (same swizzle), so half h of
        # stage s is stage 2s + h of the half-tile layout: one buffer, two views.
        b_tma_smem = b_smem
        if cutlass.const_expr(self.act is not None):
            b_tma_smem = sm90_utils.make_smem_layout_b(
                self.b_layout, (bm, bn // 2, bk), self.ab_dtype, 2 * self.ab_stages
            )
        b_box = (bn // 2, bk) if cutlass.const_expr(self.act is not None) else (bn, bk)
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_tma_smem, (None, None, 0)), b_box,
        )
        tma_c, tma_mC = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            mC,
            cute.slice_(c_smem, (None, None, 0)),
            self.epi_tile,
        )
        tma_h, tma_mH = tma_c, tma_mC
        if cutlass.const_expr(self.act is not None or self.dact is not None):
            tma_h, tma_mH = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                mH,
                cute.slice_(c_smem, (None, None, 0)),
                self.epi_tile,
            )

        # Tiles over the padded rows x output columns; M is a multiple of TILE_M.
        # With act: tiles over h's columns (gate and up halves of one tile per I-block).
        if cutlass.const_expr(self.act is not None):
            gc = cute.zipped_divide(mH, tiler=(bm, bn // 2))
        elif cutlass.const_expr(self.dact is not None):
            gc = cute.zipped_divide(mH, tiler=(bm, bn))  # wh's columns: one tile per I-block
        else:
            gc = cute.zipped_divide(mC, tiler=(bm, bn))
        tiles_m, tiles_n, _ = gc[(0, (None, None, None))].shape
        if cutlass.const_expr(self.push):  # mC is A (shape carrier of the unused TMA store): tiles over (M, N of B)
            n_out = cute.size(mB, mode=[0])
            tiles_n = (n_out + bn - 1) // bn
            epoch = n_out  # the helpers' row width
        # The scheduler hands out linear tile indices; _tile_coord maps them to
        # (m, n) in bands of group_m row tiles, or one band per expert where group_m is 0 (see there).
        sched_params = utils.PersistentTileSchedulerParams((tiles_m * tiles_n, 1, 1), (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, self.num_sms)
        if cutlass.const_expr(self.cluster_n > 1):  # column-tile pairs; CTA r of cluster c takes linear tile 2c + r
            pairs = tiles_m * ((tiles_n + 1) // 2)
            sched_params = utils.PersistentTileSchedulerParams((pairs * 2, 1, 1), (2, 1, 1))
            grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, self.num_sms // 2)

        self.shared_storage = smem_storage(self.ab_stages, self.ab_dtype, a_smem, b_smem, self.c_dtype, c_smem,
                                           epi_barriers=self.epi_helper)
        if cutlass.const_expr(self.dynamic):
            # + the ring of claimed tile indices and its full / empty barriers (tile_queue.py)
            @cute.struct
            class SharedStorageDyn:
                ab_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
                tile_barriers: cute.struct.MemRange[cutlass.Int64, RING_STAGES * 2]
                tile_ring: cute.struct.MemRange[cutlass.Int32, RING_STAGES]
                sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(c_smem)], 1024]

            self.shared_storage = SharedStorageDyn
        if cutlass.const_expr(self.pingpong):
            # + the two mainloop order barriers of the consumer warp groups (see the kernel)
            self.shared_storage = smem_storage(self.ab_stages, self.ab_dtype, a_smem, b_smem, self.c_dtype, c_smem,
                                               order_barriers=True)

        self.kernel(
            tma_a, tma_mA, tma_b, tma_mB, tma_c, tma_mC, tma_h, tma_mH, tile_expert, seg_end, seg_rows, limit,
            tiled_mma, a_smem, b_smem, b_tma_smem, c_smem, sched_params, cutlass.Int32(tiles_m), cutlass.Int32(tiles_n),
            group_m,
            row_idx, ready, ready_err, epoch,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            cluster=(self.cluster_n, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.jit
    def _tile_coord(self, linear, tiles_m, tiles_n, group_m, tile_expert, seg_end, seg_rows):
        """Linear tile index -> (m_tile, n_tile) (_tile_coord_one); with cluster_n = 2, the column tiles make
        (tiles_n + 1) // 2 pairs and CTA r of cluster c gets column 2 q + r of pair q (past the last
        column tile when tiles_n is odd: that CTA computes, loads its half of A for its partner, and
        stores nothing)."""
        m_tile, n_tile = cutlass.Int32(0), cutlass.Int32(0)
        if cutlass.const_expr(self.cluster_n > 1):
            m_tile, pair = self._tile_coord_one(linear // 2, tiles_m, (tiles_n + 1) // 2, group_m, tile_expert,
                                                seg_end, seg_rows)
            n_tile = pair * 2 + linear % 2
        else:
            m_tile, n_tile = self._tile_coord_one(linear, tiles_m, tiles_n, group_m, tile_expert, seg_end, seg_rows)
        return m_tile, n_tile

    @cute.jit
    def _tile_coord_one(self, linear, tiles_m, tiles_n, group_m, tile_expert, seg_end, seg_rows):
        """Linear tile index -> (m_tile, n_tile), row tiles fastest inside bands of group_m.

        group_m = 1: column tiles fastest, so a wave of persistent CTAs shares a few
        A row tiles and the weights of the few experts they belong to (best when
        N is a handful of tiles). group_m = 8: a wave covers ~8 row tiles x
        (SMs / 8) column tiles, bounding the weight bytes a wave pulls from HBM
        when N spans many tiles (few large experts).
        group_m = 0 (expert bands): each expert's row tiles make one band, row tiles
        fastest inside it, so the 1-3 tiles that read the same B column stripe are
        neighbours in the order (the same wave of CTAs) and a wave boundary splits at
        most one stripe; with column tiles fastest it splits every stripe of the
        expert it falls in, whose B the next wave then reads from HBM again. The band
        of the expert owning row tile linear // tiles_n is [first, first + rows) with
        first = its segment's start tile; a row tile outside its own expert's
        segment (not a schedule this kernel is given) or past the last segment keeps
        the column-fastest order.
        """
        m_tile, n_tile = cutlass.Int32(0), cutlass.Int32(0)
        if group_m == 0:
            m_tile, n_tile, _ = expert_band_tile(linear, tiles_n, tile_expert, seg_end, seg_rows)
        else:
            band = linear // (group_m * tiles_n)
            first_m = band * group_m
            rows_in_band = cutlass.min(tiles_m - first_m, group_m)
            within = linear - band * (group_m * tiles_n)
            m_tile = first_m + within % rows_in_band
            n_tile = within // rows_in_band
        return m_tile, n_tile

    def _gate_up_h_stores(self, mC, mH, tma_c, tma_h, sC):
        """TMA store views of the SwiGLU epilogues (act, dact), by 32-column block of the whole outputs:
        (smem buffers as gate_up's source, gate_up blocks, smem buffers as h's source, h blocks, the first up block
        of gate_up = I / 32)."""
        gCa = cute.zipped_divide(mC[(None, None, 0)], self.epi_tile)
        gHa = cute.zipped_divide(mH[(None, None, 0)], self.epi_tile)
        bSG_sCa, bSG_gCa = cute.nvgpu.cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                                            gCa)
        bSG_sH, bSG_gH = cute.nvgpu.cpasync.tma_partition(tma_h, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gHa)
        return bSG_sCa, bSG_gCa, bSG_sH, bSG_gH, cute.size(mH, mode=[1]) // self.epi_tile[1]

    def _row_block(self, m_tile, ms, m_subs):
        """Row block (of epi_tile[0] rows) of sub-tile row ms of row tile m_tile, in whole-output views."""
        if cutlass.const_expr(m_subs == 1):
            return m_tile
        return m_tile * m_subs + ms

    @cute.jit
    def _epilogue_act(
        self, mC, mH, tma_c, tma_h, sC, r2s, tRS_acc, tRS_sC, rD, rD_out, rU, rG_out, rU_out,
        rD_size: cutlass.Constexpr, bSG_sC, m_tile, n_tile, limit, epi_count, epi_barrier, store_pipe, warp_idx,
        buf_base, store_warp, m_subs: cutlass.Constexpr, n_sub: cutlass.Constexpr,
    ):
        """SwiGLU epilogue. In each sub-tile row, sub-tiles 0..hn-1 are gate and hn..n_sub-1 up (same
        thread, same register slot, column + bn/2); then the h sub-tiles. Destinations are 32-column
        blocks of the whole outputs: gate_up block n hn + c / I/32 + n hn + c, h n hn + c."""
        hn = n_sub // 2
        epi_tiles = m_subs * n_sub
        _, bSG_gCa, bSG_sH, bSG_gH, up_block = self._gate_up_h_stores(mC, mH, tma_c, tma_h, sC)
        for e in cutlass.range_constexpr(epi_tiles + epi_tiles // 2):
            if cutlass.const_expr(e < epi_tiles):
                ms, c = e // n_sub, e % n_sub
                for v in cutlass.range_constexpr(rD_size):
                    rD[v] = tRS_acc[e * rD_size + v]
            else:
                # h from the bf16-rounded gate/up, as mok_act_fwd reads them from gate_up.
                ms, c = (e - epi_tiles) // hn, (e - epi_tiles) % hn
                g = ms * n_sub + c
                for v in cutlass.range_constexpr(rD_size):
                    rD[v] = tRS_acc[g * rD_size + v]
                    rU[v] = tRS_acc[(g + hn) * rD_size + v]
                rG_out.store(rD.load().to(self.c_dtype))
                rU_out.store(rU.load().to(self.c_dtype))
                for v in cutlass.range_constexpr(rD_size):
                    hv, _, _ = _act(self.act, rG_out[v].to(cutlass.Float32), rU_out[v].to(cutlass.Float32), limit)
                    rD[v] = hv
            rD_out.store(rD.load().to(self.c_dtype))
            buf = buf_base + (epi_count + e) % self.epi_stages
            cute.copy(r2s, rD_out, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if warp_idx == store_warp:
                row_blk = self._row_block(m_tile, ms, m_subs)
                if cutlass.const_expr(e < epi_tiles and c < hn):
                    cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gCa[(None, (row_blk, n_tile * hn + c))])
                elif cutlass.const_expr(e < epi_tiles):
                    cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gCa[(None, (row_blk, up_block + n_tile * hn + c - hn))])
                else:
                    cute.copy(tma_h, bSG_sH[(None, buf)], bSG_gH[(None, (row_blk, n_tile * hn + c))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            epi_barrier.arrive_and_wait()

    @cute.jit
    def _act_helper(self, mC, mH, tma_c, tma_h, sC, epi_bars, tile_expert, seg_end, seg_rows, sched_params, tiles_m,
                    tiles_n, group_m, limit, h_mx, tidx):
        """The SwiGLU epilogue's stores and math on the producer warp group's idle warps 1-3 (full_epi,
        cooperative), beside the consumers' next mainloop. Per valid tile of the CTA's schedule: wait for the
        consumers' gate/up sub-tiles (epi_bars[0]), send them by TMA (gate group, then up group), compute
        h = act(gate, up) by 16-byte pieces from the bf16 values in smem (as mok_act_fwd reads them from
        gate_up) into the gate buffers once the gate group has read them, send h, and once every store has
        read smem, free the buffers (epi_bars[1]). Same values and destinations as _epilogue_act: same bits.
        h_mx != 0: h's MXFP8 values along I instead, with mok_mx_quant's arithmetic (mode 0): a 32-column block
        of a row is the 4 pieces that lanes 4j .. 4j + 3 hold, whose amax they share by two shuffles."""
        n_sub = self.tile_mnk[1] // self.epi_tile[1]
        hn = n_sub // 2
        vec = 8  # bf16 elements per 16-byte piece
        row_pieces = self.epi_tile[1] // vec
        pieces = self.epi_tile[0] * row_pieces  # per buffer
        # the shuffles need every lane of a warp in every step: each warp's helper threads take the same number
        # of pieces (a warp's pieces are 32 consecutive ones), and a block's 4 pieces lie in one warp
        assert (hn * pieces) % 32 == 0 and (self.threads_per_wg - 32) % 32 == 0 and row_pieces == 4
        f_g = cute.make_rmem_tensor((vec,), self.c_dtype)
        f_u = cute.make_rmem_tensor((vec,), self.c_dtype)
        f_h = cute.make_rmem_tensor((vec,), cutlass.Float32)
        f_hq = cute.make_rmem_tensor((vec,), self.c_dtype)
        helpers = self.threads_per_wg - 32
        htid = tidx - 32
        helper_bar = pipeline.NamedBarrier(barrier_id=3, num_threads=helpers)
        bSG_sCa, bSG_gCa, bSG_sH, bSG_gH, up_block = self._gate_up_h_stores(mC, mH, tma_c, tma_h, sC)
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        full_phase = cutlass.Int32(0)
        while work.is_valid_tile:
            m_tile, n_tile = self._tile_coord(
                work.tile_idx[0], tiles_m, tiles_n, group_m, tile_expert, seg_end, seg_rows
            )
            if tile_expert[m_tile] >= 0:
                cute.arch.mbarrier_wait(epi_bars, full_phase)
                full_phase = 1 - full_phase
                if htid == 0:
                    for c in cutlass.range_constexpr(hn):
                        cute.copy(tma_c, bSG_sCa[(None, c)], bSG_gCa[(None, (m_tile, n_tile * hn + c))])
                    cute.arch.cp_async_bulk_commit_group()
                    for c in cutlass.range_constexpr(hn):
                        cute.copy(tma_c, bSG_sCa[(None, hn + c)], bSG_gCa[(None, (m_tile, up_block + n_tile * hn + c))])
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(1, read=True)  # the gate group has read buffers 0..hn-1
                helper_bar.arrive_and_wait()
                # 16-byte pieces of rows (vec elements), thread-strided: piece i is row r, piece q of buffer c
                for i in cutlass.range(htid, hn * pieces, helpers):
                    c = i // pieces
                    r = i % pieces // row_pieces
                    q = i % row_pieces
                    g_v = cute.zipped_divide(sC[(r, None, c)], (vec,))
                    u_v = cute.zipped_divide(sC[(r, None, c + hn)], (vec,))
                    act_piece(self.act, g_v[(None, q)], u_v[(None, q)], g_v[(None, q)], f_g, f_u, f_h, f_hq, limit,
                              h_mx)
                helpers_send_h(tma_h, bSG_sH, bSG_gH, hn, m_tile, n_tile * hn, helper_bar, epi_bars, htid)
            sched.advance_to_next_work()
            work = sched.get_current_work()
        if htid == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _push_helper(self, sC, epi_bars, tile_expert, seg_end, seg_rows, sched_params, tiles_m, tiles_n, group_m,
                     row_rank, row_slot, dst_base, n_cols, tidx):
        """The epilogue of the push kernel on the producer warp group's idle warps 1-3, beside the consumers' next
        mainloop: per valid tile of the CTA's schedule, wait for the output tile in smem (epi_bars[0]), store each
        row's columns to row row_slot[r] of the section at dst_base[row_rank[r]] (row_rank < 0: not sent; rows of
        n_cols), then free the buffers (epi_bars[1]). Helper warp w takes tile rows w, w + 3, ..., lane l the
        16-byte piece l of each (a 256-column row is 32 pieces); the rows' destinations are loaded before the
        wait, lane l holding those of the warp's rows l and l + 32, and reach the other lanes by shuffle. The
        values are the tile the TMA stores of the _ef kernel send: the same bits."""
        vec = 8  # bf16 elements per 16-byte piece
        buf_pieces = self.epi_tile[1] // vec
        helper_warps = self.threads_per_wg // 32 - 1
        htid = tidx - 32
        wi = htid // 32
        lane = htid % 32
        helper_bar = pipeline.NamedBarrier(barrier_id=3, num_threads=helper_warps * 32)
        elem_bytes = self.c_dtype.width // 8
        row_bytes = cutlass.Int64(n_cols) * elem_bytes
        my_rows = (TILE_M - wi + helper_warps - 1) // helper_warps
        col = lane * vec  # of this lane's piece, within the tile
        frag = cute.make_rmem_tensor((vec,), self.c_dtype)
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        full_phase = cutlass.Int32(0)
        while work.is_valid_tile:
            m_tile, n_tile = self._tile_coord(
                work.tile_idx[0], tiles_m, tiles_n, group_m, tile_expert, seg_end, seg_rows
            )
            if tile_expert[m_tile] >= 0:
                first = m_tile * TILE_M + wi
                rk0, sl0, rk1, sl1 = cutlass.Int64(-1), cutlass.Int64(0), cutlass.Int64(-1), cutlass.Int64(0)
                if lane < my_rows:
                    rk0 = row_rank[first + helper_warps * lane]
                    sl0 = row_slot[first + helper_warps * lane]
                if lane + 32 < my_rows:
                    rk1 = row_rank[first + helper_warps * (lane + 32)]
                    sl1 = row_slot[first + helper_warps * (lane + 32)]
                c = n_tile * self.tile_mnk[1] + col
                cute.arch.mbarrier_wait(epi_bars, full_phase)
                full_phase = 1 - full_phase
                for t in range(my_rows):
                    p0 = cute.arch.shuffle_sync(rk0, t % 32)
                    p1 = cute.arch.shuffle_sync(rk1, t % 32)
                    q0 = cute.arch.shuffle_sync(sl0, t % 32)
                    q1 = cute.arch.shuffle_sync(sl1, t % 32)
                    p, q = p0, q0
                    if t >= 32:
                        p, q = p1, q1
                    if (p >= 0) & (c < n_cols):
                        r = wi + helper_warps * t
                        s_v = cute.zipped_divide(sC[(r, None, lane // buf_pieces)], (vec,))
                        cute.autovec_copy(s_v[(None, lane % buf_pieces)], frag)
                        addr = dst_base[p] + q * row_bytes + cutlass.Int64(c) * elem_bytes
                        dst_ptr = cute.make_ptr(self.c_dtype, addr, cute.AddressSpace.gmem, assumed_align=16)
                        dst = cute.make_tensor(dst_ptr, cute.make_layout((vec,)))
                        cute.autovec_copy(frag, dst)
                helper_bar.arrive_and_wait()  # every helper has read the buffers
                if htid == 0:
                    cute.arch.mbarrier_arrive(epi_bars + 1)
            sched.advance_to_next_work()
            work = sched.get_current_work()

    @cute.jit
    def _epilogue_dact(
        self, mC, mH, tma_c, tma_h, sC, r2s, tRS_sC, rD, rD_out, rD_size: cutlass.Constexpr, bSG_sC, acc, tCgG,
        tCgU, rG, rU, rH, rHq, rDU, rows, w_rows, dw_part, m_tile, n_tile, limit, epi_barrier, warp_idx, tidx,
        buf_base, store_warp, m_subs: cutlass.Constexpr, n_sub: cutlass.Constexpr,
    ):
        """dSwiGLU epilogue. acc = dh = dy @ W2[e] (fp32, not scaled by w). Per sub-tile (32 columns): with
        h, dg, du = act(gate, up) and h rounded to bf16 as the forward stored it, d gate = dg * (dh * w),
        d up = du * (dh * w), wh = h * w (bf16, the formulas of swiglu.ActBackward: the same bits), and
        per row sum(dh * h) over the tile's columns into dw_part[n_tile, row]. Three stores per sub-tile
        (column block c of sub-tile row ms): d gate -> gate_up block n n_sub + c, d up -> I/32 + n n_sub + c,
        wh -> block n n_sub + c. rows[ms]: this thread's two rows in sub-tile row ms (v1 = 0, 1)."""
        epi_tiles = m_subs * n_sub
        _, bSG_gCa, bSG_sH, bSG_gH, up_block = self._gate_up_h_stores(mC, mH, tma_c, tma_h, sC)
        w_of = [(w_rows[m_tile * TILE_M + r0], w_rows[m_tile * TILE_M + r1]) for r0, r1 in rows]
        part = [[cutlass.Float32(0.0), cutlass.Float32(0.0)] for _ in range(m_subs)]
        for e in cutlass.range_constexpr(epi_tiles):
            ms, c = e // n_sub, e % n_sub
            for v in cutlass.range_constexpr(rD_size):
                hv, dg, du = _act(self.dact, rG[v].to(cutlass.Float32), rU[v].to(cutlass.Float32), limit)
                rH[v] = hv
                rD[v] = dg
                rDU[v] = du
            if cutlass.const_expr(e + 1 < epi_tiles):
                # the next sub-tile's gate / up: in flight during this one's stores
                for v in cutlass.range_constexpr(rD_size):
                    rG[v] = tCgG[(e + 1) * rD_size + v]
                    rU[v] = tCgU[(e + 1) * rD_size + v]
            rHq.store(rH.load().to(self.c_dtype))
            rH.store(rHq.load().to(self.acc_dtype))
            for v in cutlass.range_constexpr(rD_size):
                half = (v // 2) % 2  # v1 of acc element e * rD_size + v (rD_size % 4 == 0)
                dh = acc[e * rD_size + v]
                part[ms][half] = part[ms][half] + dh * rH[v]
                d = dh * w_of[ms][half]
                rD[v] = rD[v] * d
                rDU[v] = rDU[v] * d
                rH[v] = rH[v] * w_of[ms][half]
            # The three outputs go through smem buffers buf_base + 0..2 at once, one bulk group per
            # sub-tile: the group of sub-tile e - 1 must have read them first (it had this sub-tile's
            # math to do so). 2 barriers per sub-tile, not 6.
            if warp_idx == store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            epi_barrier.arrive_and_wait()
            for out in cutlass.range_constexpr(3):
                rD_out.store((rD, rDU, rH)[out].load().to(self.c_dtype))
                cute.copy(r2s, rD_out, tRS_sC[(None, None, None, buf_base + out)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if warp_idx == store_warp:
                row_blk = self._row_block(m_tile, ms, m_subs)
                col = n_tile * n_sub + c
                cute.copy(tma_c, bSG_sC[(None, buf_base)], bSG_gCa[(None, (row_blk, col))])
                cute.copy(tma_c, bSG_sC[(None, buf_base + 1)], bSG_gCa[(None, (row_blk, up_block + col))])
                cute.copy(tma_h, bSG_sH[(None, buf_base + 2)], bSG_gH[(None, (row_blk, col))])
                cute.arch.cp_async_bulk_commit_group()
        # the four lanes of a quad hold the same two rows: fixed butterfly over them
        for ms in cutlass.range_constexpr(m_subs):
            for half in cutlass.range_constexpr(2):
                total = cute.arch.warp_reduction_sum(part[ms][half], threads_in_group=4)
                if tidx % 4 == 0:
                    dw_part[(n_tile, m_tile * TILE_M + rows[ms][half])] = total

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        tma_h: cute.CopyAtom,
        mH: cute.Tensor,
        tile_expert: cute.Tensor,
        seg_end: cute.Tensor,
        seg_rows: cute.Tensor,
        limit: cutlass.Float32,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        b_tma_smem: cute.ComposedLayout,
        c_smem: cute.ComposedLayout,
        sched_params: utils.PersistentTileSchedulerParams,
        tiles_m: cutlass.Int32,
        tiles_n: cutlass.Int32,
        group_m: cutlass.Int32,
        row_idx: cute.Tensor,
        ready: cute.Tensor,
        ready_err: cute.Tensor,
        epoch: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
            if cutlass.const_expr(self.act is not None or self.dact is not None):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_h)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        tx_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0)))
                    + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem, (None, None, 0))))
        if cutlass.const_expr(self.pingpong):
            # Mainloop order of the ping-pong warp groups: warp group w waits on order_bars[w] before its
            # mainloop and its 128 threads arrive on order_bars[1 - w] after it. Besides alternating the
            # MMA, this keeps a warp group that steps over the other's stages (without waiting on them)
            # from waiting on a stage more than one ring lap ahead, where the full barrier's phase
            # parity could not tell the laps apart. Initialised here, fenced by the A/B pipeline's setup.
            order_bars = storage.order_barriers.data_ptr()
            if tidx == 0:
                cute.arch.mbarrier_init(order_bars, self.threads_per_wg)
                cute.arch.mbarrier_init(order_bars + 1, self.threads_per_wg)
        if cutlass.const_expr(self.epi_helper):
            # epi_bars[0]: the consumers' output tile is in smem (every consumer thread arrives); epi_bars[1]: the
            # helper warps' stores have read it (their storing thread arrives). Fenced by the A/B pipeline's setup.
            epi_bars = storage.epi_barriers.data_ptr()
            if tidx == 0:
                cute.arch.mbarrier_init(epi_bars, self.num_consumer_threads)
                cute.arch.mbarrier_init(epi_bars + 1, 1)
        # Consumers release a stage once per warp (8 consumer warps; ping-pong: the 4 of the tile's warp group).
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.full_arrivals),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.stage_consumer_warps * self.cluster_n),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_n, 1, 1)),
        )

        if cutlass.const_expr(self.dynamic):
            tile_pipe = make_tile_pipe(storage.tile_barriers.data_ptr(), self.num_consumer_threads)
            tile_ring = storage.tile_ring.get_tensor(cute.make_layout(RING_STAGES))

        sA, sB, sC = smem_tensors(storage, a_smem, b_smem, c_smem)

        # (bM, bK, tilesM, tilesK, L), (bN, bK, tilesN, tilesK, E), (bM, bN, tilesM, tilesN, L)
        gA, gB, gC = tile_views(mA, mB, mC, self.tile_mnk)

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        if cutlass.const_expr(self.act is not None):
            # Half-tile views: smem stage 2s + h, gmem tiles of bn/2 rows (gate n, up n + I/(bn/2)).
            sB_tma = storage.sB.get_tensor(b_tma_smem.outer, swizzle=b_tma_smem.inner)
            gB_tma = cute.local_tile(mB, (self.tile_mnk[1] // 2, self.tile_mnk[2]), (None, None, None))
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB_tma, 0, 2), cute.group_modes(gB_tma, 0, 2)
            )
        else:
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
        k_tiles = cute.size(gA, mode=[3])
        a_mask = None
        if cutlass.const_expr(self.cluster_n > 1):
            # each consumer warp releases a stage to both CTAs' producers (the pipeline picks the peer from
            # cta_layout_vmnk; create() ended with a cluster sync); a full barrier expects all of A (half
            # from each CTA) and this CTA's B
            cta_layout = cute.make_layout((self.cluster_n, 1, 1))
            cta_coord = cta_layout.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))
            a_mask = cute.make_layout_image_mask(cta_layout, cta_coord, mode=0)
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, cta_coord[0], cute.make_layout(self.cluster_n), cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )

        if wg_idx == 0:
            # ---------------- producer: TMA loads ----------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                if cutlass.const_expr(self.dynamic):
                    sched = DynamicTileScheduler.create(
                        sched_params, cute.arch.block_idx(), cute.arch.grid_dim(), tile_pipe, tile_ring, row_idx,
                        producer=True,
                    )
                else:
                    sched = utils.StaticPersistentTileScheduler.create(
                        sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
                    )
                work = sched.initial_work_tile_info()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                while work.is_valid_tile:
                    m_tile, n_tile = self._tile_coord(
                        work.tile_idx[0], tiles_m, tiles_n, group_m, tile_expert, seg_end, seg_rows
                    )
                    expert = tile_expert[m_tile]
                    if expert >= 0:
                        tAgA_t = tAgA[(None, m_tile, None, 0)]
                        tBgB_t = tBgB[(None, n_tile, None, expert)]
                        if cutlass.const_expr(self.act is not None):
                            tBgB_u = tBgB[(None, n_tile + tiles_n, None, expert)]  # the up half
                        for k in range(k_tiles):
                            ab_pipe.producer_acquire(state)
                            bar = ab_pipe.producer_get_barrier(state)
                            if cutlass.const_expr(self.cluster_n > 1):
                                cute.copy(tma_a, tAgA_t[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                                          mcast_mask=a_mask)
                            else:
                                cute.copy(tma_a, tAgA_t[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                            if cutlass.const_expr(self.act is not None):
                                cute.copy(tma_b, tBgB_t[(None, k)], tBsB[(None, 2 * state.index)], tma_bar_ptr=bar)
                                cute.copy(tma_b, tBgB_u[(None, k)], tBsB[(None, 2 * state.index + 1)], tma_bar_ptr=bar)
                            else:
                                cute.copy(tma_b, tBgB_t[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                            ab_pipe.producer_commit(state)
                            state.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                ab_pipe.producer_tail(state)
            if cutlass.const_expr(self.epi_helper):
                if warp_idx > 0:
                    if cutlass.const_expr(self.push):
                        self._push_helper(sC, epi_bars, tile_expert, seg_end, seg_rows, sched_params, tiles_m,
                                          tiles_n, group_m, row_idx, ready, ready_err, epoch, tidx)
                    else:
                        self._act_helper(mC, mH, tma_c, tma_h, sC, epi_bars, tile_expert, seg_end, seg_rows,
                                         sched_params, tiles_m, tiles_n, group_m, limit, epoch, tidx)
        else:
            # ---------------- consumers: wgmma + epilogue ----------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            # (consumer_roles: the rows, smem buffers, named barrier and storing warp of each warp group;
            # ping-pong: every other valid tile of this CTA whole)
            wg, ctid, store_warp, buf_base, epi_threads, barrier_id = consumer_roles(
                tidx, wg_idx, self.threads_per_wg, self.epi_stages, self.pingpong
            )
            first_row = 0 if self.pingpong else wg * (TILE_M // self.num_consumer_wg)  # of this warp group's rows
            tCrA, tCrB, acc, k_blocks = mma_operands(tiled_mma, ctid, sA, sB, gC, self.acc_dtype)

            # Epilogue: registers -> smem (stmatrix) -> gmem (TMA), epi_tile at a time.
            r2s, tRS_sC, tRS_acc, rD, rD_out, rD_size = epilogue_stores(
                tiled_mma, ctid, sC, acc, self.c_layout, self.c_dtype, self.acc_dtype
            )
            if cutlass.const_expr(self.act is not None):
                rU = cute.make_rmem_tensor(rD.shape, self.acc_dtype)
                rG_out = cute.make_rmem_tensor(rD.shape, self.c_dtype)
                rU_out = cute.make_rmem_tensor(rD.shape, self.c_dtype)
            if cutlass.const_expr(self.dact is not None):
                # acc element o = (v0, v1, b, m) (o = v0 + 2 v1 + 4 b + acc_per_m m) is row r0 + 8 v1 +
                # 64 m, column c0 + v0 + 8 b of the tile (the wgmma accumulator layout; m: the 64-row MMA
                # block, ping-pong only; the r2s retile of acc is the identity, so sub-tile e of the
                # epilogue is acc[e * rD_size ..]). Its rows, from the identity tensor:
                thr_c = tiled_mma.get_slice(ctid)
                tCcC = thr_c.partition_C(cute.make_identity_tensor((self.tile_mnk[0], self.tile_mnk[1])))
                acc_per_m = cute.size(acc) // (TILE_M // self.epi_tile[0])
                gGU = cute.local_tile(row_idx, (self.tile_mnk[0], self.tile_mnk[1]), (None, None, None))
                rG = cute.make_rmem_tensor(rD.shape, self.c_dtype)  # gate / up of one sub-tile (prefetched)
                rU = cute.make_rmem_tensor(rD.shape, self.c_dtype)
                rH = cute.make_rmem_tensor(rD.shape, self.acc_dtype)
                rHq = cute.make_rmem_tensor(rD.shape, self.c_dtype)
                rDU = cute.make_rmem_tensor(rD.shape, self.acc_dtype)
            epi_barrier, store_pipe = store_sync(epi_threads, self.epi_stages, barrier_id)

            if cutlass.const_expr(self.dynamic):
                sched = DynamicTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim(), tile_pipe, tile_ring, row_idx,
                    producer=False,
                )
            else:
                sched = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
                )
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            epi_count = cutlass.Int32(0)
            turn = cutlass.Int32(0)  # ping-pong: the warp group whose tile the next valid one is
            # ping-pong: phase to wait for on order_bars[wg]; a fresh barrier passes parity 1 at once,
            # so warp group 1 (wg 0) starts and warp group 2 waits for its first arrival
            order_phase = 1 - wg
            empty_phase = cutlass.Int32(1)  # epi_helper: a fresh epi_bars[1] passes parity 1 at once
            while work.is_valid_tile:
                m_tile, n_tile = self._tile_coord(
                    work.tile_idx[0], tiles_m, tiles_n, group_m, tile_expert, seg_end, seg_rows
                )
                expert = tile_expert[m_tile]
                if expert >= 0:
                    skip, turn = pingpong_turn(turn, wg, self.pingpong)
                    if skip == 1:
                        read_state, release_state = step_over(k_tiles, read_state, release_state)
                    else:
                        # Real rows in this tile (more than TILE_M before the segment's last tile).
                        seg_start, rows, _ = segment_extent(expert, seg_end, seg_rows)
                        real_rows = seg_start + rows - m_tile * TILE_M
                        if cutlass.const_expr(self.dact is not None):
                            # the first sub-tile's gate / up, loaded before the mainloop hides their latency
                            tCgG = thr_c.partition_C(gGU[(None, None, m_tile, n_tile, 0)])
                            tCgU = thr_c.partition_C(gGU[(None, None, m_tile, n_tile + tiles_n, 0)])
                            for v in cutlass.range_constexpr(rD_size):
                                rG[v] = tCgG[v]
                                rU[v] = tCgU[v]
                        acc.fill(0.0)
                        if cutlass.const_expr(self.pingpong):
                            cute.arch.mbarrier_wait(order_bars + wg, order_phase)
                            order_phase = 1 - order_phase
                        if cutlass.const_expr(self.pingpong):
                            # a warp group's whole tile: where its rows past the first 64 are all padding
                            # (callers that pass the real seg_rows: cuda_backend.seg_rows_for), only the
                            # first 64-row MMA block runs (half_tiles)
                            if real_rows > TILE_M // 2:
                                tiled_mma, acc, read_state, release_state = mma_mainloop(
                                    tiled_mma, acc, tCrA, tCrB, k_blocks, k_tiles, ab_pipe, read_state, release_state,
                                )
                            else:
                                tiled_mma, acc, read_state, release_state = mma_mainloop(
                                    tiled_mma, acc, tCrA, tCrB, k_blocks, k_tiles, ab_pipe, read_state, release_state,
                                    first_m_only=True,
                                )
                        elif real_rows > first_row:
                            tiled_mma, acc, read_state, release_state = mma_mainloop(
                                tiled_mma, acc, tCrA, tCrB, k_blocks, k_tiles, ab_pipe, read_state, release_state,
                            )
                        else:
                            # All 64 rows are padding: no MMA, but the stage ring must still
                            # see this warp group wait on and release every stage.
                            for k in range(k_tiles):
                                ab_pipe.consumer_wait(read_state)
                                ab_pipe.consumer_release(release_state)
                                read_state.advance()
                                release_state.advance()
                        if cutlass.const_expr(self.pingpong):
                            cute.arch.mbarrier_arrive(order_bars + (1 - wg))

                        bSG_sC, bSG_gC, epi_tiles, epi_shape, epi_layout = epilogue_views(
                            gC[(None, None, m_tile, n_tile, 0)], self.epi_tile, tma_c, sC
                        )
                        m_subs, n_sub = epi_shape  # sub-tiles: per 64-row MMA block (ping-pong: 2, else 1) x per 32 columns
                        if cutlass.const_expr(self.epi_helper):
                            empty_phase = hand_tile_to_helpers(
                                r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, epi_tiles, epi_bars, empty_phase
                            )
                        elif cutlass.const_expr(self.full_epi):
                            store_tile_full(
                                r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, tma_c, bSG_sC, bSG_gC, epi_layout,
                                epi_tiles, epi_barrier, warp_idx, buf_base, store_warp,
                            )
                        elif cutlass.const_expr(self.act is not None):
                            self._epilogue_act(
                                mC, mH, tma_c, tma_h, sC, r2s, tRS_acc, tRS_sC, rD, rD_out, rU, rG_out, rU_out, rD_size, bSG_sC,
                                m_tile, n_tile, limit, epi_count, epi_barrier, store_pipe, warp_idx, buf_base, store_warp, m_subs, n_sub,
                            )
                            epi_count = epi_count + epi_tiles + epi_tiles // 2
                        elif cutlass.const_expr(self.dact is not None):
                            rows = [(tCcC[ms * acc_per_m][0], tCcC[ms * acc_per_m + 2][0]) for ms in range(m_subs)]
                            self._epilogue_dact(
                                mC, mH, tma_c, tma_h, sC, r2s, tRS_sC, rD, rD_out, rD_size, bSG_sC, acc, tCgG, tCgU, rG, rU, rH, rHq,
                                rDU, rows, ready, ready_err, m_tile, n_tile, limit, epi_barrier, warp_idx, tidx, buf_base, store_warp,
                                m_subs, n_sub,
                            )
                        else:
                            store_tile_split(
                                r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, tma_c, bSG_sC, bSG_gC, epi_layout,
                                epi_tiles, epi_count, self.epi_stages, epi_barrier, store_pipe, warp_idx, buf_base, store_warp,
                            )
                            epi_count = epi_count + epi_tiles
                sched.advance_to_next_work()
                work = sched.get_current_work()
            store_pipe.producer_tail()


class VarlenMGroupedGemmAct(VarlenMGroupedGemm):
    """The gate/up GEMM with the activation in its epilogue: writes gate_up and h = act(gate, up).
    I % (tile_n / 2) == 0; on clusters (cluster_n = 2) I % tile_n == 0 (an even count of h tiles)."""

    def __init__(self, act: str, tile_n: int = 256, num_sms: int = 132, pingpong: bool = False, cluster_n: int = 1,
                 full_epi: bool = False):
        assert act in ("swiglu", "swiglu_oai") and tile_n == (128 if pingpong else 256)
        super().__init__(tile_n=tile_n, num_sms=num_sms, act=act, pingpong=pingpong, cluster_n=cluster_n,
                         full_epi=full_epi)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, K, 1) K-major: x rows
        mB: cute.Tensor,  # (2I, K, E) K-major: gate_up_proj, rows [gate; up]
        mC: cute.Tensor,  # (M, 2I, 1) N-major: gate_up (saved for backward)
        mH: cute.Tensor,  # (M, I, 1) N-major: h = act(gate, up)
        tile_expert: cute.Tensor,
        seg_end: cute.Tensor,
        seg_rows: cute.Tensor,
        h_mx: cutlass.Int32,  # nonzero: h as its MXFP8 values along I (the helper-warp form, full_epi; else unread)
        limit: cutlass.Float32,  # clamp of gate/up (+inf: none)
        group_m: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch(mA, mB, mC, mH, tile_expert, seg_end, seg_rows, limit, group_m, stream, h_mx=h_mx)


class VarlenMGroupedGemmDact(VarlenMGroupedGemm):
    """The backward's dgrad of down with the activation backward in its epilogue (module docstring).

    Writes d gate_up and w*h (bf16) and dw_part[n, r] = sum over the columns of h-tile n of dh * h;
    I % tile_n == 0 (the gate and up blocks of a tile must not straddle I); on clusters (cluster_n = 2)
    I % (2 tile_n) == 0: a last, unpaired column tile would write into other columns."""

    def __init__(self, dact: str, tile_n: int = 256, num_sms: int = 132, pingpong: bool = False, cluster_n: int = 1):
        assert dact in ("swiglu", "swiglu_oai") and tile_n == (128 if pingpong else 256)
        super().__init__(tile_n=tile_n, num_sms=num_sms, dact=dact, pingpong=pingpong, cluster_n=cluster_n)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, K=H, 1) K-major: dy rows
        mB: cute.Tensor,  # (I, H, E) N-major: down_proj read transposed
        mC: cute.Tensor,  # (M, 2I, 1) N-major: d gate_up (out)
        mH: cute.Tensor,  # (M, I, 1) N-major: w * h (out)
        gate_up: cute.Tensor,  # (M, 2I, 1) N-major: the forward's gate_up
        w_rows: cute.Tensor,  # (M,) fp32: each row's top-k weight (0 on padding rows)
        dw_part: cute.Tensor,  # (I / tile_n, M) fp32 out: partial d topk-weight per column tile
        tile_expert: cute.Tensor,
        seg_end: cute.Tensor,
        seg_rows: cute.Tensor,
        limit: cutlass.Float32,  # clamp of gate/up (+inf: none)
        group_m: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch(mA, mB, mC, mH, tile_expert, seg_end, seg_rows, limit, group_m, stream,
                     gate_up=gate_up, w_rows=w_rows, dw_part=dw_part)


class VarlenMGroupedGemmPush(VarlenMGroupedGemm):
    """mok_gemm_bk_ef / mok_gemm_bn_ef whose rows go to their destinations instead of C: row r of the result
    (B's N wide) into row row_slot[r] of the section at address dst_base[row_rank[r]] (row_rank < 0: not stored), by the
    producer warp group's idle warps beside the next mainloop (_push_helper; plain stores, to a peer's memory
    where the address is one). There is no C: the rows are B's N wide (A stands in for C's unused TMA store
    descriptor). The EP forward's down GEMM sends each slot's row to its source rank's slots section this way
    while it computes the next tiles, and the backward's dgrad of gate/up each d x row to the dxslots."""

    def __init__(self, tile_n: int = 256, num_sms: int = 132):
        assert tile_n == 256, "_push_helper: a lane per 16-byte piece of a 256-column tile row"
        super().__init__(tile_n=tile_n, num_sms=num_sms, full_epi=True, push=True)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, K, 1) K-major
        mB: cute.Tensor,  # (N, K, E) K- or N-major
        tile_expert: cute.Tensor,
        seg_end: cute.Tensor,
        seg_rows: cute.Tensor,
        group_m: cutlass.Int32,
        dst_base: cute.Tensor,  # (P,) int64: address of each destination section (rows of N)
        row_rank: cute.Tensor,  # (M,) int64: destination of row r, -1: none
        row_slot: cute.Tensor,  # (M,) int64: row of that section
        stream: cuda.CUstream,
    ):
        self._launch(mA, mB, mA, mA, tile_expert, seg_end, seg_rows, cutlass.Float32(0.0), group_m, stream,
                     dst_base=dst_base, row_rank=row_rank, row_slot=row_slot)


class VarlenMGroupedGemmDyn(VarlenMGroupedGemm):
    """VarlenMGroupedGemm with dynamic tiles (tile_queue.py) and no hook: each CTA's producer claims the
    next linear tile by atomic add on tile_counter[0] (zeroed by the caller before each launch), so a CTA
    whose tiles ran short (the consumer warp groups whose 64 rows are all padding skip their MMA where
    seg_rows holds the routed rows) takes the next tile instead of waiting for its static turn.

    Same tiles, same K order, same epilogue: bitwise equal to VarlenMGroupedGemm."""

    def __init__(self, tile_n: int = 256, full_epi: bool = False):
        super().__init__(tile_n=tile_n, full_epi=full_epi)
        self.dynamic = True

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, K, 1) K-major
        mB: cute.Tensor,  # (N, K, E) K- or N-major
        mC: cute.Tensor,  # (M, N, 1) N-major
        tile_expert: cute.Tensor,
        seg_end: cute.Tensor,
        seg_rows: cute.Tensor,
        group_m: cutlass.Int32,
        tile_counter: cute.Tensor,  # (1,) int32: claims (0 before the launch)
        stream: cuda.CUstream,
    ):
        self._launch(mA, mB, mC, mC, tile_expert, seg_end, seg_rows, cutlass.Float32(0.0), group_m, stream,
                     tile_counter=tile_counter)

