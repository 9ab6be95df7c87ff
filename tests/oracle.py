"""Independent float64 oracle of the MoKMoELayer function, for tests only.

Written from the function the project specifies (README "Usage"), deliberately loop-based (one token,
one routed slot at a time) so that it is obviously correct. It does not import
mok_nn. It is differentiable with ordinary autograd, so gradients of the layer
are checked against autograd through this code.

Parameters come as a dict keyed by the layer's state-dict names:
  router.weight [E, H], router.bias [E] (optional, on the logits),
  router.e_score_correction_bias [E] (optional, selection only),
  experts.gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up),
  experts.down_proj [E, H, I], experts.gate_up_proj_bias [E, 2I] (optional),
  experts.down_proj_bias [E, H] (optional),
  shared_expert.{gate,up,down}_proj.weight (+ .bias if present, optional),
  shared_expert_gate.weight [1, H] (+ .bias if present, optional).
"""

from dataclasses import dataclass

import torch

OAI_ALPHA = 1.702
OAI_DEFAULT_LIMIT = 7.0


@dataclass
class OracleResult:
    y: torch.Tensor             # [..., H] float64
    logits: torch.Tensor        # [T, E] float64
    topk_ids: list              # T lists of k expert ids, best first
    topk_weights: torch.Tensor  # [T, k] float64, same order as topk_ids
    margin: float               # smallest selection gap (see route_token)


def _order_desc(values, candidates):
    """Candidates sorted by descending value, ties to the lower index."""
    return sorted(candidates, key=lambda i: (-values[i], i))


def route_token(logits_t, top_k, score_func="softmax", norm_topk_prob=True,
                n_group=None, topk_group=None, routed_scaling_factor=1.0,
                bias=None, group_score="top2_sum"):
    """Routing of one token: returns (ids, weights, margin).

    margin is the smallest gap between a selected and a rejected candidate
    (experts, and groups when group-limited); tests require it to be well
    above rounding so that every precision selects the same experts.
    """
    if score_func == "softmax":
        scores = torch.softmax(logits_t, dim=-1)
    elif score_func == "sigmoid":
        scores = torch.sigmoid(logits_t)
    else:
        raise ValueError(score_func)
    E = scores.shape[0]
    sel = scores.detach().clone()
    if bias is not None:
        sel = sel + bias.detach().to(sel.dtype)  # selection only
    sel = sel.tolist()

    margins = []
    allowed = list(range(E))
    if n_group is not None:
        per = E // n_group
        gscores = []
        for g in range(n_group):
            members = sorted((sel[e] for e in range(g * per, (g + 1) * per)), reverse=True)
            if group_score == "top2_sum":
                gscores.append(sum(members[:2]))
            elif group_score == "max":
                gscores.append(members[0])
            else:
                raise ValueError(group_score)
        gorder = _order_desc(gscores, range(n_group))
        if topk_group < n_group:
            margins.append(gscores[gorder[topk_group - 1]] - gscores[gorder[topk_group]])
        groups = gorder[:topk_group]
        allowed = [e for e in range(E) if e // per in groups]

    order = _order_desc(sel, allowed)
    ids = order[:top_k]
    if len(order) > top_k:
        margins.append(sel[order[top_k - 1]] - sel[order[top_k]])

    w = torch.stack([scores[e] for e in ids])  # unbiased scores
    if norm_topk_prob:
        w = w / w.sum()
    w = w * routed_scaling_factor
    return ids, w, (min(margins) if margins else float("inf"))


def activation(g, u, kind="swiglu", limit=None):
    """act(gate, up) as specified for the three variants."""
    if kind == "swiglu":
        if limit is not None:
            g = torch.clamp(g, max=limit)
            u = torch.clamp(u, min=-limit, max=limit)
        return torch.nn.functional.silu(g) * u
    if kind == "swiglu_oai":
        L = OAI_DEFAULT_LIMIT if limit is None else limit
        g = torch.clamp(g, max=L)
        u = torch.clamp(u, min=-L, max=L)
        return (u + 1) * g * torch.sigmoid(OAI_ALPHA * g)
    raise ValueError(kind)


def expert_mlp(p, e, x_t, kind, limit):
    """y = down_proj[e] @ act(gate_up_proj[e] @ x_t + b) + b for one slot."""
    gu = p["experts.gate_up_proj"][e] @ x_t
    if "experts.gate_up_proj_bias" in p:
        gu = gu + p["experts.gate_up_proj_bias"][e]
    inter = gu.shape[0] // 2
    h = activation(gu[:inter], gu[inter:], kind, limit)
    y = p["experts.down_proj"][e] @ h
    if "experts.down_proj_bias" in p:
        y = y + p["experts.down_proj_bias"][e]
    return y


def _linear(p, name, v):
    out = p[name + ".weight"] @ v
    if name + ".bias" in p:
        out = out + p[name + ".bias"]
    return out


def shared_expert(p, x_t):
    """Shared expert (SwiGLU MLP) with its optional sigmoid gate; None if absent."""
    if "shared_expert.gate_proj.weight" not in p:
        return None
    h = torch.nn.functional.silu(_linear(p, "shared_expert.gate_proj", x_t)) \
        * _linear(p, "shared_expert.up_proj", x_t)
    out = _linear(p, "shared_expert.down_proj", h)
    if "shared_expert_gate.weight" in p:
        out = out * torch.sigmoid(_linear(p, "shared_expert_gate", x_t))[0]
    return out


def oracle_forward(x, p, *, top_k, score_func="softmax", norm_topk_prob=True,
                   n_group=None, topk_group=None, routed_scaling_factor=1.0,
                   activation="swiglu", swiglu_limit=None, group_score="top2_sum",
                   use_expert_bias=True):
    """The layer function on x [..., H]; every tensor should be float64.

    use_expert_bias=False ignores a router.e_score_correction_bias in p (to
    check that the bias actually changes the routing of a test input).
    """
    H = x.shape[-1]
    xs = x.reshape(-1, H)
    bias = p.get("router.e_score_correction_bias") if use_expert_bias else None
    ys, logits_all, ids_all, w_all, margin = [], [], [], [], float("inf")
    for t in range(xs.shape[0]):
        x_t = xs[t]
        logits_t = p["router.weight"] @ x_t
        if "router.bias" in p:  # GPT-OSS router bias (on the logits, unlike the selection bias)
            logits_t = logits_t + p["router.bias"]
        ids, w, m = route_token(logits_t, top_k, score_func, norm_topk_prob, n_group,
                                topk_group, routed_scaling_factor, bias, group_score)
        margin = min(margin, m)
        y_t = shared_expert(p, x_t)
        if y_t is None:
            y_t = torch.zeros_like(x_t)
        for j, e in enumerate(ids):
            y_t = y_t + w[j] * expert_mlp(p, e, x_t, activation, swiglu_limit)
        ys.append(y_t)
        logits_all.append(logits_t)
        ids_all.append(ids)
        w_all.append(w)
    E = p["router.weight"].shape[0]
    if xs.shape[0] == 0:
        y = xs.new_zeros(0, H)
        return OracleResult(y.reshape(x.shape), xs.new_zeros(0, E), [], xs.new_zeros(0, top_k), margin)
    return OracleResult(torch.stack(ys).reshape(x.shape), torch.stack(logits_all), ids_all,
                        torch.stack(w_all), margin)


def switch_aux_loss(logits, topk_ids, num_experts, coef, score_func="softmax"):
    """Switch load-balancing loss coef * E * sum_e f_e * P_e.

    f_e: fraction of routed (t, j) assignments that go to e (not differentiable);
    P_e: mean over tokens of the router probability of e: the softmax, or the
    sigmoid scores normalised per token to sum to 1.
    """
    T = logits.shape[0]
    k = len(topk_ids[0])
    counts = [0] * num_experts
    for ids in topk_ids:
        for e in ids:
            counts[e] += 1
    if score_func == "softmax":
        probs = torch.softmax(logits, dim=-1)
    else:
        s = torch.sigmoid(logits)
        probs = s / s.sum(dim=-1, keepdim=True)
    loss = logits.new_zeros(())
    for e in range(num_experts):
        f_e = counts[e] / (T * k)
        P_e = probs[:, e].sum() / T
        loss = loss + f_e * P_e
    return coef * num_experts * loss


def z_loss(logits, coef):
    """Router z-loss coef * mean_t logsumexp(logits_t)^2."""
    return coef * (torch.logsumexp(logits, dim=-1) ** 2).mean()
