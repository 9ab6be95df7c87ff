"""Layouts shared by the grouped GEMM kernels (grouped_gemm.py, wgrad_gemm.py).

The A/B stages that fit in shared memory beside the epilogue buffers, the tiled MMA
and the shared-memory layouts of a tile shape (built on the host side of a launch),
and the views every kernel starts from: its shared-memory buffers as tensors and the
global tensors cut into tiles. Plain helpers, traced inline.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils


def stage_count(smem_bytes, tile_mnk, ab_dtype, c_dtype, epi_tile, epi_buffers) -> int:
    """A/B stages of a (bm, bn, bk) tile that fit in smem_bytes beside epi_buffers epilogue buffers of epi_tile
    (1 KB kept for the barriers)."""
    bm, bn, bk = tile_mnk
    ab_bytes = (bm * bk + bn * bk) * ab_dtype.width // 8
    epi_bytes = epi_tile[0] * epi_tile[1] * c_dtype.width // 8 * epi_buffers
    return (smem_bytes - 1024 - epi_bytes) // ab_bytes


def mma_and_smem_layouts(gemm, ab_stages):
    """(tiled_mma, a_smem, b_smem, c_smem) of a GEMM object (its ab_dtype, acc_dtype, c_dtype, the operands'
    layouts, tile_mnk, mma_atom_layout, epi_tile, epi_buffers): bf16 wgmma of 64-row atoms, A and B in rings of
    ab_stages, the epilogue's epi_buffers buffers."""
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        gemm.ab_dtype,
        gemm.ab_dtype,
        gemm.a_layout.sm90_mma_major_mode(),
        gemm.b_layout.sm90_mma_major_mode(),
        gemm.acc_dtype,
        gemm.mma_atom_layout,
        tiler_mn=(64, gemm.tile_mnk[1]),
    )
    a_smem = sm90_utils.make_smem_layout_a(gemm.a_layout, gemm.tile_mnk, gemm.ab_dtype, ab_stages)
    b_smem = sm90_utils.make_smem_layout_b(gemm.b_layout, gemm.tile_mnk, gemm.ab_dtype, ab_stages)
    c_smem = sm90_utils.make_smem_layout_epi(gemm.c_dtype, gemm.c_layout, gemm.epi_tile, gemm.epi_buffers)
    return tiled_mma, a_smem, b_smem, c_smem


def smem_tensors(storage, a_smem, b_smem, c_smem):
    """(sA, sB, sC): the A and B rings and the epilogue buffers of smem_storage's struct as tensors."""
    sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
    sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
    sC = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)
    return sA, sB, sC


def tile_views(mA, mB, mC, tile_mnk):
    """(gA, gB, gC): A (bM, bK, tilesM, tilesK, L), B (bN, bK, tilesN, tilesK, L) and C (bM, bN, tilesM, tilesN, L)
    cut into tile_mnk tiles."""
    gA = cute.local_tile(mA, cute.slice_(tile_mnk, (None, 0, None)), (None, None, None))
    gB = cute.local_tile(mB, cute.slice_(tile_mnk, (0, None, None)), (None, None, None))
    gC = cute.local_tile(mC, cute.slice_(tile_mnk, (None, None, 0)), (None, None, None))
    return gA, gB, gC
