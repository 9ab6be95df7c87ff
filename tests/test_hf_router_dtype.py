"""patch_model(router_dtype="model"): a bf16 model's patched blocks compute the original
router logits bitwise and pick the original experts on every token without an exact tie
at the k-th place (there mok_nn takes the lower index; torch.topk promises no order)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")
from _tiny_moe_models import VOCAB, build  # noqa: E402

from mok_nn import router as routing  # noqa: E402
from mok_nn.integrations.huggingface import MoKHFBlock, patch_model  # noqa: E402


def _inputs_and_original_ids(model, ids):
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].reshape(-1, a[0].shape[-1])))
             for n, m in model.named_modules() if hasattr(m, "experts") and not hasattr(m, "gate_up_proj")]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    out = {}
    for name, x in seen.items():
        block = model.get_submodule(name)
        router = getattr(block, "gate", None) or block.router
        with torch.no_grad():
            logits, _, top = router(x)
        out[name] = (x, logits, top)
    return out


def _mok(block: MoKHFBlock, x):
    layer = block.mok
    with torch.no_grad():
        logits = layer.router(x)
        chosen, _, scores = routing.route(logits, layer.top_k, layer.score_func, layer.norm_topk_prob)
    s = scores.sort(dim=-1, descending=True).values
    return logits, chosen, s[:, layer.top_k - 1] == s[:, layer.top_k]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_router_dtype_model_matches_original_routing(arch):
    model = build(arch, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():       # transformers-like router init: small logits, bf16 near ties
        for n, p in model.named_parameters():
            if n.endswith(("gate.weight", "router.weight")) and p.shape[0] > 1:
                p.normal_(0, 0.02)
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))
    original = _inputs_and_original_ids(model, ids)
    exact = patch_model(copy.deepcopy(model), router_dtype="model", backend="reference")
    default = patch_model(copy.deepcopy(model), backend="reference")
    fp32_logits_differ = False
    for name, (x, logits, top) in original.items():
        got_logits, got, tie = _mok(exact.get_submodule(name), x)
        assert torch.equal(got_logits, logits.float()), name
        same = (got.sort(-1).values == top.sort(-1).values).all(-1)
        assert bool((same | tie).all()), f"{name}: {int((~same & ~tie).sum())} untied tokens differ"
        fp32_logits_differ |= not torch.equal(_mok(default.get_submodule(name), x)[0], logits.float())
    assert fp32_logits_differ      # without the option the logits are mok_nn's fp32 ones


def test_router_dtype_keeps_state_dict_and_rejects_bad_values():
    model = build("mixtral", seed=1, dtype=torch.bfloat16)
    want = model.state_dict()
    got = patch_model(copy.deepcopy(model), router_dtype=torch.bfloat16).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="router_dtype"):
        patch_model(copy.deepcopy(model), router_dtype="bf16")
