"""mok_nn.integrations.torchtitan against torchtitan's own MoE module (CPU, bf16 experts)."""

import copy

import pytest
import torch

moe = pytest.importorskip("torchtitan.models.common.moe")
from torchtitan.models.common.feed_forward import FeedForward  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from mok_nn.integrations import torchtitan as tt  # noqa: E402
from mok_nn.layer import BACKENDS as LAYER_BACKENDS  # noqa: E402

BACKENDS = [b for b in LAYER_BACKENDS if b != "cuda"]
DIM, HIDDEN, E = 32, 16, 8


def build_moe(seed=0, top_k=2, score_func="softmax", route_norm=True, groups=None, shared=True, balance=1e-3):
    lin = lambda i, o: Linear.Config(in_features=i, out_features=o)  # noqa: E731
    cfg = moe.MoE.Config(
        num_experts=E,
        routed_experts=moe.RoutedExperts.Config(
            inner_experts=moe.GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=top_k)),
        router=moe.TokenChoiceTopKRouter.Config(
            num_experts=E, gate=lin(DIM, E), top_k=top_k, score_func=score_func, route_norm=route_norm,
            num_expert_groups=groups[0] if groups else None, num_limited_groups=groups[1] if groups else None),
        load_balance_coeff=balance,
        shared_experts=FeedForward.Config(w1=lin(DIM, 24), w2=lin(24, DIM), w3=lin(DIM, 24)) if shared else None)
    torch.manual_seed(seed)
    m = cfg.build()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5 if p.dim() == 2 and p.shape[0] == E else 1 / p.shape[-1] ** 0.5)
        if m.expert_bias_E is not None:
            m.expert_bias_E.copy_(torch.rand(E) * 0.2)
    return m


def _run(m, x):
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = m(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


CASES = {
    "softmax": dict(),
    "sigmoid_groups_bias": dict(score_func="sigmoid", route_norm=False, groups=(4, 2), top_k=3),
    "no_shared_no_balance": dict(shared=False, balance=None),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torchtitan_moe(case, backend):
    ref = build_moe(seed=1, **CASES[case]).train()
    mok = tt.swap_moe(copy.deepcopy(ref), backend=backend)
    assert tt.is_swapped(mok.routed_experts)
    x = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(2))
    y_r, dx_r, g_r = _run(ref, x)
    y, dx, g = _run(mok, x)
    # both run the expert GEMMs in bf16 (torchtitan also adds the k outputs in bf16)
    assert _rel(y, y_r) < 1e-2 and _rel(dx, dx_r) < 2e-2
    assert g.keys() == g_r.keys() and any("inner_experts" in n for n in g)
    for n in g_r:
        assert _rel(g[n], g_r[n]) < 3e-2, n
    # load-balancing state: the same token counts (the router and MoE.forward are torchtitan's)
    assert torch.equal(mok.tokens_per_expert_E, ref.tokens_per_expert_E) and ref.tokens_per_expert_E.sum() > 0


def test_state_dict_unchanged_and_loads_torchtitan_checkpoints():
    ref = build_moe(seed=3)
    mok = tt.swap_moe(copy.deepcopy(ref))
    want = ref.state_dict()
    got = mok.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    other = build_moe(seed=4)
    mok.load_state_dict(other.state_dict())
    x = torch.randn(1, 5, DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert _rel(mok(x), other(x)) < 1e-2


def test_bitwise_deterministic():
    ref = build_moe(seed=6, **CASES["sigmoid_groups_bias"]).train()
    x = torch.randn(3, 11, DIM, generator=torch.Generator().manual_seed(7))
    a = _run(tt.swap_moe(copy.deepcopy(ref)), x)
    b = _run(tt.swap_moe(copy.deepcopy(ref)), x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_expert_parallel_dispatcher_is_refused():
    m = build_moe(seed=8)

    class AllToAllTokenDispatcher(LocalTokenDispatcher):
        pass

    m.routed_experts.token_dispatcher.__class__ = AllToAllTokenDispatcher
    with pytest.raises(tt.SwapError, match="AllToAllTokenDispatcher"):
        tt.swap_moe(m)
    with pytest.raises(tt.SwapError, match="no torchtitan MoE"):
        tt.swap_moe(torch.nn.Linear(2, 2))
