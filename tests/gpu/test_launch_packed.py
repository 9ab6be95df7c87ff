"""The packed launch path (loader.KernelLibrary.launch) on the GPU: a layer's forward+backward gives
the same bits as with every launch through launch_ctypes (one ctypes object per argument, its oracle), and
is within bf16 rounding of the reference; cuda_backend._stream() is the current stream as
torch.cuda.current_stream() names it.

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
def test_layer_packed_equals_ctypes(opts, monkeypatch):
    torch.manual_seed(1)
    H, I, E, K, T = 256, 128, 16, 4, 777
    ref = MoKMoELayer(H, I, E, K, device="cuda", backend="reference", **opts)
    fused = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda", **opts)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    lib = cb._lib()
    calls = {"launch": [], "ctypes": []}
    launch, launch_ctypes = lib.launch, lib.launch_ctypes

    def counted(name, *a, **k):
        calls["launch"].append(name)
        return launch(name, *a, **k)

    def counted_ctypes(name, *a, **k):
        calls["ctypes"].append(name)
        return launch_ctypes(name, *a, **k)

    # the packed path falls back to ctypes only for odd arguments: a layer has none
    monkeypatch.setattr(lib, "launch_ctypes", counted_ctypes)
    monkeypatch.setattr(lib, "launch", counted)
    packed = run_layer(fused, x, dy)
    assert calls["ctypes"] == [] and len(calls["launch"]) > 5, ("the packed path fell back to ctypes", calls)
    kernels = list(calls["launch"])
    # every launch through launch_ctypes
    calls["launch"].clear()
    monkeypatch.setattr(lib, "launch", counted_ctypes)
    via_ctypes = run_layer(fused, x, dy)
    assert calls["ctypes"] == kernels, ("the same kernels, each through ctypes", calls)
    monkeypatch.undo()
    want = run_layer(ref, x, dy)
    for name, a, b, w in zip(GRAD_NAMES, packed, via_ctypes, want):
        assert torch.equal(a, b), f"{name}: packed and ctypes launches differ"
        assert not torch.isnan(a).any(), name
        assert rel_err(a, w) < 2e-2, (name, rel_err(a, w))
