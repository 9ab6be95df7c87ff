"""The packed launch path (loader.KernelLibrary.launch) on the GPU: a layer's forward+backward gives
the same bits as with the ctypes path (launch_ctypes) and as the reference within bf16 rounding;
cuda_backend._stream() is the current stream as torch.cuda.current_stream() names it.

The bytes of the argument blocks are compared for every kernel on the CPU (tests/test_loader_launch.py);
this checks that the kernels read them the same way."""

import pytest
import torch

from mok_nn import MoKMoELayer
from mok_nn import cuda_backend as cb

from layer_runs import GRAD_NAMES, rel_err, run_layer

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")


def test_stream_is_torch_current_stream():
    want = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    assert cb._stream() == want()
    for s in (torch.cuda.Stream(), torch.cuda.Stream(priority=-1)):
        with torch.cuda.stream(s):
            assert cb._stream() == want() == s.cuda_stream
        assert cb._stream() == want() != s.cuda_stream
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                assert cb._stream() == want() == s.cuda_stream


@pytest.mark.parametrize("opts", [dict(), dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True)])
def test_layer_packed_equals_ctypes(opts):
    torch.manual_seed(1)
    H, I, E, K, T = 256, 128, 16, 4, 777
    ref = MoKMoELayer(H, I, E, K, device="cuda", backend="reference", **opts)
    fused = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda", **opts)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    lib = cb._lib()
    assert lib._packed, "MOK_LAUNCH=ctypes is set: this test compares the two paths"
    calls = {"launch": 0, "ctypes": 0}
    launch, launch_ctypes = lib.launch, lib.launch_ctypes

    def counted(*a, **k):
        calls["launch"] += 1
        return launch(*a, **k)

    def counted_ctypes(*a, **k):
        calls["ctypes"] += 1
        return launch_ctypes(*a, **k)

    try:
        lib.launch, lib.launch_ctypes = counted, counted_ctypes  # packed falls back to ctypes only for odd arguments
        packed = run_layer(fused, x, dy)
        assert calls["ctypes"] == 0 and calls["launch"] > 5, ("the packed path fell back to ctypes", calls)
        lib._packed = False
        calls["launch"] = 0
        via_ctypes = run_layer(fused, x, dy)
        assert calls["ctypes"] == calls["launch"], ("every launch through ctypes", calls)
    finally:
        lib._packed = True
        del lib.launch, lib.launch_ctypes
    want = run_layer(ref, x, dy)
    for name, a, b, w in zip(GRAD_NAMES, packed, via_ctypes, want):
        assert torch.equal(a, b), f"{name}: packed and ctypes launches differ"
        assert not torch.isnan(a).any(), name
        assert rel_err(a, w) < 2e-2, (name, rel_err(a, w))
