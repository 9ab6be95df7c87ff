"""Weight-gradient kernels: registry entries, selection by rows and columns, shared-memory budget (CPU)."""

import importlib.util

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn.kernels import registry

HAVE_DSL = importlib.util.find_spec("cutlass") is not None


def test_default_variant_is_registered_and_unchanged():
    assert cb.WGRAD_KERNEL in registry.WGRAD_KERNELS
    assert dict(registry.SPECS_BY_NAME[cb.WGRAD_KERNEL].factory_kwargs) == {
        "tile_n": 256, "epi_n": 32, "epi_stages": 8, "lazy_epilogue": True, "cluster_m": 2,
    }  # the measured default
    assert set(registry.WGRAD_KERNELS) == {cb.WGRAD_KERNEL, cb.WGRAD_SHORT_KERNEL}
    assert registry.WGRAD_ACC_KERNELS == {cb.WGRAD_KERNEL: cb.WGRAD_KERNEL + "_acc"}


@pytest.mark.parametrize("tokens,top_k,experts,cols,accumulate,want", [
    (8192, 8, 256, 2048, False, "short"),  # deepseek-v3 d down at EP = 1: 256 rows per expert
    (8192, 8, 256, 7168, False, "default"),  # its d gate_up: 7168 columns
    (8192, 8, 128, 768, False, "default"),  # qwen3 d down: 512 rows per expert
    (8192, 2, 8, 14336, False, "default"),  # mixtral
    (8192, 8, 256, 2048, True, "default"),  # macrobatch passes: the accumulating kernel
    (100, 2, 8, 64, False, "short"),  # few rows per expert, few columns
])
def test_default_wgrad_kernel_by_rows_and_columns(tokens, top_k, experts, cols, accumulate, want):
    g = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    sched = cb.make_schedule_torch(ids, experts)
    got = cb.wgrad_kernel(sched, cols, accumulate)
    assert got == {"short": cb.WGRAD_SHORT_KERNEL, "default": cb.WGRAD_KERNEL}[want]
    assert got in registry.WGRAD_KERNELS
    assert cb.WGRAD_SHORT_KERNEL not in registry.WGRAD_ACC_KERNELS  # why accumulating passes keep the default


@pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("name", registry.WGRAD_KERNELS + tuple(registry.WGRAD_ACC_KERNELS.values()))
def test_shared_memory_budget(name):
    """A/B stages left next to the epilogue buffers: at least 3, and everything fits in 227 KB."""
    from mok_nn.kernels.wgrad_gemm import VarlenKGroupedGemm
    import cutlass

    gemm = VarlenKGroupedGemm(**dict(registry.SPECS_BY_NAME[name].factory_kwargs))
    stages = gemm._stages(cutlass.BFloat16, cutlass.BFloat16)
    bm, bn, bk = gemm.tile_mnk
    # epi_buffers: every epilogue buffer (ping-pong: each warp group's epi_stages)
    used = 1024 + stages * (bm + bn) * bk * 2 + gemm.epi_tile[0] * gemm.epi_tile[1] * 2 * gemm.epi_buffers
    assert stages >= 3 and used <= gemm.smem_bytes
    if gemm.pingpong:  # the whole 128 x 128 tile buffered per warp group
        assert gemm.epi_buffers == 2 * 128 * bn // (gemm.epi_tile[0] * gemm.epi_tile[1]) and stages == 5
    if gemm.lazy_epilogue and gemm.epi_tile[1] * gemm.epi_stages == bn:
        assert stages == (3 if bn == 256 else 6)  # whole tile buffered
