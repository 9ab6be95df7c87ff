"""MoKMoELayer(backend="cuda") against backend="reference" on the same GPU: within bf16
rounding, bitwise reproducible, and backend="auto" choosing the kernels on sm_90."""

import pytest
import torch

from mok_nn import MoKMoELayer

from layer_runs import GRAD_NAMES, rel_err as _rel, run_layer as _run

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")


@pytest.mark.parametrize("opts", [
    dict(),
    dict(score_func="sigmoid", n_group=4, topk_group=2, use_expert_bias=True, routed_scaling_factor=2.5,
         shared_intermediate_size=64, shared_expert_gate=True),
    dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True),
])
@pytest.mark.parametrize("T", [1, 777])
def test_cuda_layer_matches_reference_and_repeats(opts, T):
    torch.manual_seed(0)
    H, I, E, K = 256, 128, 16, 4
    ref = MoKMoELayer(H, I, E, K, device="cuda", backend="reference", **opts)
    fused = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda", **opts)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    got = _run(fused, x, dy)
    again = _run(fused, x, dy)
    for a, b in zip(got, again):
        assert torch.equal(a, b), "CUDA path must be bitwise reproducible"
    want = _run(ref, x, dy)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert not torch.isnan(a).any(), name
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


def test_auto_picks_cuda():
    layer = MoKMoELayer(256, 128, 8, 2, device="cuda", backend="auto")
    x = torch.randn(16, 256, device="cuda").to(torch.bfloat16)
    assert layer._choose_backend(x) == "cuda"
