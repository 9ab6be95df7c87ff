"""The plain grouped GEMM on MXFP8 weights with the weights as the wgmma's A operand, converted in registers.

C[r] = A[r] @ dequantize(W[e(r)])^T as C^T = W[e] @ A^T: the MMA's M runs over W's rows (the output features),
its N over a schedule row tile's 128 tokens. Each stage's E4M3 bytes and scale pairs arrive by TMA; each consumer
thread loads its A fragment's bytes (the wgmma register operand's layout: rows r, r + 8, K pairs k, k + 8) and makes
them bf16 in registers with mx_operand's recipe (one multiply a pair, exact), then the RS wgmma reads them. No
bf16 copy of the weights passes through shared memory, and there is no barrier between the consumer threads per
stage. The fragments of two stages alternate in registers (a stage's stay live until its wgmma batch is done).

The output tile (128 features x 128 tokens) goes through shared memory transposed, then to C's rows.
N % 128 == 0 and K % 128 == 0 (the host checks).
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

from .mx_operand import _HIGH_PAIR, _LOW_PAIR, SINGLE_MAX, _asm_b32, _factors

BM, BN, BK = 128, 128, 64  # features (two warp groups of 64), tokens (one schedule row tile), K per stage
C_PAD = 8  # bf16 elements past each token row of the transposed output tile (bank spread)
EPI_BARRIER_ID = 1


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
    """Called as VarlenMGroupedGemmMx: (a (M, K, 1) bf16, b (N, K, E) u8, b_scale (N, K / 64, E) u16, c (M, N, 1),
    tile_expert, seg_end, seg_rows, group_m, stream)."""

    def __init__(self, num_sms: int = 132):
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
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, (2, 1, 1), tiler_mn=(64, BN), a_source=warpgroup.OperandSource.RMEM,
        )
        c_bytes = BN * (BM + C_PAD) * 2
        stage_bytes = BM * BK + BN * BK * 2 + BM * 2
        stages = (self.smem_bytes - 2048 - c_bytes) // stage_bytes
        w_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (BM, BN, BK), cutlass.Uint8, stages)
        x_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (BM, BN, BK), cutlass.BFloat16, stages)
        s_smem = cute.make_layout((BM, 1, stages), stride=(1, BM, BM))
        c_smem = cute.make_layout((BN, BM), stride=(BM + C_PAD, 1))
        tma_w, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(w_smem, (None, None, 0)), (BM, BK))
        tma_x, tma_mX = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(x_smem, (None, None, 0)), (BN, BK))
        tma_s, tma_mS = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), b_scale, cute.slice_(s_smem, (None, None, 0)), (BM, 1))

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(w_smem)], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(x_smem)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[cutlass.Uint16, cute.cosize(s_smem)], 128]
            sC: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(c_smem)], 128]

        self.shared_storage = SharedStorage
        tiles_m = cute.size(mB, mode=[0]) // BM  # feature tiles
        tiles_n = cute.size(mA, mode=[0]) // BN  # schedule row tiles
        sched_params = utils.PersistentTileSchedulerParams((tiles_m * tiles_n, 1, 1), (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, self.num_sms)
        self.kernel(tma_w, tma_mW, tma_x, tma_mX, tma_s, tma_mS, mC, tile_expert, tiled_mma, w_smem, x_smem, s_smem,
                    c_smem, sched_params, cutlass.Int32(tiles_m), stages).launch(
            grid=grid, block=[self.num_threads, 1, 1], cluster=(1, 1, 1), min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
               tma_s: cute.CopyAtom, mS: cute.Tensor, mC: cute.Tensor, tile_expert: cute.Tensor,
               tiled_mma: cute.TiledMma, w_smem: cute.ComposedLayout, x_smem: cute.ComposedLayout,
               s_smem: cute.Layout, c_smem: cute.Layout, sched_params: utils.PersistentTileSchedulerParams,
               tiles_m: cutlass.Int32, stages: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_s)
        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sW = storage.sW.get_tensor(w_smem.outer, swizzle=w_smem.inner)
        sX = storage.sX.get_tensor(x_smem.outer, swizzle=x_smem.inner)
        sS = storage.sS.get_tensor(s_smem)
        sC = storage.sC.get_tensor(c_smem)
        tx_bytes = (cute.size_in_bytes(cutlass.Uint8, cute.slice_(w_smem, (None, None, 0)))
                    + cute.size_in_bytes(cutlass.BFloat16, cute.slice_(x_smem, (None, None, 0)))
                    + cute.size_in_bytes(cutlass.Uint16, cute.slice_(s_smem, (None, None, 0))))
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(), num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        gW = cute.local_tile(mW, (BM, BK), (None, None, None))  # (BM, BK, tiles_m, tiles_k, E)
        gX = cute.local_tile(mX, (BN, BK), (None, None, None))  # (BN, BK, tiles_n, tiles_k, 1)
        gS = cute.local_tile(mS, (BM, 1), (None, None, None))  # (BM, 1, tiles_m, K / 64, E)
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tXsX, tXgX = cute.nvgpu.cpasync.tma_partition(
            tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
            tma_s, 0, cute.make_layout(1), cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
        k_tiles = cute.size(gW, mode=[3])

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                                   cute.arch.grid_dim())
                work = sched.initial_work_tile_info()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                while work.is_valid_tile:
                    m_tile = work.tile_idx[0] % tiles_m  # features fastest: a wave shares a few token tiles
                    n_tile = work.tile_idx[0] // tiles_m
                    expert = tile_expert[n_tile]
                    if expert >= 0:
                        for k in range(k_tiles):
                            ab_pipe.producer_acquire(state)
                            bar = ab_pipe.producer_get_barrier(state)
                            cute.copy(tma_w, tWgW[(None, m_tile, k, expert)], tWsW[(None, state.index)],
                                      tma_bar_ptr=bar)
                            cute.copy(tma_s, tSgS[(None, m_tile, k, expert)], tSsS[(None, state.index)],
                                      tma_bar_ptr=bar)
                            cute.copy(tma_x, tXgX[(None, n_tile, k, 0)], tXsX[(None, state.index)], tma_bar_ptr=bar)
                            ab_pipe.producer_commit(state)
                            state.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                ab_pipe.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - self.threads_per_wg
            thr_mma = tiled_mma.get_slice(ctid)
            tCsW = thr_mma.partition_A(sW)  # this thread's A fragment bytes: ((2, 2, 2), 1, 4, stages)
            tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
            a_shape = thr_mma.partition_shape_A((BM, BK))
            raw = cute.make_rmem_tensor(a_shape, cutlass.Uint8)
            frag0 = tiled_mma.make_fragment_A(a_shape)
            frag1 = tiled_mma.make_fragment_A(a_shape)
            tCcA = thr_mma.partition_A(cute.make_identity_tensor((BM, BK)))
            row = tCcA[0][0]  # this thread's rows of W's tile: row, row + 8
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))
            epi_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID, num_threads=self.consumer_threads)

            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            while work.is_valid_tile:
                m_tile = work.tile_idx[0] % tiles_m
                n_tile = work.tile_idx[0] // tiles_m
                expert = tile_expert[n_tile]
                if expert >= 0:
                    acc.fill(0.0)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    # the last pair of stages is peeled off the loop, so that its wgmma batches, the wait for them
                    # and the epilogue's reads of the accumulator lie in one basic block (ptxas hoisted the reads
                    # above a wait that sat behind the loop's exit)
                    for kp in range(k_tiles // 2 - 1):
                        for half in cutlass.range_constexpr(2):
                            tiled_mma, acc, read_state, release_state = self._stage(
                                tiled_mma, acc, tCsW, sS, raw, frag0 if half == 0 else frag1,
                                frag1 if half == 0 else frag0, row, tCrX, ab_pipe, read_state, release_state,
                                kp * 2 + half > 0)
                    for half in cutlass.range_constexpr(2):
                        tiled_mma, acc, read_state, release_state = self._stage(
                            tiled_mma, acc, tCsW, sS, raw, frag0 if half == 0 else frag1, frag1 if half == 0 else frag0,
                            row, tCrX, ab_pipe, read_state, release_state, k_tiles + half > 2, last=half == 1)
                    for i in cutlass.range_constexpr(cute.size(acc)):  # the epilogue reads the finished sums
                        acc[i] = _pinned_f32(acc[i])
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                    # the tile transposed through shared memory: sC[token][feature], then whole token rows out
                    epi_barrier.arrive_and_wait()  # the previous tile's rows have left sC
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        m, n = tCcC[i]
                        sC[(n, m)] = acc[i].to(cutlass.BFloat16)
                    epi_barrier.arrive_and_wait()
                    gC = cute.local_tile(mC[(None, None, 0)], (BN, BM), (n_tile, m_tile))
                    tok = ctid // 2
                    first = (ctid % 2) * (BM // 2)
                    src = cute.zipped_divide(sC[(tok, None)], (8,))
                    dst = cute.zipped_divide(gC[(tok, None)], (8,))
                    for q in cutlass.range_constexpr(BM // 2 // 8):
                        cute.autovec_copy(src[(None, first // 8 + q)], dst[(None, first // 8 + q)])
                sched.advance_to_next_work()
                work = sched.get_current_work()

    @cute.jit
    def _stage(self, tiled_mma, acc, tCsW, sS, raw, frag, other, row, tCrX, ab_pipe, read_state, release_state,
               release_prev, last: cutlass.Constexpr = False):
        """One stage: wait for it, make its A fragment (frag) bf16, issue its wgmma batch, wait for the batch before
        it (whose fragment, other, is then free) and release that one's stage. Returns (tiled_mma, acc, read_state,
        release_state): rebind all four."""
        ab_pipe.consumer_wait(read_state)
        self._to_bf16(tCsW, sS, raw, frag, row, read_state.index)
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
    def _to_bf16(self, tCsW, sS, raw, frag, row, stage):
        """Stage `stage`'s A fragment of this thread from its E4M3 bytes and scales into frag (bf16), exactly:
        element (v0, v1, v2, kb) is row + 8 v1, K 16 kb + 8 v2 + v0; its bytes come as words of four
        (v0, v1 of one v2, kb), whose low pair (row) and high pair (row + 8) are bf16 pairs of frag."""
        for kb in cutlass.range_constexpr(cute.size(raw, mode=[2])):
            cute.autovec_copy(tCsW[(None, 0, kb, stage)], raw[(None, 0, kb)])
        pairs = (sS[(row, 0, stage)].to(cutlass.Int32) & 0xFFFF, sS[(row + 8, 0, stage)].to(cutlass.Int32) & 0xFFFF)
        words = cute.recast_tensor(raw, cutlass.Int32)  # word 2 kb + v2
        out = cute.recast_tensor(frag, cutlass.Int32)  # word v1 + 2 v2 + 4 kb
        for blk in cutlass.range_constexpr(2):  # K blocks of 32: kb 2 blk, 2 blk + 1
            s_lo = (pairs[0] >> (8 * blk)) & 0xFF
            s_hi = (pairs[1] >> (8 * blk)) & 0xFF
            f_lo, g_lo = _factors(s_lo)
            f_hi, g_hi = _factors(s_hi)
            for j in cutlass.range_constexpr(4):  # (kb, v2) of the block
                kb = 2 * blk + j // 2
                v2 = j % 2
                word = words[2 * kb + v2]
                out[4 * kb + 2 * v2] = _asm_b32(_LOW_PAIR, word, f_lo)
                out[4 * kb + 2 * v2 + 1] = _asm_b32(_HIGH_PAIR, word, f_hi)
            if s_lo > SINGLE_MAX:
                for j in cutlass.range_constexpr(4):
                    i = 4 * (2 * blk + j // 2) + 2 * (j % 2)
                    out[i] = _asm_b32("mul.rn.bf16x2 $0, $1, $2;", out[i], g_lo)
            if s_hi > SINGLE_MAX:
                for j in cutlass.range_constexpr(4):
                    i = 4 * (2 * blk + j // 2) + 2 * (j % 2) + 1
                    out[i] = _asm_b32("mul.rn.bf16x2 $0, $1, $2;", out[i], g_hi)
