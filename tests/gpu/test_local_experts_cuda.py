"""The portable backend's local experts on the fused kernels (cuda_local.local_mlp_forward / _backward) on the
GPU: bitwise the one-GPU path on the same rows (top_k = 1) with the real kernels, padding rows holding NaN, bf16
(with and without biases) and MXFP8 (tests/test_cuda_local_experts.py's check)."""

import pytest

import layer_runs

local = layer_runs.load_cpu_test("test_cuda_local_experts")
DEVICE = "cuda"


@pytest.mark.parametrize("bias,precision", [(False, "bf16"), (True, "bf16"), (False, "mxfp8")])
def test_local_mlp_is_the_one_gpu_path_bit_for_bit(bias, precision):
    problem = local.grouped_rows(1, n_valid=700, n_pad=90, bias=bias, device=DEVICE)
    local.check_local_is_the_one_gpu_path(*problem, precision)
