"""The reference path on a CUDA device: equal to the CPU float64 result within bf16
rounding, and bitwise identical across runs."""

import pytest
import torch

from mok_nn import MoKMoELayer

from layer_runs import GRAD_NAMES, rel_err as _rel, run_layer as _run


@pytest.mark.parametrize("opts", [
    dict(),
    dict(score_func="sigmoid", n_group=4, topk_group=2, use_expert_bias=True, routed_scaling_factor=2.5,
         shared_intermediate_size=64, shared_expert_gate=True),
    dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True, router_bias=True),
])
def test_cuda_reference_matches_cpu_fp64_and_repeats(opts):
    torch.manual_seed(0)
    H, I, E, K, T = 256, 128, 16, 4, 777
    cpu = MoKMoELayer(H, I, E, K, dtype=torch.float64, backend="reference", **opts)
    gpu = MoKMoELayer(H, I, E, K, dtype=torch.bfloat16, device="cuda", backend="reference", **opts)
    gpu.load_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() and "correction" not in k else v
                         for k, v in cpu.state_dict().items()})
    # the oracle sees the same (bf16-rounded) parameters
    cpu.load_state_dict({k: v.double().cpu() if v.is_floating_point() and "correction" not in k else v.cpu()
                         for k, v in gpu.state_dict().items()})
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    got = _run(gpu, x, dy)
    again = _run(gpu, x, dy)
    for a, b in zip(got, again):
        assert torch.equal(a, b), "CUDA reference path must be bitwise reproducible"
    want = _run(cpu, x.double().cpu(), dy.double().cpu())
    # bf16 storage of activations and intermediates: errors of a few bf16 ulps (2^-8) in relative L2
    assert len(got) == len(want)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert _rel(a.cpu(), b) < 2e-2, (name, _rel(a.cpu(), b))
