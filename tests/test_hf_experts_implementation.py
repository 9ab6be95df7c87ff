"""experts_implementation="mok": transformers' registry runs mok_nn's routed experts
under the model's own router. Oracle: transformers' own "grouped_mm" on the same
model (fresh random weights and tokens)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
from _tiny_moe_models import ARCHS, VOCAB, build  # noqa: E402

from mok_nn.integrations import hf_experts, routed  # noqa: E402
import mok_nn.integrations.huggingface  # noqa: E402, F401 (registers "mok")
from mok_nn.layer import BACKENDS as LAYER_BACKENDS  # noqa: E402

BACKENDS = [b for b in LAYER_BACKENDS if b != "cuda"]


def _tokens(seed=1, batch=2, seq=9):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def count_mok_calls(monkeypatch):
    """How many times mok_nn's MoKFunction ran (so a test cannot pass on grouped_mm alone)."""
    calls = []
    original = routed.MoKFunction

    class Counting(original):
        @classmethod
        def apply(cls, *args):
            calls.append(1)
            return original.apply(*args)

    monkeypatch.setattr(routed, "MoKFunction", Counting)
    return calls


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _with(model, impl, backend):
    name = hf_experts.register(f"mok_test_{backend}", backend=backend) if impl == "mok" else impl
    m = copy.deepcopy(model)
    m.set_experts_implementation(name)
    return m


def test_import_registers_mok():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "mok" in ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["mok"].__name__ == "mok_experts_forward_auto"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_matches_grouped_mm(arch, backend, count_mok_calls):
    model = build(arch, seed=3).train()
    ids = _tokens()
    logits_r, loss_r, grads_r = _run(_with(model, "grouped_mm", backend), ids)
    mok = _with(model, "mok", backend)
    logits, loss, grads = _run(mok, ids)
    experts_modules = [m for m in mok.modules() if hasattr(type(m), "_apply_gate")]
    assert experts_modules and len(count_mok_calls) == len(experts_modules)    # every experts module ran mok_nn
    torch.testing.assert_close(logits, logits_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, loss_r, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_r.keys() and any("experts" in n for n in grads)
    for n in grads_r:
        scale = grads_r[n].abs().max().clamp_min(1e-6)
        torch.testing.assert_close(grads[n] / scale, grads_r[n] / scale, rtol=0, atol=2e-5, msg=n)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_within_rounding_of_grouped_mm(arch, backend):
    """bf16: mok_nn's error against the fp32 model is that of grouped_mm in bf16, give or take rounding."""
    model = build(arch, seed=4)
    ids = _tokens(seed=2)
    oracle = _run(_with(model, "grouped_mm", backend).train(), ids)
    low = model.to(torch.bfloat16).train()
    gmm = _run(_with(low, "grouped_mm", backend), ids)
    mok = _run(_with(low, "mok", backend), ids)
    for what, o, g, m in (("logits", oracle[0], gmm[0], mok[0]), ("loss", oracle[1], gmm[1], mok[1])):
        assert _rel(m, o) <= 1.5 * _rel(g, o) + 2e-3, what
    for n in oracle[2]:
        assert _rel(mok[2][n], oracle[2][n]) <= 1.5 * _rel(gmm[2][n], oracle[2][n]) + 2e-2, n


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_bitwise_deterministic(arch):
    model = build(arch, seed=5).train()
    ids = _tokens(seed=3)
    first = _run(_with(model, "mok", BACKENDS[0]), ids)
    second = _run(_with(model, "mok", BACKENDS[0]), ids)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_from_pretrained_and_save_round_trip(arch, tmp_path):
    model = build(arch, seed=6)
    ids = _tokens(seed=4)
    model.save_pretrained(tmp_path / "orig")
    cls = type(model)
    mok = cls.from_pretrained(tmp_path / "orig", experts_implementation="mok").eval()
    assert mok.config._experts_implementation == "mok"
    want = model.state_dict()
    got = mok.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        ref = _with(model, "grouped_mm", "auto")(ids).logits
        logits = mok(ids).logits
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)

    mok.save_pretrained(tmp_path / "again")
    back = cls.from_pretrained(tmp_path / "again", experts_implementation="mok").eval()
    again = back.state_dict()
    assert again.keys() == want.keys() and all(torch.equal(again[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, logits)


def test_switch_back_to_grouped_mm(count_mok_calls):
    model = build("olmoe", seed=7)
    ids = _tokens(seed=5)
    with torch.no_grad():
        ref = model(ids).logits
        model.set_experts_implementation("mok")
        model(ids)
        ran = len(count_mok_calls)
        model.set_experts_implementation("grouped_mm")
        assert torch.equal(model(ids).logits, ref)
    assert ran > 0 and len(count_mok_calls) == ran


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_expert_parallel_local_shard_with_off_rank_routes(arch):
    """transformers' EP calls the experts with this rank's shard, local ids and ids >= num_experts
    (weight 0) for other ranks' experts: mok_nn matches grouped_mm on that contract, gradients too."""
    experts = build(arch, seed=8).model.layers[0].mlp.experts
    shard = copy.deepcopy(experts)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if hasattr(shard, name) and getattr(shard, name) is not None:
                setattr(shard, name, torch.nn.Parameter(getattr(shard, name)[4:].clone()))
    shard.num_experts, shard._is_expert_parallel = 4, True
    g = torch.Generator().manual_seed(9)
    tokens, k, hidden = 12, 2, shard.down_proj.shape[-1] if arch == "gpt_oss" else shard.down_proj.shape[1]
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, 8, (tokens, k), generator=g)          # ids 4..7: "another rank's" (sentinels)
    w = torch.rand(tokens, k, generator=g)
    w = torch.where(ids >= 4, torch.zeros_like(w), w)

    def run(impl):
        m = copy.deepcopy(shard)
        m.config._experts_implementation = impl
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = m(xi, ids, wi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return y, xi.grad, wi.grad, m.gate_up_proj.grad, m.down_proj.grad

    for got, want in zip(run("mok"), run("grouped_mm")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unsupported_experts_raise():
    model = build("mixtral", seed=0, hidden_act="gelu")
    model.set_experts_implementation("mok")
    with pytest.raises(ValueError, match="silu"):
        model(_tokens())


def test_register_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        hf_experts.register("mok_bad", backend="nope")
