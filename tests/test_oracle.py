"""Checks of the test oracle itself against a dense, vectorised formulation
(every expert on every token, masked by the routing), written differently on
purpose so that a slip in one is unlikely to be repeated in the other."""


import torch

import oracle

T, H, I, E, K = 7, 6, 5, 8, 3


def _params(seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    p = {"router.weight": r(E, H), "experts.gate_up_proj": r(E, 2 * I, H), "experts.down_proj": r(E, H, I)}
    if bias:
        p["experts.gate_up_proj_bias"] = r(E, 2 * I)
        p["experts.down_proj_bias"] = r(E, H)
    return p, r(T, H)


def _dense_experts(p, x, act):
    gu = torch.einsum("eoh,th->teo", p["experts.gate_up_proj"], x)
    if "experts.gate_up_proj_bias" in p:
        gu = gu + p["experts.gate_up_proj_bias"]
    g, u = gu.chunk(2, dim=-1)
    h = act(g, u)
    y = torch.einsum("ehi,tei->teh", p["experts.down_proj"], h)
    if "experts.down_proj_bias" in p:
        y = y + p["experts.down_proj_bias"]
    return y  # [T, E, H]


def test_oracle_softmax_topk_dense():
    p, x = _params(0)
    res = oracle.oracle_forward(x, p, top_k=K, score_func="softmax", norm_topk_prob=True,
                                routed_scaling_factor=1.5)
    probs = torch.softmax(x @ p["router.weight"].T, dim=-1)
    vals, idx = probs.topk(K, dim=-1)
    mask = torch.zeros_like(probs).scatter(1, idx, 1.0)
    w = probs * mask / vals.sum(-1, keepdim=True) * 1.5
    ys = _dense_experts(p, x, lambda g, u: g * torch.sigmoid(g) * u)
    expected = (w[:, :, None] * ys).sum(1)
    torch.testing.assert_close(res.y, expected, rtol=1e-12, atol=1e-12)
    assert [sorted(i) for i in res.topk_ids] == [sorted(i) for i in idx.tolist()]


def test_oracle_oai_clamp_biases_dense():
    p, x = _params(1, bias=True)
    L = 1.3
    res = oracle.oracle_forward(x, p, top_k=E, score_func="sigmoid", norm_topk_prob=False,
                                activation="swiglu_oai", swiglu_limit=L)

    def act(g, u):
        g = g.clamp(max=L)
        u = u.clamp(-L, L)
        return (u + 1) * g / (1 + torch.exp(-1.702 * g))

    w = torch.sigmoid(x @ p["router.weight"].T)
    expected = (w[:, :, None] * _dense_experts(p, x, act)).sum(1)
    torch.testing.assert_close(res.y, expected, rtol=1e-12, atol=1e-12)


def test_oracle_group_limited_by_hand():
    # 8 experts in 4 groups of 2. Sigmoid scores:
    #   0.881 0.269 | 0.622 0.599 | 0.731 0.731 | 0.047 0.953
    logits = torch.tensor([2.0, -1.0, 0.5, 0.4, 1.0, 1.0, -3.0, 3.0], dtype=torch.float64)
    s = torch.sigmoid(logits)
    # Unbiased group scores (sum of the top 2): 1.150 1.221 1.462 1.000 -> groups 2, 1;
    # best two of experts 2..5: 4 and 5 (tied scores, both taken).
    ids, w, _ = oracle.route_token(logits, 2, "sigmoid", False, 4, 2, 1.0, None)
    assert sorted(ids) == [4, 5]
    # Bias +0.3 on group 3: biased group scores 1.150 1.221 1.462 1.600 -> groups 3, 2;
    # biased candidates 0.731 0.731 0.347 1.253 -> 7, then the tie 4 / 5 goes to 4.
    bias = torch.tensor([0.0] * 6 + [0.3, 0.3], dtype=torch.float64)
    ids, w, _ = oracle.route_token(logits, 2, "sigmoid", False, 4, 2, 1.0, bias)
    assert ids == [7, 4]
    assert torch.equal(w, s[[7, 4]])  # unbiased weights
    # With the max-of-group score instead, groups 3 and 0 win -> experts 7 and 0.
    ids, _, _ = oracle.route_token(logits, 2, "sigmoid", False, 4, 2, 1.0, bias, group_score="max")
    assert ids == [7, 0]
