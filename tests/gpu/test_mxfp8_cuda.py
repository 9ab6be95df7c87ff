"""MXFP8 on a CUDA device: quantisation byte-identical to the CPU, the mxfp8 layer close to
the CPU and bitwise repeatable."""

import pytest
import torch

from mok_nn import MoKMoELayer
from mok_nn.mxfp8 import dequantize, quantize

from layer_runs import rel_err as _rel


def _cases():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(64, 256, generator=g) * torch.exp2(torch.rand(64, 256, generator=g) * 60 - 30)
    edge = torch.stack([
        torch.zeros(256), torch.full((256,), 2.0**-149), torch.linspace(-1, 1, 256) * 3e38,
        torch.linspace(-1, 1, 256) * 448 * 2.0**-127, torch.full((256,), 1.75 * 2.0**20),
    ])
    edge[1, 7], edge[2, 40], edge[3, 100] = float("nan"), float("inf"), float("-inf")
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    return [wide, edge, wide.bfloat16(), wide.clamp(-6e4, 6e4).half(), bits]


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("axis", [-1, -2])
def test_quantize_cuda_equals_cpu(mode, axis):
    for x in _cases():
        if x.shape[axis] % 32:
            continue
        c, d = quantize(x, axis=axis, scale_mode=mode), quantize(x.cuda(), axis=axis, scale_mode=mode)
        assert torch.equal(c.scale, d.scale.cpu())
        assert torch.equal(c.data.view(torch.uint8), d.data.view(torch.uint8).cpu())
        torch.testing.assert_close(dequantize(d, torch.float32).cpu(), dequantize(c, torch.float32),
                                   rtol=0, atol=0, equal_nan=True)


def test_mxfp8_layer_cuda_matches_cpu_and_repeats():
    torch.manual_seed(0)
    H, I, E, K, T = 256, 128, 16, 4, 777

    def run(device):
        torch.manual_seed(0)
        # initialised on the CPU generator for both devices, then moved: the same parameters
        layer = MoKMoELayer(H, I, E, K, precision="mxfp8", dtype=torch.float32, backend="reference").to(device)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(T, H, generator=g).to(device).requires_grad_(True)
        dy = torch.randn(T, H, generator=g).to(device)
        y = layer(x)
        y.backward(dy)
        return [t.detach().cpu() for t in (y, x.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad,
                                           layer.router.weight.grad)]

    cpu, gpu, gpu2 = run("cpu"), run("cuda"), run("cuda")
    for a, b, c in zip(gpu, gpu2, cpu):
        assert torch.equal(a, b)
        # fp32 GEMMs round differently on the two devices; a value that lands on an FP8
        # rounding boundary can flip one E4M3 ulp, so allow a little more than fp32 rounding
        assert _rel(a, c) < 1e-3
