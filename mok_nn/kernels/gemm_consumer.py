"""Consumer-side setup shared by the grouped GEMM kernels (grouped_gemm.py, wgrad_gemm.py, mx_swapped.py).

Plain helpers traced inline into the kernels: the wgmma operands of one consumer
thread, the epilogue path registers -> shared memory (stmatrix) -> global
memory (TMA stores) with its barrier and store pipeline, and the hand-off of an
output tile to helper warps that store it (and compute h from it) beside the
next mainloop.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils


def smem_storage(ab_stages, ab_dtype, a_smem, b_smem, c_dtype, c_smem, order_barriers: bool = False,
                 epi_barriers: bool = False):
    """The shared-memory struct of a GEMM kernel: the A/B ring's full and empty barriers, (ping-pong) the
    two mainloop order barriers of the consumer warp groups, (epi_barriers) the full and empty barriers of
    an epilogue handed to other warps, then the A, B and epilogue buffers.
    (Built from an annotation dict of DSL types: this module's annotations are strings.)"""
    fields = {"ab_barriers": cute.struct.MemRange[cutlass.Int64, ab_stages * 2]}
    if order_barriers:
        fields["order_barriers"] = cute.struct.MemRange[cutlass.Int64, 2]
    if epi_barriers:
        fields["epi_barriers"] = cute.struct.MemRange[cutlass.Int64, 2]
    for name, dtype, layout in (("sA", ab_dtype, a_smem), ("sB", ab_dtype, b_smem), ("sC", c_dtype, c_smem)):
        fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def consumer_roles(tidx, wg_idx, threads_per_wg, epi_stages, pingpong: bool):
    """(wg, ctid, store_warp, buf_base, epi_threads, barrier_id) of a consumer thread (warp groups 1, 2).
    Cooperative: the tiled MMA gives consumer threads 0-127 (warp group 1) rows 0-63 of every tile,
    threads 128-255 (warp group 2) rows 64-127, warp 4 stores, one named barrier (1) over both groups.
    Ping-pong: warp group w takes every other tile of the CTA whole, with its own smem buffers
    (buf_base..), named barrier (1 + w) and storing warp (4 w)."""
    wg = wg_idx - 1
    if pingpong:
        return wg, tidx % threads_per_wg, wg_idx * 4, wg * epi_stages, threads_per_wg, 1 + wg
    return wg, tidx - threads_per_wg, 4, 0, 2 * threads_per_wg, 1


def mma_operands(tiled_mma, ctid, sA, sB, gC, acc_dtype):
    """(A fragment, B fragment, accumulator, k-blocks per stage) of consumer thread ctid."""
    thr_mma = tiled_mma.get_slice(ctid)
    tCsA = thr_mma.partition_A(sA)
    tCsB = thr_mma.partition_B(sB)
    tCrA = tiled_mma.make_fragment_A(tCsA)
    tCrB = tiled_mma.make_fragment_B(tCsB)
    acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape[:3], acc_dtype)
    return tCrA, tCrB, acc, cute.size(tCrA, mode=[2])


@cute.jit
def pingpong_turn(turn, wg, pingpong: cutlass.Constexpr):
    """(skip, turn): whether warp group wg (0, 1) leaves the next tile to the other one, and the turn
    after it. Ping-pong warp groups take a CTA's tiles alternately (turn: whose tile the next is);
    cooperative ones (pingpong False) share every tile. Rebind both (see mma_mainloop)."""
    skip = cutlass.Int32(0)
    if cutlass.const_expr(pingpong):
        if turn != wg:
            skip = cutlass.Int32(1)
        turn = 1 - turn
    return skip, turn


@cute.jit
def step_over(k_tiles, read_state, release_state):
    """The other ping-pong warp group's tile: step over its k_tiles stages without waiting (it waits for
    and releases them). Returns (read_state, release_state): rebind both."""
    for k in range(k_tiles):
        read_state.advance()
        release_state.advance()
    return read_state, release_state


@cute.jit
def mma_mainloop(
    tiled_mma, acc, tCrA, tCrB, k_blocks: cutlass.Constexpr, k_tiles, ab_pipe, read_state, release_state,
    first_m_only: cutlass.Constexpr = False, last_k_blocks: cutlass.Constexpr = 0,
):
    """acc += the k_tiles stages' A x B (acc is zeroed by the caller), waiting for each stage and
    releasing it once the next stage's wgmma batch is in flight.
    first_m_only: only the first 64-row MMA block of the tile (ping-pong: the rows past it are all
    padding); the other blocks' accumulators keep the caller's zeros, which is what zero A rows give.
    The first block's wgmmas are the same instructions in the same order: its results keep their bits.
    last_k_blocks (1 .. k_blocks; 0 or k_blocks: all): the last stage runs only its first last_k_blocks
    k-blocks (varlen K: the rows past them are zero padding). That stage is peeled off the loop, so no branch
    stands between the wgmmas; the wgmmas that run are those of the full loop, in the same order.
    Returns (tiled_mma, acc, read_state, release_state): rebind all four (the tracer threads values
    through staged control flow only as plain local variables, not through a helper's updates)."""
    peel = 0 < last_k_blocks < k_blocks
    assert not peel or not first_m_only
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    cute.nvgpu.warpgroup.fence()
    full_tiles = k_tiles
    if cutlass.const_expr(peel):
        full_tiles = k_tiles - 1
    for k in range(full_tiles):
        tiled_mma, acc, read_state, release_state = _mma_stage(
            tiled_mma, acc, tCrA, tCrB, k_blocks, ab_pipe, read_state, release_state, k > 0, first_m_only,
        )
    if cutlass.const_expr(peel):
        tiled_mma, acc, read_state, release_state = _mma_stage(
            tiled_mma, acc, tCrA, tCrB, last_k_blocks, ab_pipe, read_state, release_state, full_tiles > 0,
        )
    cute.nvgpu.warpgroup.wait_group(0)
    ab_pipe.consumer_release(release_state)
    release_state.advance()
    return tiled_mma, acc, read_state, release_state


@cute.jit
def _mma_stage(
    tiled_mma, acc, tCrA, tCrB, blocks: cutlass.Constexpr, ab_pipe, read_state, release_state, release_prev,
    first_m_only: cutlass.Constexpr = False,
):
    """One stage of mma_mainloop: wait for it, issue its first `blocks` k-blocks
    as one wgmma batch, keep that batch in flight and (release_prev) release the stage before it. Returns
    (tiled_mma, acc, read_state, release_state): rebind all four."""
    ab_pipe.consumer_wait(read_state)
    for kb in cutlass.range_constexpr(blocks):
        coord = (None, None, kb, read_state.index)
        if cutlass.const_expr(first_m_only):
            a = tCrA[coord]
            d = _first_m_block(acc)
            cute.gemm(tiled_mma, d, _first_m_block(a), tCrB[coord], d)
        else:
            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(1)
    if release_prev:
        ab_pipe.consumer_release(release_state)
        release_state.advance()
    read_state.advance()
    return tiled_mma, acc, read_state, release_state


def _first_m_block(t):
    """t (V, M[, N]) as (V, 1[, N]): its first MMA block along M (the same storage, the M mode cut to one)."""
    lay = cute.append(cute.select(t.layout, mode=[0]), cute.make_layout(1))
    if cute.rank(t) == 3:
        lay = cute.append(lay, cute.select(t.layout, mode=[2]))
    return cute.make_tensor(t.iterator, lay)


def epilogue_stores(tiled_mma, ctid, sC, acc, c_layout, c_dtype, acc_dtype):
    """Registers -> smem copy of one epilogue sub-tile: (r2s copy, smem destinations, the
    accumulator as r2s source, fp32 staging registers, output-dtype registers, their size)."""
    r2s_atom = sm90_utils.get_smem_store_op(c_layout, c_dtype, acc_dtype)
    c_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), c_dtype)
    r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
    thr_r2s = r2s.get_slice(ctid)
    tRS_sC = thr_r2s.partition_D(sC)
    tRS_acc = r2s.retile(acc)
    rD_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
    rD = cute.make_rmem_tensor(rD_shape, acc_dtype)
    rD_out = cute.make_rmem_tensor(rD_shape, c_dtype)
    return r2s, tRS_sC, tRS_acc, rD, rD_out, cute.size(rD)


@cute.jit
def subtile_to_smem(r2s, tRS_acc, e: cutlass.Constexpr, rD, rD_out, rD_size: cutlass.Constexpr, dst):
    """Epilogue sub-tile e of the accumulator (tRS_acc, as epilogue_stores retiles it) into the smem buffer dst by
    stmatrix, through rD (fp32 staging) and rD_out (the output dtype)."""
    for v in cutlass.range_constexpr(rD_size):
        rD[v] = tRS_acc[e * rD_size + v]
    rD_out.store(rD.load().to(rD_out.element_type))
    cute.copy(r2s, rD_out, dst)


def epilogue_views(gC_t, epi_tile, tma_c, sC):
    """The TMA store views of one output tile gC_t cut into epi_tile sub-tiles: (smem buffers as store
    sources, gmem sub-tiles, sub-tile count, their (rows, columns) shape, the layout numbering them
    columns fastest)."""
    gC_epi = cute.zipped_divide(gC_t, epi_tile)
    bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
        tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
    )
    epi_shape = gC_epi.shape[1]
    epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
    return bSG_sC, bSG_gC, cute.size(gC_epi, mode=[1]), epi_shape, epi_layout


def store_sync(num_consumer_threads, epi_stages, barrier_id=1):
    """(named barrier of the consumer warp groups, TMA store pipeline over epi_stages buffers).
    Ping-pong GEMMs give each warp group its own barrier (barrier_id 1 + its index, a run-time value)."""
    epi_barrier = pipeline.NamedBarrier(barrier_id=barrier_id, num_threads=num_consumer_threads)
    store_pipe = pipeline.PipelineTmaStore.create(
        num_stages=epi_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
    )
    return epi_barrier, store_pipe


@cute.jit
def store_tile_split(
    r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size: cutlass.Constexpr, tma_c, bSG_sC, bSG_gC, epi_layout,
    epi_tiles: cutlass.Constexpr, epi_count, epi_stages: cutlass.Constexpr, epi_barrier, store_pipe, warp_idx,
    buf_base=0, store_warp=4,
):
    """Store one output tile sub-tile by sub-tile through epi_stages rotating smem buffers
    (buf_base.. of sC), waiting for a buffer's previous TMA store before reusing it (the split
    epilogue). Warp store_warp (the first consumer warp of the storing warp group) issues the TMA stores."""
    for e in cutlass.range_constexpr(epi_tiles):
        buf = buf_base + (epi_count + e) % epi_stages
        subtile_to_smem(r2s, tRS_acc, e, rD, rD_out, rD_size, tRS_sC[(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_barrier.arrive_and_wait()
        if warp_idx == store_warp:
            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, epi_layout.get_hier_coord(e))])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        epi_barrier.arrive_and_wait()


@cute.jit
def store_tile_full(
    r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size: cutlass.Constexpr, tma_c, bSG_sC, bSG_gC, epi_layout,
    epi_tiles: cutlass.Constexpr, epi_barrier, warp_idx, buf_base=0, store_warp=4,
):
    """Store one output tile whole: every sub-tile into its own smem buffer (buf_base + e), then the TMA
    stores, left in flight. The wait for them to have read smem comes at the start of the next call
    (the full-tile epilogue: the stores overlap the next tile's mainloop)."""
    if warp_idx == store_warp:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    epi_barrier.arrive_and_wait()
    for e in cutlass.range_constexpr(epi_tiles):
        subtile_to_smem(r2s, tRS_acc, e, rD, rD_out, rD_size, tRS_sC[(None, None, None, buf_base + e)])
    cute.arch.fence_proxy("async.shared", space="cta")
    epi_barrier.arrive_and_wait()
    if warp_idx == store_warp:
        for e in cutlass.range_constexpr(epi_tiles):
            cute.copy(tma_c, bSG_sC[(None, buf_base + e)], bSG_gC[(None, epi_layout.get_hier_coord(e))])
        cute.arch.cp_async_bulk_commit_group()


@cute.jit
def hand_tile_to_helpers(r2s, tRS_acc, tRS_sC, rD, rD_out, rD_size: cutlass.Constexpr, epi_tiles: cutlass.Constexpr,
                         epi_bars, empty_phase):
    """Consumer side of an epilogue done by helper warps: wait until the helpers have sent the previous tile
    (epi_bars[1]), put the output sub-tiles into buffers 0..epi_tiles-1 and hand them over (epi_bars[0], which
    every consumer thread arrives on). Returns the next empty_phase (rebind it; a fresh barrier passes parity 1)."""
    cute.arch.mbarrier_wait(epi_bars + 1, empty_phase)
    for e in cutlass.range_constexpr(epi_tiles):
        subtile_to_smem(r2s, tRS_acc, e, rD, rD_out, rD_size, tRS_sC[(None, None, None, e)])
    cute.arch.fence_proxy("async.shared", space="cta")  # the helpers' TMA stores read these buffers
    cute.arch.mbarrier_arrive(epi_bars)
    return 1 - empty_phase


@cute.jit
def helpers_send_h(tma_h, bSG_sH, bSG_gH, buffers: cutlass.Constexpr, h_row, h_col, helper_bar, epi_bars, htid):
    """The helper warps' tail of a tile once each has written its part of h into smem: the first helper sends
    buffer c to h block (h_row, h_col + c), waits until every store of the tile has read smem and frees the
    consumers' buffers (epi_bars[1])."""
    cute.arch.fence_proxy("async.shared", space="cta")
    helper_bar.arrive_and_wait()
    if htid == 0:
        for c in cutlass.range_constexpr(buffers):
            cute.copy(tma_h, bSG_sH[(None, c)], bSG_gH[(None, (h_row, h_col + c))])
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.mbarrier_arrive(epi_bars + 1)
