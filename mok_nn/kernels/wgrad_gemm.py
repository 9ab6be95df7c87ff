"""Varlen-K grouped GEMM for the weight gradients (Hopper, sm_90a): persistent, TMA + wgmma.

    C[m, n, e] = sum_{r in rows of e} A[m, r] * B[n, r]

A and B are the schedule-ordered rows read transposed (both M/N-major: the row
index r is the reduction axis), e.g. d down_proj[e] = dy_rows[seg e]^T @ wh[seg e].
Expert e reduces rows seg_start(e) .. seg_start(e) + seg_rows[e], rounded up to
the K tile (64 rows) for the loads and to the 16-row wgmma k-block for the MMA
(the last K tile runs only its k-blocks that hold real rows: one unrolled
mainloop per count, chosen once per tile); seg_start(e) = seg_end[e - 1] is a
multiple of TILE_M (the schedule pads every segment), so a K tile never
straddles two experts, and the rows past seg_rows[e] inside the segment are
padding (zero), so rounding up adds nothing. An expert without rows gets an
all-zero output tile.

Structure as in grouped_gemm.py: warp group 0 issues TMA loads into a ring of
stages, warp groups 1 and 2 run wgmma (64 rows each; ping-pong: whole tiles in turn) and store bf16
through shared memory with TMA. The tile space is (m tile, n tile, expert), expert
slowest, so a wave of CTAs works on one or two experts whose rows stay in L2.
One CTA reduces the whole K range of a tile in ascending order: bitwise
reproducible. The accumulating variant (accumulate=True) adds the bf16 result into C
instead of overwriting it (weight gradients summed over macrobatch passes).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cuda.bindings.driver as cuda

from .gemm_layouts import mma_and_smem_layouts, smem_tensors, stage_count, tile_views
from .gemm_consumer import (
    consumer_roles, epilogue_stores, epilogue_views, mma_mainloop, mma_operands, pingpong_turn, smem_storage,
    step_over, store_sync, store_tile_full, store_tile_split, subtile_to_smem,
)
from .registry import TILE_M


class VarlenKGroupedGemm:
    """Tile (128, tile_n, 64); A (M, R, 1) M-major, B (N, R, 1) N-major, C (M, N, E) N-major.

    The epilogue stores (128, epi_n) sub-tiles through epi_stages shared-memory buffers.
    Measured on H200 (docs/kernels.md, "What was tried and lost"):
    (256, 32, 4) beats (256, 64, 2) and tile_n = 128, and reading the next tile's
    K range ahead of time gave nothing.

    lazy_epilogue: with K this short (4-5 K tiles per output tile at deepseek-v3)
    the default epilogue, which waits for its own stores to free buffers before
    the tile ends, makes a tile cost MMA + store. The lazy one leaves the stores
    in flight when the next tile's MMA starts and waits for a buffer only right
    before rewriting it; with epi_stages * epi_n == tile_n (the whole tile
    buffered) that is one full mainloop later. The buffers come out of the A/B
    ring (256-wide tiles: 4 stages -> 3). Same MMA, same K order, same rounding:
    bitwise equal to the default epilogue.

    cluster_m = 2: a cluster of two CTAs takes row tiles 2p and 2p + 1 of one (column tile,
    expert), so both need the same B stages: each CTA loads half of every B stage and multicasts
    it into both CTAs' shared memory (TMA multicast), and releases a stage to both producers. A
    third less L2 -> shared-memory traffic per tile; the loads, more than the MMA or the stores,
    bound these short-K GEMMs (deepseek-v3: the _defer kernel without MMA took 7.4 of 7.9 ms).

    pingpong (tile_n = 128): each consumer warp group computes whole 128 x 128 tiles, the two taking
    turns over the CTA's tiles, so one warp group's epilogue (registers -> smem, the part of the
    epilogue that the lazy one still runs on the MMA warps) overlaps the other's mainloop. As in
    grouped_gemm.py's ping-pong kernels: a warp group steps over the other's stages without waiting
    on them, two mbarriers order the mainloops (also needed for correctness: without them a warp
    group may wait a ring lap ahead, where a full barrier's phase parity cannot tell the laps apart),
    and each warp group has its own epilogue buffers (the whole 128 x 128 tile, stored by TMA and
    waited for at its next epilogue), named barrier and storing warp. Every output element is still
    reduced by one warp group in ascending K order: bitwise the cooperative kernel's result.
    """

    def __init__(
        self,
        tile_n: int = 256,
        epi_n: int = 32,
        epi_stages: int = 4,
        lazy_epilogue: bool = False,
        num_sms: int = 132,
        cluster_m: int = 1,
        pingpong: bool = False,
        accumulate: bool = False,
    ):
        assert tile_n in (128, 256) and tile_n % epi_n == 0
        # pingpong: whole 128 x 128 tiles per consumer warp group, alternating (see the docstring); its
        # epilogue buffers the whole tile (epi_stages sub-tiles of 64 x epi_n per warp group).
        assert not pingpong or (tile_n == 128 and not lazy_epilogue)
        self.pingpong = pingpong
        # accumulate: C += the result (the TMA stores add in L2: cp.reduce.async.bulk .add, bf16 rounding),
        # for weight gradients summed over macrobatch passes without a second gradient buffer. Each element
        # still gets one add per launch (one CTA per tile): deterministic.
        self.accumulate = accumulate
        # cluster_m = 2: CTA pairs (a cluster) take row tiles 2p, 2p + 1 of the same (column tile, expert)
        # and share B: each loads half of every B stage and multicasts it to both (see the docstring).
        assert cluster_m in (1, 2)
        self.cluster_m = cluster_m
        # lazy: each buffer is waited for just before it is rewritten (see _epilogue_lazy);
        # sub-tile e of every tile uses buffer e % epi_stages.
        assert not lazy_epilogue or (epi_stages >= 2 and (tile_n // epi_n) % epi_stages == 0)
        self.lazy_epilogue = lazy_epilogue
        self.tile_mnk = (128, tile_n, 64)
        assert TILE_M % self.tile_mnk[2] == 0  # segments start on a K tile
        self.num_sms = num_sms
        self.acc_dtype = cutlass.Float32
        # Two consumer warp groups split the 128 rows (64 each); ping-pong: one warp group's MMA covers
        # all 128 rows (two m64 wgmma per k block).
        self.mma_atom_layout = (1, 1, 1) if pingpong else (2, 1, 1)
        self.num_consumer_wg = 2
        self.threads_per_wg = 128
        self.num_threads = (1 + self.num_consumer_wg) * self.threads_per_wg
        self.producer_regs = 40
        self.consumer_regs = 232
        self.epi_tile = (128, epi_n)
        self.epi_stages = epi_stages
        self.epi_buffers = epi_stages
        # Warps that release each A/B stage (per CTA): both consumer warp groups, or the tile's one.
        self.stage_consumer_warps = self.num_consumer_wg * 4
        if pingpong:
            self.epi_tile = (64, epi_n)  # the sub-tiles of one 64-row MMA block (the accumulator's order)
            self.epi_stages = 128 * tile_n // (64 * epi_n)  # the whole tile per warp group
            self.epi_buffers = 2 * self.epi_stages
            self.stage_consumer_warps = 4
        self.smem_bytes = utils.get_smem_capacity_in_bytes("sm_90")

    def _stages(self, ab_dtype, c_dtype) -> int:
        return stage_count(self.smem_bytes, self.tile_mnk, ab_dtype, c_dtype, self.epi_tile, self.epi_buffers)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, R, 1) M-major
        mB: cute.Tensor,  # (N, R, 1) N-major
        mC: cute.Tensor,  # (M, N, E) N-major
        seg_end: cute.Tensor,  # (E,) int32, end row of each expert's padded segment
        seg_rows: cute.Tensor,  # (E,) int32, rows of each expert to reduce (<= its segment)
        group_m: cutlass.Int32,  # row tiles per raster band inside an expert (1: column tiles fastest)
        stream: cuda.CUstream,
    ):
        self.ab_dtype = mA.element_type
        self.c_dtype = mC.element_type
        self.a_layout = utils.LayoutEnum.from_tensor(mA)
        self.b_layout = utils.LayoutEnum.from_tensor(mB)
        self.c_layout = utils.LayoutEnum.from_tensor(mC)
        if cutlass.const_expr(self.ab_dtype != mB.element_type):
            raise TypeError("A and B must share a dtype")

        bm, bn, bk = self.tile_mnk
        self.ab_stages = self._stages(self.ab_dtype, self.c_dtype)
        tiled_mma, a_smem, b_smem, c_smem = mma_and_smem_layouts(self, self.ab_stages)

        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_smem, (None, None, 0)), (bm, bk)
        )
        if cutlass.const_expr(self.cluster_m > 1):
            tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), mB, cute.slice_(b_smem, (None, None, 0)),
                (bn, bk), num_multicast=self.cluster_m,
            )  # fmt: skip
        else:
            tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem, (None, None, 0)), (bn, bk)
            )
        store_op = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        if cutlass.const_expr(self.accumulate):
            store_op = cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD)
        tma_c, tma_mC = cute.nvgpu.cpasync.make_tiled_tma_atom(
            store_op, mC, cute.slice_(c_smem, (None, None, 0)), self.epi_tile
        )

        gc = cute.zipped_divide(mC, tiler=(bm, bn))
        tiles_m, tiles_n, num_experts = gc[(0, (None, None, None))].shape
        # cluster_m = 2: linear tiles 2c, 2c + 1 go to the two CTAs of cluster c, and _tile_coord maps them
        # to row tiles 2p, 2p + 1 of one (column tile, expert): the tile space counts row-tile pairs (an odd
        # last row tile gets a partner past M, whose A loads are zero-filled and stores clipped by TMA).
        if cutlass.const_expr(self.cluster_m > 1):
            tiles_m = (tiles_m + 1) // 2
        sched_params = utils.PersistentTileSchedulerParams(
            (tiles_m * tiles_n * num_experts * self.cluster_m, 1, 1), (self.cluster_m, 1, 1)
        )
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, self.num_sms // self.cluster_m)

        # (ping-pong: + the two mainloop order barriers of the consumer warp groups, see the kernel)
        self.shared_storage = smem_storage(self.ab_stages, self.ab_dtype, a_smem, b_smem, self.c_dtype, c_smem,
                                           self.pingpong)

        self.kernel(
            tma_a, tma_mA, tma_b, tma_mB, tma_c, tma_mC, seg_end, seg_rows,
            tiled_mma, a_smem, b_smem, c_smem, sched_params, cutlass.Int32(tiles_m), cutlass.Int32(tiles_n), group_m,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            cluster=(self.cluster_m, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

    def _tile_coord(self, linear, tiles_m, tiles_n, group_m):
        """Linear tile index -> (m_tile, n_tile, expert): expert slowest, then bands of group_m row tiles.
        With a cluster, tiles_m counts row-tile pairs and CTA r of cluster c gets row 2 p + r of pair p."""
        if cutlass.const_expr(self.cluster_m > 1):
            pair, n_tile, expert = self._tile_coord_one(linear // self.cluster_m, tiles_m, tiles_n, group_m)
            return pair * self.cluster_m + linear % self.cluster_m, n_tile, expert
        return self._tile_coord_one(linear, tiles_m, tiles_n, group_m)

    def _tile_coord_one(self, linear, tiles_m, tiles_n, group_m):
        per_expert = tiles_m * tiles_n
        expert = linear // per_expert
        within = linear - expert * per_expert
        band = within // (group_m * tiles_n)
        first_m = band * group_m
        rows_in_band = cutlass.min(tiles_m - first_m, group_m)
        within = within - band * (group_m * tiles_n)
        return first_m + within % rows_in_band, within // rows_in_band, expert

    def _k_range(self, seg_end, seg_rows, expert):
        """(first K tile, number of K tiles) of an expert."""
        bk = self.tile_mnk[2]
        prev = seg_end[cutlass.max(expert - 1, 0)]  # in bounds for every expert >= 0
        start = cutlass.select_(expert > 0, prev, cutlass.Int32(0))
        return start // bk, (seg_rows[expert] + (bk - 1)) // bk

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        seg_end: cute.Tensor,
        seg_rows: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        c_smem: cute.ComposedLayout,
        sched_params: utils.PersistentTileSchedulerParams,
        tiles_m: cutlass.Int32,
        tiles_n: cutlass.Int32,
        group_m: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0))) + cute.size_in_bytes(
            self.ab_dtype, cute.slice_(b_smem, (None, None, 0))
        )
        # A stage is free once the consumer warps of every CTA it is multicast into released it:
        # with a cluster each consumer warp arrives on the empty barrier of both CTAs (the pipeline
        # picks the peers from cta_layout_vmnk), and a full barrier expects A plus both halves of B.
        # (create() ends with a cluster-wide sync: the barriers are initialised before a peer's
        # multicast or arrive can reach them.)
        if cutlass.const_expr(self.pingpong):
            # Mainloop order of the ping-pong warp groups: warp group w waits on order_bars[w] before its
            # mainloop and its 128 threads arrive on order_bars[1 - w] after it (grouped_gemm.py).
            # Initialised here, fenced by the A/B pipeline's setup.
            order_bars = storage.order_barriers.data_ptr()
            if tidx == 0:
                cute.arch.mbarrier_init(order_bars, self.threads_per_wg)
                cute.arch.mbarrier_init(order_bars + 1, self.threads_per_wg)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.stage_consumer_warps * self.cluster_m),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
        )
        b_mask = None
        b_rank, b_ranks = 0, cute.make_layout(1)
        if cutlass.const_expr(self.cluster_m > 1):
            cta_layout = cute.make_layout((self.cluster_m, 1, 1))
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cta_coord = cta_layout.get_flat_coord(rank)
            b_mask = cute.make_layout_image_mask(cta_layout, cta_coord, mode=0)
            b_rank, b_ranks = cta_coord[0], cute.make_layout(self.cluster_m)

        sA, sB, sC = smem_tensors(storage, a_smem, b_smem, c_smem)

        # (bM, bK, tilesM, tilesK, 1), (bN, bK, tilesN, tilesK, 1), (bM, bN, tilesM, tilesN, E)
        gA, gB, gC = tile_views(mA, mB, mC, self.tile_mnk)

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, b_rank, b_ranks, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )

        if wg_idx == 0:
            # ---------------- producer: TMA loads ----------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                sched = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
                )
                work = sched.initial_work_tile_info()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                while work.is_valid_tile:
                    m_tile, n_tile, expert = self._tile_coord(work.tile_idx[0], tiles_m, tiles_n, group_m)
                    k_first, k_tiles = self._k_range(seg_end, seg_rows, expert)
                    tAgA_t = tAgA[(None, m_tile, None, 0)]
                    tBgB_t = tBgB[(None, n_tile, None, 0)]
                    for k in range(k_tiles):
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(tma_a, tAgA_t[(None, k_first + k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                        if cutlass.const_expr(self.cluster_m > 1):
                            cute.copy(tma_b, tBgB_t[(None, k_first + k)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                                      mcast_mask=b_mask)
                        else:
                            cute.copy(tma_b, tBgB_t[(None, k_first + k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                        ab_pipe.producer_commit(state)
                        state.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                ab_pipe.producer_tail(state)
        else:
            # ---------------- consumers: wgmma + epilogue ----------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg, ctid, store_warp, buf_base, epi_threads, barrier_id = consumer_roles(
                tidx, wg_idx, self.threads_per_wg, self.epi_stages, self.pingpong
            )
            tCrA, tCrB, acc, k_blocks = mma_operands(tiled_mma, ctid, sA, sB, gC, self.acc_dtype)

            r2s, tRS_sC, tRS_acc, rD, rD_out, rD_size = epilogue_stores(
                tiled_mma, ctid, sC, acc, self.c_layout, self.c_dtype, self.acc_dtype
            )
            epi_barrier, store_pipe = store_sync(epi_threads, self.epi_stages, barrier_id)

            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
            )
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            epi_count = cutlass.Int32(0)
            turn = cutlass.Int32(0)  # ping-pong: the warp group whose tile the next one is
            # ping-pong: phase to wait for on order_bars[wg]; a fresh barrier passes parity 1 at once,
            # so warp group 1 (wg 0) starts and warp group 2 waits for its first arrival
            order_phase = 1 - wg
            while work.is_valid_tile:
                m_tile, n_tile, expert = self._tile_coord(work.tile_idx[0], tiles_m, tiles_n, group_m)
                _, k_tiles = self._k_range(seg_end, seg_rows, expert)
                # k-blocks of the last K tile that hold real rows (the rest, zero padding, are not multiplied)
                mma_k = self.tile_mnk[2] // k_blocks
                last_k_blocks = (seg_rows[expert] - (k_tiles - 1) * self.tile_mnk[2] + (mma_k - 1)) // mma_k
                skip, turn = pingpong_turn(turn, wg, self.pingpong)
                if skip == 1:
                    read_state, release_state = step_over(k_tiles, read_state, release_state)
                else:
                    acc.fill(0.0)
                    if cutlass.const_expr(self.pingpong):
                        cute.arch.mbarrier_wait(order_bars + wg, order_phase)
                        order_phase = 1 - order_phase
                    # one mainloop per count of real k-blocks in the last K tile (each branch a whole
                    # unrolled mainloop: no branch between wgmmas).
                    # (The full case stays its own call: folded into the loop as last_k_blocks=k_blocks,
                    # the PTX orders the branches otherwise and copies the accumulators at the join.)
                    if k_tiles > 0:
                        if last_k_blocks == k_blocks:
                            tiled_mma, acc, read_state, release_state = mma_mainloop(
                                tiled_mma, acc, tCrA, tCrB, k_blocks, k_tiles, ab_pipe, read_state, release_state,
                            )
                        for n in cutlass.range_constexpr(1, k_blocks):
                            if last_k_blocks == n:
                                tiled_mma, acc, read_state, release_state = mma_mainloop(
                                    tiled_mma, acc, tCrA, tCrB, k_blocks, k_tiles, ab_pipe, read_state,
                                    release_state, last_k_blocks=n,
                                )
                    if cutlass.const_expr(self.pingpong):
                        cute.arch.mbarrier_arrive(order_bars + (1 - wg))
                    bSG_sC, bSG_gC, epi_tiles, epi_shape, epi_layout = epilogue_views(
                        gC[(None, None, m_tile, n_tile, expert)], self.epi_tile, tma_c, sC
                    )
                    if cutlass.const_expr(self.pingpong):
                        store_tile_full(
                            r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, tma_c, bSG_sC, bSG_gC, epi_layout,
                            epi_tiles, epi_barrier, warp_idx, buf_base, store_warp,
                        )
                    else:
                        epi_count = self._epilogue(
                            r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, tma_c, bSG_sC, bSG_gC, epi_layout, epi_tiles,
                            epi_count, epi_barrier, store_pipe, warp_idx,
                        )
                sched.advance_to_next_work()
                work = sched.get_current_work()
            store_pipe.producer_tail()

    @cute.jit
    def _epilogue(
        self, r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size: cutlass.Constexpr, tma_c, bSG_sC, bSG_gC, epi_layout,
        epi_tiles: cutlass.Constexpr, epi_count, epi_barrier, store_pipe, warp_idx,
    ):
        """The cooperative kernels' epilogue (lazy or split) of one tile; returns the new epi_count."""
        if cutlass.const_expr(self.lazy_epilogue):
            # Stores of this tile are left in flight while the next tile's MMA runs;
            # a buffer is waited for only right before it is rewritten. One bulk group
            # per sub-tile, so "buffer b is free" = all but the newest groups have read smem.
            nbuf = self.epi_stages
            if warp_idx == 4:
                cute.arch.cp_async_bulk_wait_group(nbuf - 1, read=True)  # buffer 0's last store
            epi_barrier.arrive_and_wait()
            for e in cutlass.range_constexpr(epi_tiles):
                subtile_to_smem(r2s, tRS_acc, e, rD, rD_out, rD_size, tRS_sC[(None, None, None, e % nbuf)])
                cute.arch.fence_proxy("async.shared", space="cta")
                if cutlass.const_expr(e + 1 < epi_tiles):
                    if warp_idx == 4:
                        # buffer (e+1) % nbuf: its last store is older than the nbuf - 2
                        # groups issued since (store e is not issued yet)
                        cute.arch.cp_async_bulk_wait_group(nbuf - 2, read=True)
                epi_barrier.arrive_and_wait()
                if warp_idx == 4:
                    cute.copy(tma_c, bSG_sC[(None, e % nbuf)], bSG_gC[(None, epi_layout.get_hier_coord(e))])
                    cute.arch.cp_async_bulk_commit_group()
        else:
            store_tile_split(
                r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, tma_c, bSG_sC, bSG_gC, epi_layout,
                epi_tiles, epi_count, self.epi_stages, epi_barrier, store_pipe, warp_idx,
            )
            epi_count = epi_count + epi_tiles
        return epi_count
