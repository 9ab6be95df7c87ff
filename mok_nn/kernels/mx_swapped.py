"""The grouped GEMMs on MXFP8 weights, the weights the wgmma's A operand, made bf16 in registers: the forward's
(mok_gemm_bk_mx; mok_gemm_gate_up_<act>_mx with the activation) and precision="mxfp8"'s dgrad on MXFP8-only weights
(mok_gemm_bn_mxq[_f32], SwappedMxColumnGemm at the end: W read along its columns).

C[r] = A[r] @ dequantize(W[e(r)])^T as C^T = W[e] @ A^T: the MMA's M runs over W's rows (the output features),
its N over a schedule row tile's 128 tokens. Each stage's E4M3 bytes and scale pairs arrive by TMA; each consumer
thread loads its A fragment's bytes (the wgmma register operand's layout: rows r, r + 8, K pairs k, k + 8) and makes
them bf16 in registers with mx_operand's recipe (one multiply a pair, exact), then the RS wgmma reads them. No
bf16 copy of the weights passes through shared memory, and there is no barrier between the consumer threads per
stage. The fragments of two stages alternate in registers (a stage's stay live until its wgmma batch is done).
The products are those of the bf16 kernel on W_q = dequantize(W) (an E4M3 value times its scale is a bf16 value),
summed in the same k16 steps, so the result has the bf16 kernel's bits (tests/gpu/test_mx_gemm_cuda.py).

Each thread's bytes of a stage lie at four offsets from the stage's start (one per k16 block; the other rows and
K pairs at fixed distances), computed once: the loop adds the stage's offset and loads, with no swizzle arithmetic
per load. Scale bytes above SINGLE_MAX (a second multiply) are rare: one test a stage takes them off the hot path.

The output tile (128 features x 128 tokens) leaves transposed: stmatrix.trans into shared memory, then TMA stores
left in flight while the next tile's main loop runs. With the activation the stores and h are the producer warp
group's idle warps' work (two mbarriers hand the tile over and back), so the consumers go straight on. Past N, the
TMA loads give zero bytes and scales and the stores clip. N % 8 == 0 and K % 64 == 0 (TMA's 16-byte strides; whole
stages).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import warpgroup

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .gemm_consumer import epilogue_stores, hand_tile_to_helpers, helpers_send_h, subtile_to_smem
from .grouped_gemm import expert_band_tile
from .mx_operand import (_LOW_PAIR, _MAX, _MIN, _REQUANT_PAIR, BF16_INF_PAIR, FACTOR_PAIR_BITS, LANE_BITS,
                         SINGLE_MAX, _asm_b32, _column_scale)
from .registry import ROUNDS_FLAG
from .swiglu import act_piece

BM, BN, BK = 128, 128, 64  # features (two warp groups of 64), tokens (one schedule row tile), K per stage
EPI_TILE = (BM, 32)  # the output tile leaves in four (features, tokens) pieces, features contiguous
HALF = BM // 2  # rows of one warp group: W rows and output features move in halves of 64
VEC = 8  # bf16 values of a 16-byte piece
EPI_BARRIER_ID = 1
HELPER_BARRIER_ID = 2  # act: the producer warp group's helper warps 1-3
STORE_WARP = 4  # the first consumer warp issues the TMA stores


@dsl_user_op
def _pinned(v, *, loc=None, ip=None) -> cutlass.Int32:
    """v through an empty asm block with side effects: its register holds v (unmodified, not reused) up to here.
    The RS wgmma reads its A registers asynchronously, which the register allocator does not see."""
    return cutlass.Int32(llvm.inline_asm(T.i32(), [cutlass.Int32(v).ir_value(loc=loc, ip=ip)], "", "=r,0",
                                         has_side_effects=True, is_align_stack=False,
                                         asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _pinned_f32(v, *, loc=None, ip=None) -> cutlass.Float32:
    """As _pinned, for an fp32 accumulator value: reads of it come after this point (after the wgmma wait)."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(v).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                           has_side_effects=True, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def _keep_until_here(frag):
    """The A fragment's registers stay live and unmodified until this point (after the wait for its wgmma)."""
    words = cute.recast_tensor(frag, cutlass.Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = _pinned(words[i])


class SwappedMxGemm:
    """mok_gemm_bk_mx. Called as (a (M, K, 1) bf16 rows, b (N, K, E) u8 E4M3 bytes K-major, b_scale (N, K / 64, E)
    u16 scale pairs N fastest (the low byte K block 2j's), c (M, N, 1) bf16, tile_expert, seg_end, seg_rows,
    group_m, stream); group_m is not read: the tiles run in expert bands (_tile_coord).

    act (SwappedMxGemmAct): the gate/up GEMM with the activation. W is gate_up_proj [gate; up] (2I rows): a tile's
    first warp group takes 64 gate rows, the second the 64 up rows of the same features. The consumers only put the
    bf16 tile into shared memory and hand it to the producer warp group's idle warps 1-3 (_act_helper), which store
    it, compute h = act(gate, up) from it (as mok_act_fwd reads gate_up; h_mx != 0: h's MXFP8 values along I, 4 lanes
    a 32-feature block) and store h while the consumers run the next tile's main loop."""

    column = False  # SwappedMxColumnGemm: W read along its columns (the dgrad)

    def __init__(self, act: str | None = None, num_sms: int = 132):
        self.act = act
        self.num_sms = num_sms
        self.threads_per_wg = 128
        self.num_threads = 3 * self.threads_per_wg
        self.consumer_threads = 2 * self.threads_per_wg
        self.producer_regs = 40
        self.consumer_regs = 232
        self.smem_bytes = utils.get_smem_capacity_in_bytes("sm_90")

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, b_scale: cute.Tensor, mC: cute.Tensor,
                 tile_expert: cute.Tensor, seg_end: cute.Tensor, seg_rows: cute.Tensor, group_m: cutlass.Int32,
                 stream: cuda.CUstream):
        self._launch(mA, mB, b_scale, mC, mC, (tile_expert, seg_end, seg_rows), cutlass.Int32(0),
                     cutlass.Float32(0.0), stream)

    def _scale_bytes_per_stage(self) -> int:
        """Shared memory of a stage's scales: a scale pair per W row (forward), or two halves' row factors of 64
        rows for two 32-column blocks (column form)."""
        return 2 * (2 * BK * 2) if self.column else BM * 2

    @cute.jit
    def _launch(self, mA: cute.Tensor, mB: cute.Tensor, b_scale: cute.Tensor, mC: cute.Tensor, mH: cute.Tensor,
                segments, h_mx: cutlass.Int32, limit: cutlass.Float32, stream: cuda.CUstream):
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, (2, 1, 1), tiler_mn=(64, BN), a_source=warpgroup.OperandSource.RMEM,
        )
        epi_buffers = BN // EPI_TILE[1]
        # the column form stores from registers: no output tile in shared memory
        c_bytes = (0 if self.column else BM * BN * 2) + (HALF * BN * 2 if self.act is not None else 0)
        stage_bytes = BM * BK + BN * BK * 2 + self._scale_bytes_per_stage()
        stages = (self.smem_bytes - 2048 - c_bytes) // stage_bytes
        # a stage's W bytes and scales arrive in two halves of 64 rows (forward) or 64 columns (column form): the
        # warp groups' halves, half h of stage s at 2 s + h
        if cutlass.const_expr(self.column):
            # (64 columns, 64 rows) of W[e] per half, columns contiguous, the 64-byte swizzle (bits 4-5 ^= bits 7-8)
            w_smem = cute.make_composed_layout(cute.make_swizzle(2, 4, 3), 0,
                                               cute.make_layout((HALF, BK, 2 * stages), stride=(1, HALF, HALF * BK)))
            # the row factors of the half's 64 rows for its two 32-column blocks, rows contiguous
            s_smem = cute.make_layout((BK, 2, 2 * stages), stride=(1, BK, 2 * BK))
            s_box = (BK, 2)
        else:
            w_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (HALF, BN, BK), cutlass.Uint8,
                                                   2 * stages)
            s_smem = cute.make_layout((HALF, 1, 2 * stages), stride=(1, HALF, HALF))
            s_box = (HALF, 1)
        x_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (BM, BN, BK), cutlass.BFloat16, stages)
        c_smem = sm90_utils.make_smem_layout_epi(cutlass.BFloat16, utils.LayoutEnum.COL_MAJOR, EPI_TILE, epi_buffers)
        # the same buffers as halves of 64 features (half h of buffer e at 2 e + h): what each TMA store sends
        c_half = sm90_utils.make_smem_layout_epi(cutlass.BFloat16, utils.LayoutEnum.COL_MAJOR, (HALF, EPI_TILE[1]),
                                                 2 * epi_buffers)
        h_smem = sm90_utils.make_smem_layout_epi(cutlass.BFloat16, utils.LayoutEnum.COL_MAJOR, (HALF, EPI_TILE[1]),
                                                 epi_buffers)
        tma_w, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(w_smem, (None, None, 0)), (HALF, BK))
        tma_x, tma_mX = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(x_smem, (None, None, 0)), (BN, BK))
        tma_s, tma_mS = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), b_scale, cute.slice_(s_smem, (None, None, 0)), s_box)
        tma_c, tma_mC, tma_h, tma_mH = None, mC, None, None  # the column form stores C from registers
        if cutlass.const_expr(not self.column):
            # outputs in the MMA's terms: (features, rows), features contiguous
            mCt = cute.make_tensor(mC.iterator, cute.select(mC.layout, mode=[1, 0, 2]))
            mHt = cute.make_tensor(mH.iterator, cute.select(mH.layout, mode=[1, 0, 2]))
            tma_c, tma_mC = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mCt, cute.slice_(c_half, (None, None, 0)),
                (HALF, EPI_TILE[1]))
            tma_h, tma_mH = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mHt, cute.slice_(h_smem, (None, None, 0)),
                (HALF, EPI_TILE[1]))

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
            epi_barriers: cute.struct.MemRange[cutlass.Int64, 2]  # act: the hand-off to the helper warps
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(w_smem)], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(x_smem)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[cutlass.Uint16, cute.cosize(s_smem)], 128]
            sC: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       8 if self.column else cute.cosize(c_smem)], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       cute.cosize(h_smem) if self.act is not None else 8], 1024]

        self.shared_storage = SharedStorage
        # tiles of output features: 128 rows of W (plain), or 64 features = 64 gate + 64 up rows (act)
        tiles_m = (cute.size(mB, mode=[0]) + BM - 1) // BM
        tiles_n = cute.size(mA, mode=[0]) // BN  # schedule row tiles
        sched_params = utils.PersistentTileSchedulerParams((tiles_m * tiles_n, 1, 1), (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, self.num_sms)
        self.kernel(tma_w, tma_mW, tma_x, tma_mX, tma_s, tma_mS, tma_c, tma_mC, tma_h, tma_mH, segments, tiled_mma,
                    w_smem, x_smem, s_smem, c_smem, c_half, h_smem, sched_params, cutlass.Int32(tiles_m), h_mx, limit,
                    stages).launch(
            grid=grid, block=[self.num_threads, 1, 1], cluster=(1, 1, 1), min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
               tma_s: cute.CopyAtom, mS: cute.Tensor, tma_c, mC: cute.Tensor, tma_h, mH, segments,
               tiled_mma: cute.TiledMma, w_smem: cute.ComposedLayout,
               x_smem: cute.ComposedLayout, s_smem: cute.Layout, c_smem: cute.ComposedLayout,
               c_half: cute.ComposedLayout, h_smem: cute.ComposedLayout,
               sched_params: utils.PersistentTileSchedulerParams, tiles_m: cutlass.Int32, h_mx: cutlass.Int32,
               limit: cutlass.Float32, stages: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_s)
            if cutlass.const_expr(not self.column):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sW = storage.sW.get_tensor(w_smem.outer, swizzle=w_smem.inner)
        sX = storage.sX.get_tensor(x_smem.outer, swizzle=x_smem.inner)
        sS = storage.sS.get_tensor(s_smem)
        tx_bytes = (2 * cute.size_in_bytes(cutlass.Uint8, cute.slice_(w_smem, (None, None, 0)))
                    + cute.size_in_bytes(cutlass.BFloat16, cute.slice_(x_smem, (None, None, 0)))
                    + 2 * cute.size_in_bytes(cutlass.Uint16, cute.slice_(s_smem, (None, None, 0))))
        epi_bars = None
        if cutlass.const_expr(self.act is not None):
            epi_bars = storage.epi_barriers.data_ptr()
            # epi_bars[0]: the consumers' gate/up tile is in sC (every consumer thread arrives); epi_bars[1]: the
            # helpers' stores have read sC and sH (their first thread arrives). Fenced by the A/B pipeline's setup.
            if tidx == 0:
                cute.arch.mbarrier_init(epi_bars, self.consumer_threads)
                cute.arch.mbarrier_init(epi_bars + 1, 1)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(), num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        gW = cute.local_tile(mW, (HALF, BK), (None, None, None))  # (64, BK, row halves, tiles_k, E)
        gX = cute.local_tile(mX, (BN, BK), (None, None, None))  # (BN, BK, tiles_n, tiles_k, 1)
        if cutlass.const_expr(self.column):
            gS = cute.local_tile(mS, (BK, 2), (None, None, None))  # (BK, 2, tiles_k, column halves, E)
        else:
            gS = cute.local_tile(mS, (HALF, 1), (None, None, None))  # (64, 1, row halves, K / 64, E)
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tXsX, tXgX = cute.nvgpu.cpasync.tma_partition(
            tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
            tma_s, 0, cute.make_layout(1), cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
        k_tiles = cute.size(gW, mode=[3])
        if cutlass.const_expr(not self.column):
            sC = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)
            sC_half = storage.sC.get_tensor(c_half.outer, swizzle=c_half.inner)
            sH = storage.sH.get_tensor(h_smem.outer, swizzle=h_smem.inner)
            # TMA store views: (piece, (feature halves, 32-token blocks))
            bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC_half, 0, 2),
                cute.zipped_divide(mC[(None, None, 0)], (HALF, EPI_TILE[1])))
            bSG_sH, bSG_gH = cute.nvgpu.cpasync.tma_partition(
                tma_h, 0, cute.make_layout(1), cute.group_modes(sH, 0, 2),
                cute.zipped_divide(mH[(None, None, 0)], (HALF, EPI_TILE[1])))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                                   cute.arch.grid_dim())
                work = sched.initial_work_tile_info()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                while work.is_valid_tile:
                    m_tile, n_tile, expert = _tile_coord(work.tile_idx[0], tiles_m, segments)
                    if expert >= 0:
                        halves = self._halves(m_tile, tiles_m)
                        for k in range(k_tiles):
                            ab_pipe.producer_acquire(state)
                            bar = ab_pipe.producer_get_barrier(state)
                            for h in cutlass.range_constexpr(2):
                                cute.copy(tma_w, tWgW[(None, halves[h], k, expert)], tWsW[(None, 2 * state.index + h)],
                                          tma_bar_ptr=bar)
                                scales = tSgS[(None, k, halves[h], expert)] if self.column else \
                                    tSgS[(None, halves[h], k, expert)]
                                cute.copy(tma_s, scales, tSsS[(None, 2 * state.index + h)], tma_bar_ptr=bar)
                            cute.copy(tma_x, tXgX[(None, n_tile, k, 0)], tXsX[(None, state.index)], tma_bar_ptr=bar)
                            ab_pipe.producer_commit(state)
                            state.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                ab_pipe.producer_tail(state)
            if cutlass.const_expr(self.act is not None):
                if warp_idx > 0:
                    self._act_helper(tma_c, bSG_sC, bSG_gC, tma_h, bSG_sH, bSG_gH, sC, sH, epi_bars, segments,
                                     sched_params, tiles_m, h_mx, limit, tidx)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - self.threads_per_wg
            thr_mma = tiled_mma.get_slice(ctid)
            tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
            a_shape = thr_mma.partition_shape_A((BM, BK))
            frag0 = tiled_mma.make_fragment_A(a_shape)
            frag1 = tiled_mma.make_fragment_A(a_shape)
            # this thread's A fragment: rows row, row + 8; K pairs k0, k0 + 8 of each k16 block
            tCcA = thr_mma.partition_A(cute.make_identity_tensor((BM, BK)))
            row, k0 = tCcA[0]
            w16 = cute.make_tensor(cute.recast_ptr(storage.sW.data_ptr(), dtype=cutlass.Uint16),
                                   cute.make_layout(cute.cosize(w_smem) // 2))
            if cutlass.const_expr(self.column):
                s32 = cute.make_tensor(cute.recast_ptr(storage.sS.data_ptr(), dtype=cutlass.Int32),
                                       cute.make_layout(cute.cosize(s_smem) // 2))
                operand = (w16, s32, *_column_offsets(row, k0))
                feature = row // HALF * HALF + _column_feature(row % HALF)  # of this thread's first fragment row
            else:
                operand = (w16, [_swizzled(row * BK + 16 * kb + k0) // 2 for kb in range(BK // 16)], sS, row)
                r2s, tRS_sC, tRS_acc, rD, rD_out, rD_size = epilogue_stores(
                    tiled_mma, ctid, sC, acc, utils.LayoutEnum.COL_MAJOR, cutlass.BFloat16, cutlass.Float32)
                epi_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID, num_threads=self.consumer_threads)

            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            empty_phase = cutlass.Int32(1)  # act: a fresh epi_bars[1] passes parity 1 at once
            while work.is_valid_tile:
                m_tile, n_tile, expert = _tile_coord(work.tile_idx[0], tiles_m, segments)
                if expert >= 0:
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    # The tile's last wgmma batch, the wait for it and the epilogue's reads of the accumulator lie
                    # in one basic block: the last stage (pair) is peeled off the loop (ptxas hoisted the reads
                    # above a wait that sat behind the loop's exit). An odd stage count peels the first stage.
                    acc.fill(0.0)
                    if k_tiles == 1:
                        tiled_mma, acc, read_state, release_state = self._stage(
                            tiled_mma, acc, operand, frag0, frag1, tCrX, ab_pipe, read_state,
                            release_state, False, last=True)
                    else:
                        odd = k_tiles % 2
                        if odd == 1:
                            tiled_mma, acc, read_state, release_state = self._stage(
                                tiled_mma, acc, operand, frag1, frag0, tCrX, ab_pipe, read_state,
                                release_state, False)
                        for kp in range(k_tiles // 2 - 1):
                            for half in cutlass.range_constexpr(2):
                                tiled_mma, acc, read_state, release_state = self._stage(
                                    tiled_mma, acc, operand, frag0 if half == 0 else frag1,
                                    frag1 if half == 0 else frag0, tCrX, ab_pipe, read_state, release_state,
                                    odd + kp * 2 + half > 0)
                        for half in cutlass.range_constexpr(2):
                            tiled_mma, acc, read_state, release_state = self._stage(
                                tiled_mma, acc, operand, frag0 if half == 0 else frag1,
                                frag1 if half == 0 else frag0, tCrX, ab_pipe, read_state, release_state,
                                k_tiles + half > 2, last=half == 1)
                    for i in cutlass.range_constexpr(cute.size(acc)):  # the epilogue reads the finished sums
                        acc[i] = _pinned_f32(acc[i])
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                    if cutlass.const_expr(self.column):
                        _column_store(acc, mC, m_tile * BM + feature, n_tile * BN + k0)
                    elif cutlass.const_expr(self.act is not None):
                        empty_phase = hand_tile_to_helpers(r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, BN // EPI_TILE[1],
                                                           epi_bars, empty_phase)
                    else:
                        self._epilogue(r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size, tma_c, bSG_sC, bSG_gC,
                                       self._halves(m_tile, tiles_m), n_tile, epi_barrier, warp_idx)
                sched.advance_to_next_work()
                work = sched.get_current_work()
            if cutlass.const_expr(not self.column and self.act is None):
                if warp_idx == STORE_WARP:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory outlives the last stores' reads

    @cute.jit
    def _halves(self, m_tile, tiles_m):
        """The tile's two 64-row halves of W (and of the output's features), in 64-row units: rows 128 m .. of W, or
        (act) gate rows 64 m .. and up rows I + 64 m .. (I = 64 tiles_m)."""
        if cutlass.const_expr(self.act is None):
            return (2 * m_tile, 2 * m_tile + 1)
        return (m_tile, m_tile + tiles_m)

    @cute.jit
    def _epilogue(self, r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size: cutlass.Constexpr, tma_c, bSG_sC, bSG_gC, halves,
                  n_tile, epi_barrier, warp_idx):
        """The tile out (no act): bf16 into shared memory (stmatrix.trans, whole token rows of features), then TMA
        stores of each (64 features, 32 tokens) piece, left in flight. The wait for the previous tile's stores to
        have read shared memory comes first."""
        pieces = BN // EPI_TILE[1]
        if warp_idx == STORE_WARP:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        epi_barrier.arrive_and_wait()
        for e in cutlass.range_constexpr(pieces):
            subtile_to_smem(r2s, tRS_acc, e, rD, rD_out, rD_size, tRS_sC[(None, None, None, e)])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_barrier.arrive_and_wait()
        if warp_idx == STORE_WARP:
            self._store_c(tma_c, bSG_sC, bSG_gC, halves, n_tile)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _store_c(self, tma_c, bSG_sC, bSG_gC, halves, n_tile):
        """The TMA stores of the output tile in sC: each (64 features, 32 tokens) piece to its place."""
        pieces = BN // EPI_TILE[1]
        for e in cutlass.range_constexpr(pieces):
            for h in cutlass.range_constexpr(2):
                cute.copy(tma_c, bSG_sC[(None, 2 * e + h)], bSG_gC[(None, (halves[h], n_tile * pieces + e))])

    @cute.jit
    def _act_helper(self, tma_c, bSG_sC, bSG_gC, tma_h, bSG_sH, bSG_gH, sC, sH, epi_bars, segments, sched_params,
                    tiles_m, h_mx, limit, tidx):
        """The activation epilogue on the producer warp group's idle warps 1-3, beside the consumers' next main loop.
        Per valid tile of the CTA's schedule: wait for the consumers' gate/up tile in sC (epi_bars[0]), send it by
        TMA, compute h = act(gate, up) from its bf16 values into sH (as mok_act_fwd reads gate_up), send h, and once
        every store has read shared memory, free the buffers (epi_bars[1]).
        h: 16-byte pieces of 8 features, thread-strided; piece p is token p // 8, features 8 (p % 8) ..; lanes
        4j .. 4j + 3 hold one 32-feature block (h_mx's shuffles need whole warps in every step: 1024 pieces a tile,
        a warp's 32 consecutive)."""
        pieces = BN // EPI_TILE[1]
        per_token = HALF // VEC
        helpers = self.threads_per_wg - 32
        htid = tidx - 32
        helper_bar = pipeline.NamedBarrier(barrier_id=HELPER_BARRIER_ID, num_threads=helpers)
        f_g = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
        f_u = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
        f_h = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        f_hq = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        full_phase = cutlass.Int32(0)
        while work.is_valid_tile:
            m_tile, n_tile, expert = _tile_coord(work.tile_idx[0], tiles_m, segments)
            if expert >= 0:
                cute.arch.mbarrier_wait(epi_bars, full_phase)
                full_phase = 1 - full_phase
                if htid == 0:
                    self._store_c(tma_c, bSG_sC, bSG_gC, self._halves(m_tile, tiles_m), n_tile)
                    cute.arch.cp_async_bulk_commit_group()
                for p in cutlass.range(htid, BN * per_token, helpers):
                    t = p // per_token
                    q = p % per_token
                    col = t % EPI_TILE[1]
                    buf = t // EPI_TILE[1]
                    src = cute.zipped_divide(sC[(None, col, buf)], (VEC,))  # gate pieces 0..7, up 8..15
                    dst = cute.zipped_divide(sH[(None, col, buf)], (VEC,))
                    act_piece(self.act, src[(None, q)], src[(None, per_token + q)], dst[(None, q)], f_g, f_u, f_h,
                              f_hq, limit, h_mx)
                helpers_send_h(tma_h, bSG_sH, bSG_gH, pieces, m_tile, n_tile * pieces, helper_bar, epi_bars, htid)
            sched.advance_to_next_work()
            work = sched.get_current_work()
        if htid == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _stage(self, tiled_mma, acc, operand, frag, other, tCrX, ab_pipe, read_state, release_state, release_prev,
               last: cutlass.Constexpr = False):
        """One stage: wait for it, make its A fragment (frag) bf16, issue its wgmma batch, wait for the batch before
        it (whose fragment, other, is then free) and release that one's stage. Returns (tiled_mma, acc, read_state,
        release_state): rebind all four."""
        ab_pipe.consumer_wait(read_state)
        if cutlass.const_expr(self.column):
            _column_to_bf16(*operand, frag, read_state.index)
        else:
            self._to_bf16(*operand, frag, read_state.index)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(frag, mode=[2])):
            cute.gemm(tiled_mma, acc, frag[(None, None, kb)], tCrX[(None, None, kb, read_state.index)], acc)
        warpgroup.commit_group()
        if cutlass.const_expr(last):  # the tile's last batch: wait for all, right behind it
            warpgroup.wait_group(0)
            _keep_until_here(frag)
        else:
            warpgroup.wait_group(1)
        _keep_until_here(other)
        if release_prev:
            ab_pipe.consumer_release(release_state)
            release_state.advance()
        read_state.advance()
        return tiled_mma, acc, read_state, release_state

    @cute.jit
    def _to_bf16(self, w16, offs, sS, row, frag, stage):
        """Stage `stage`'s A fragment of this thread from its E4M3 bytes and scales into frag (bf16), exactly:
        word v1 + 2 v2 + 4 kb of frag is the pair (row + 8 v1, K 16 kb + 8 v2 + k0 ..+1), one 16-bit load from
        offs[kb] (+ 8 rows = 256 u16, + 8 K = 4 u16) in the stage's bytes."""
        base = stage * (BM * BK // 2)
        # the scale pairs of rows row and row + 8 (a stage's are halves 2 stage, 2 stage + 1: 128 rows in a row)
        scales = ((sS[(row, 0, 2 * stage)].to(cutlass.Int32) & 0xFFFF)
                  | (sS[(row + 8, 0, 2 * stage)].to(cutlass.Int32) << 16))
        out = cute.recast_tensor(frag, cutlass.Int32)
        factor = [[_factor(scales, 2 * v1 + blk) for blk in range(2)] for v1 in range(2)]
        for kb in cutlass.range_constexpr(BK // 16):
            for v2 in cutlass.range_constexpr(2):
                for v1 in cutlass.range_constexpr(2):
                    pair = w16[base + offs[kb] + 256 * v1 + 4 * v2].to(cutlass.Int32)
                    out[v1 + 2 * v2 + 4 * kb] = _asm_b32(_LOW_PAIR, pair, factor[v1][kb // 2])
        # a scale byte above SINGLE_MAX: bit 7 set and the low 7 bits at least 7 (SINGLE_MAX + 1 = 0x87)
        if (((scales & 0x7F7F7F7F) + 0x79797979) & scales & 0x80808080) != 0:
            for v1 in cutlass.range_constexpr(2):
                for blk in cutlass.range_constexpr(2):
                    s = (scales >> (8 * (2 * v1 + blk))) & 0xFF
                    if s > SINGLE_MAX:
                        g = ((s - 7) << 7) * 0x10001
                        if s == 255:
                            g = cutlass.Int32(0x7FC07FC0)
                        for kb in cutlass.range_constexpr(2 * blk, 2 * blk + 2):
                            for v2 in cutlass.range_constexpr(2):
                                i = v1 + 2 * v2 + 4 * kb
                                out[i] = _asm_b32("mul.rn.bf16x2 $0, $1, $2;", out[i], g)


class SwappedMxGemmAct(SwappedMxGemm):
    """mok_gemm_gate_up_<act>_mx: the gate/up GEMM + activation on MXFP8 gate_up_proj. Called as (a (M, K, 1) bf16
    x rows, b (2I, K, E) u8 [gate; up] rows, b_scale (2I, K / 64, E) u16, gate_up (M, 2I, 1), h (M, I, 1), tile_expert,
    seg_end, seg_rows, h_mx, limit, group_m, stream); I % 64 == 0."""

    def __init__(self, act: str):
        super().__init__(act=act)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, b_scale: cute.Tensor, mC: cute.Tensor, mH: cute.Tensor,
                 tile_expert: cute.Tensor, seg_end: cute.Tensor, seg_rows: cute.Tensor, h_mx: cutlass.Int32,
                 limit: cutlass.Float32, group_m: cutlass.Int32, stream: cuda.CUstream):
        self._launch(mA, mB, b_scale, mC, mH, (tile_expert, seg_end, seg_rows), h_mx, limit, stream)


class SwappedMxColumnGemm(SwappedMxGemm):
    """mok_gemm_bn_mxq[_f32]: the backward's dgrad on MXFP8-only weights with precision="mxfp8", C[r] = A[r] @ V[e(r)]
    with V W_q's MXFP8 values along K (the stored rows; cuda_mx.MxColumnWeight). Called as (a (M, K, 1) bf16 rows,
    b (N, K, E) u8 E4M3 bytes N-major (W[e] stored [K, N], blocks of 32 along N), b_factors (K, N / 32, E) u16 K
    fastest: each row's factor 2**(S - 7) as bf16 bits, marked ROUNDS_FLAG in the 32 x 32 blocks holding a value
    that requantisation changes, c (M, N, 1) bf16 or fp32, tile_expert, seg_end, seg_rows, group_m, stream).

    C^T = V[e]^T @ A^T as in the forward, with the MMA's M over W's columns. The A fragment wants K pairs (rows k,
    k + 1) of one column, which lie 64 bytes apart in the stage; so the fragment's rows r and r + 8 stand for the
    adjacent columns 2 j and 2 j + 1 (of each 16), and one 16-bit load a row gives both: two loads and one PRMT
    each make a fragment word. The pair's two rows have their own scales: the factor word (two adjacent row
    factors) is one 32-bit load. A stage whose 32 x 32 blocks are marked requantises them in registers (the block's
    four lanes hold its 32 rows of a column: two shuffles for its largest and smallest magnitudes; mx_operand's
    steps). The accumulator holds each token's two adjacent columns in one thread, stored from registers as one
    word. W_q's scale bytes are at most SINGLE_MAX here (cuda_mx.column_reason). N % 32 == 0, K % 64 == 0."""

    column = True

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, b_factors: cute.Tensor, mC: cute.Tensor,
                 tile_expert: cute.Tensor, seg_end: cute.Tensor, seg_rows: cute.Tensor, group_m: cutlass.Int32,
                 stream: cuda.CUstream):
        self._launch(mA, mB, b_factors, mC, None, (tile_expert, seg_end, seg_rows), cutlass.Int32(0),
                     cutlass.Float32(0.0), stream)


# The column form's fragment word from two 16-bit loads a (row k: columns c, c + 1) and b (row k + 1): the bytes of
# column c (EVEN) or c + 1 (ODD) of both rows, each with its sign byte above it, then mx_operand's recipe times the
# factor word $3 (row k's factor low, row k + 1's high)
def _column_pair_ptx(selector: int) -> str:
    return ("{ .reg .b32 t;"
            f" prmt.b32 t, $1, $2, {selector:#x}; shl.b32 t, t, 4; and.b32 t, t, {LANE_BITS:#x};"
            " mul.rn.bf16x2 $0, t, $3; }")


COLUMN_EVEN_SELECTOR, COLUMN_ODD_SELECTOR = 0xC480, 0xD591  # bytes 0 and 4, or 1 and 5, under their sign bytes
_COLUMN_EVEN, _COLUMN_ODD = _column_pair_ptx(COLUMN_EVEN_SELECTOR), _column_pair_ptx(COLUMN_ODD_SELECTOR)


def _column_feature(row):
    """The W column (feature) within a warp group's 64 that fragment row `row` (< 8 within its 16) stands for: rows
    r and r + 8 of each 16 are the columns 2 (r % 8) and 2 (r % 8) + 1."""
    return row // 16 * 16 + 2 * (row % 8)


def _column_offsets(row, k0):
    """(u16 index of this thread's first load in stage 0's W bytes, Int32 index of its first factor word): the
    half's (64 columns, 64 rows) bytes at 2 row-halves a stage, rows 64 bytes apart, swizzled as the TMA writes them
    (_swizzled, the forward's 64-byte-row swizzle); the half's factors (64 rows, two 32-column blocks), rows
    contiguous."""
    half = row // HALF
    col = _column_feature(row % HALF)
    w = (half * HALF * BK + _swizzled(k0 * HALF + col)) // 2
    f = (half * 2 * BK + col // 32 * BK + k0) // 2
    return w, f


@cute.jit
def _column_to_bf16(w16, s32, base_w, base_f, frag, stage):
    """Stage `stage`'s A fragment of the column form into frag (bf16): word v1 + 2 v2 + 4 kb is column
    feature + v1's K pair (16 kb + 8 v2 + k0, + 1), W_q's values, requantised along K in marked blocks."""
    out = cute.recast_tensor(frag, cutlass.Int32)
    wb = base_w + stage * (BM * BK // 2)
    fb = base_f + stage * (2 * BK)
    marks = [cutlass.Int32(0), cutlass.Int32(0)]  # the factor words of the stage's two 32-row blocks
    for kb in cutlass.range_constexpr(BK // 16):
        for v2 in cutlass.range_constexpr(2):
            k = 16 * kb + 8 * v2
            lo = w16[wb + k * (HALF // 2)].to(cutlass.Int32)
            hi = w16[wb + (k + 1) * (HALF // 2)].to(cutlass.Int32)
            factor = s32[fb + k // 2]
            if cutlass.const_expr(v2 == 0 and kb % 2 == 0):
                marks[kb // 2] = factor
            factor = factor & FACTOR_PAIR_BITS
            out[2 * v2 + 4 * kb] = _asm_b32(_COLUMN_EVEN, lo, hi, factor)
            out[1 + 2 * v2 + 4 * kb] = _asm_b32(_COLUMN_ODD, lo, hi, factor)
    if ((marks[0] | marks[1]) & ROUNDS_FLAG) != 0:  # the same for the warp: its 16 columns lie in one block
        for blk in cutlass.range_constexpr(2):
            if (marks[blk] & ROUNDS_FLAG) != 0:
                for v1 in cutlass.range_constexpr(2):
                    _requantize_block(out, blk, v1)


@cute.jit
def _requantize_block(out, blk: cutlass.Constexpr, v1: cutlass.Constexpr):
    """The words of column feature + v1 in the stage's 32-row block blk (this lane's 8 values; lanes 4 j .. 4 j + 3
    hold the block) requantised along the rows where a value may round (mx_operand's steps). Every lane of the
    warp takes part."""
    words = [v1 + 2 * v2 + 4 * kb for kb in (2 * blk, 2 * blk + 1) for v2 in (0, 1)]
    amax, amin = cutlass.Int32(0), cutlass.Int32(BF16_INF_PAIR)
    for i in cutlass.range_constexpr(len(words)):
        mag = out[words[i]] & 0x7FFF7FFF
        amax = _asm_b32(_MAX, amax, mag)
        amin = _asm_b32(_MIN, amin, mag)
    for k in cutlass.range_constexpr(2):
        amax = _asm_b32(_MAX, amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
        amin = _asm_b32(_MIN, amin, cute.arch.shuffle_sync_bfly(amin, offset=1 << k))
    down, up, rounds = _column_scale(amax, amin)
    if rounds:
        for i in cutlass.range_constexpr(len(words)):
            out[words[i]] = _asm_b32(_REQUANT_PAIR, out[words[i]], down, up)


@cute.jit
def _column_store(acc, mC, feature, token):
    """The column form's tile out from registers: for each of this thread's tokens (token + 8 j + v0), columns
    feature and feature + 1 (accumulator rows r and r + 8, elements v0 + 2 v1 + 4 j) as one word; nothing past N."""
    if feature < cute.size(mC, mode=[1]):
        pairs = cute.make_rmem_tensor((2, 2, BN // 8), cutlass.Float32)  # (v1, v0, j): each pair adjacent
        for j in cutlass.range_constexpr(BN // 8):
            for v0 in cutlass.range_constexpr(2):
                for v1 in cutlass.range_constexpr(2):
                    pairs[(v1, v0, j)] = acc[v0 + 2 * v1 + 4 * j]
        out = cute.make_rmem_tensor((2, 2, BN // 8), mC.element_type)
        out.store(pairs.load().to(mC.element_type))
        word = cutlass.Int32 if cutlass.const_expr(mC.element_type == cutlass.BFloat16) else cutlass.Int64
        words = cute.recast_tensor(out, word)
        dst = cute.recast_tensor(mC, word)
        for j in cutlass.range_constexpr(BN // 8):
            for v0 in cutlass.range_constexpr(2):
                dst[(token + 8 * j + v0, feature // 2, 0)] = words[v0 + 2 * j]


@cute.jit
def _tile_coord(linear, tiles_m, segments):
    """Persistent tile `linear` -> (m_tile, n_tile, expert) in expert bands (grouped_gemm.expert_band_tile): an
    expert's token tiles fastest, then W's row tiles, so that the CTAs of a wave share each W tile among the
    expert's token tiles. W's rows fastest read an expert's W from HBM again for each of its token tiles where the
    expert's W outgrows L2 (mixtral's gate_up_proj: 117 MB of E4M3 bytes an expert, 16 token tiles at 8192
    tokens)."""
    n_tile, m_tile, expert = expert_band_tile(linear, tiles_m, *segments)
    return m_tile, n_tile, expert


@cute.jit
def _factor(scales, j: cutlass.Constexpr):
    """The first factor of scale byte j of scales (mx_operand's recipe) as a bf16x2 word: 2**(min(S, SINGLE_MAX) - 7)
    in both lanes ((min + 120) << 7, times 0x10001)."""
    s = cutlass.min((scales >> (8 * j)) & 0xFF, cutlass.Int32(SINGLE_MAX))
    return (s * 128 + 120 * 128) * 0x10001


@cute.jit
def _swizzled(offset):
    """The byte offset of a stage's W tile element under its shared-memory swizzle (make_smem_layout_a's
    Swizzle<2, 4, 3> for 64-byte rows: bits 4-5 ^= bits 7-8)."""
    return offset ^ ((offset >> 3) & 0x30)
