"""Pure-PyTorch deterministic implementation of the routed experts.

This is the oracle of every kernel test and the CPU path. It computes, with
explicit formulas (no autograd), the function the fused kernels compute (the
same formulas; the order of some fp32 sums differs, e.g. the CUDA combine adds
the k slots in a fixed tree over expert groups, kernels/combine.py, so the two
agree within rounding, not bitwise):

forward, for each routed slot s = t*k + j with expert e = topk_ids[t, j]:
    gu_s   = W13[e] @ x_t (+ b13[e])            fp32 accumulate, stored in x.dtype
    h_s    = act(gu_s)                          fp32 math, stored in x.dtype
    slot_s = W2[e] @ h_s (+ b2[e])              fp32 accumulate, stored in x.dtype
    y_t    = sum_{j=0..k-1} w_tj * slot_{t*k+j}  fp32, fixed order, cast to x.dtype

backward, given dy:
    dh'_s  = W2[e]^T @ dy_t                      (dy not yet scaled by w)
    dw_tj  = <dh'_s, h_s> (+ <dy_t, b2[e]>)      the top-k weight gradient
    dgu_s  = act'(gu_s) * (w_tj * dh'_s)         stored in x.dtype
    dx_t   = sum_j W13[e]^T @ dgu_s              fixed order over j
    dW2[e] = sum_s dy_t (w_tj h_s)^T,  db2[e] = sum_s w_tj dy_t
    dW13[e]= sum_s dgu_s x_t^T,        db13[e]= sum_s dgu_s

Rows are grouped by expert with a stable sort of the flat expert ids, so the
row order inside an expert (and therefore every reduction order) is a pure
function of the routing. Every slot is written exactly once; no index_add_.

precision="mxfp8": every operand of the six expert GEMMs above is rounded by
MXFP8 fake quantisation (mxfp8.operand_quantizer) along that GEMM's reduction
dimension before the same fp32 math; see docs/mxfp8.md for the exact list.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch

from . import distributed
from .mxfp8 import operand_quantizer

ACTIVATIONS = ("swiglu", "swiglu_oai")
OAI_ALPHA = 1.702


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype: fp32 for 16-bit storage, the storage dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------
# activation and its derivative


def _clamp_masks(gate, up, limit):
    if limit is None:
        return gate, up, None, None
    gate_ok = gate <= limit
    up_ok = (up >= -limit) & (up <= limit)
    return gate.clamp(max=limit), up.clamp(-limit, limit), gate_ok, up_ok


def activation_forward(gate_up: torch.Tensor, activation: str, swiglu_limit: float | None) -> torch.Tensor:
    """act([gate | up]) -> [..., I], computed in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up, _, _ = _clamp_masks(gate, up, swiglu_limit)
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swiglu_oai":
        return (up + 1) * gate * torch.sigmoid(OAI_ALPHA * gate)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def activation_backward(
    gate_up: torch.Tensor, grad_h: torch.Tensor, activation: str, swiglu_limit: float | None
) -> torch.Tensor:
    """d act / d [gate | up] applied to grad_h; same dtype as gate_up."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up, gate_ok, up_ok = _clamp_masks(gate, up, swiglu_limit)
    if activation == "swiglu":
        sig = torch.sigmoid(gate)
        act_gate = gate * sig
        d_act_gate = sig * (1 + gate * (1 - sig))
        d_gate = grad_h * up * d_act_gate
        d_up = grad_h * act_gate
    elif activation == "swiglu_oai":
        sig = torch.sigmoid(OAI_ALPHA * gate)
        glu = gate * sig
        d_glu = sig * (1 + OAI_ALPHA * gate * (1 - sig))
        d_gate = grad_h * (up + 1) * d_glu
        d_up = grad_h * glu
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_ok is not None:
        d_gate = d_gate * gate_ok
        d_up = d_up * up_ok
    return torch.cat([d_gate, d_up], dim=-1)


# --------------------------------------------------------------------------
# grouping of routed rows by expert


@dataclass
class ExpertGrouping:
    """Rows grouped by expert: rows[order] is sorted by expert, stably.

    order:  [N] int64 permutation; position p holds the input row order[p].
    counts: rows per expert, a host list (the reference path may synchronise).
    """

    order: torch.Tensor
    counts: list[int]


def expert_segments(counts: list[int]):
    """(expert, slice of its rows) for every expert with rows, in expert order."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
        start += count


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertGrouping:
    flat = expert_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist() if flat.numel() else [0] * num_experts
    return ExpertGrouping(order=order, counts=counts)


# --------------------------------------------------------------------------
# the expert MLP on rows already grouped by expert


def grouped_mlp_forward(rows, counts, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
                        precision="bf16"):
    """rows [N, H] grouped by expert (counts[e] rows each) -> (out [N, H], gate_up [N, 2I]).

    Both results are in rows.dtype; gate_up is what backward needs.
    """
    cdt = compute_dtype(rows.dtype)
    q = operand_quantizer(precision)
    num_rows, inter2 = rows.shape[0], gate_up_proj.shape[1]
    out = rows.new_empty(num_rows, down_proj.shape[1])
    gate_up = rows.new_empty(num_rows, inter2)
    for e, seg in expert_segments(counts):
        gu = q(rows[seg].to(cdt), -1) @ q(gate_up_proj[e].to(cdt), -1).T
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].to(cdt)
        gu = gu.to(rows.dtype)
        gate_up[seg] = gu
        h = activation_forward(gu.to(cdt), activation, swiglu_limit).to(rows.dtype)
        o = q(h.to(cdt), -1) @ q(down_proj[e].to(cdt), -1).T
        if down_bias is not None:
            o = o + down_bias[e].to(cdt)
        out[seg] = o.to(rows.dtype)
    return out, gate_up


@dataclass
class GroupedMLPGrads:
    grad_rows: torch.Tensor | None  # [N, H] d loss / d input row (None on the CUDA path: summed into dx, freed)
    grad_weights: torch.Tensor  # [N], d loss / d top-k weight of each row (row_weights.dtype)
    gate_up_proj: torch.Tensor | None  # None where not needed (frozen experts: param_grads_needed)
    down_proj: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None


def param_grads_needed(needs) -> tuple[bool, bool, bool, bool]:
    """(gate_up_proj, down_proj, gate_up_bias, down_bias): which parameter gradients a backward computes; needs
    None means all (the backends' default). A frozen tensor's gradient is None and its GEMM / sum is skipped."""
    return (True, True, True, True) if needs is None else tuple(bool(n) for n in needs)


def add_param_grads(total: GroupedMLPGrads, g: GroupedMLPGrads, weights: bool = True) -> GroupedMLPGrads:
    """total's parameter gradients += g's, in place and in their dtype (one rounding per add); the macrobatch
    passes of one backward sum their gradients this way, in pass order. weights=False: the biases only (the
    CUDA path adds the weight gradients in its kernel). Returns total's parameter gradients with g's row
    gradients."""
    names = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias") if weights else ("gate_up_bias", "down_bias")
    for name in names:
        t, d = getattr(total, name), getattr(g, name)
        if t is not None:
            t.add_(d.to(t.dtype))
    return dataclasses.replace(total, grad_rows=g.grad_rows, grad_weights=g.grad_weights)


def grouped_mlp_backward(
    rows, grad_out, row_weights, gate_up, counts, gate_up_proj, down_proj, gate_up_bias, down_bias,
    activation, swiglu_limit, precision="bf16", needs=None,
) -> GroupedMLPGrads:
    """Backward of w * MLP(rows) on rows grouped by expert.

    grad_out [N, H]: d loss / d y of each row's token (not yet scaled by w).
    row_weights [N]: the top-k weight of each row.
    needs: the parameter gradients to compute (param_grads_needed); the others are None.
    """
    need13, need2, need_b13, need_b2 = param_grads_needed(needs)
    cdt = compute_dtype(rows.dtype)
    q = operand_quantizer(precision)  # axis 0 of a [rows, ...] operand: this expert's rows, padded to 32
    wdt = gate_up_proj.dtype
    num_rows = rows.shape[0]
    grad_rows = rows.new_empty(rows.shape)
    grad_w = torch.empty(num_rows, dtype=row_weights.dtype, device=rows.device)
    d_gate_up_proj = torch.zeros_like(gate_up_proj) if need13 else None
    d_down_proj = torch.zeros_like(down_proj) if need2 else None
    d_gate_up_bias = None if gate_up_bias is None or not need_b13 else torch.zeros_like(gate_up_bias)
    d_down_bias = None if down_bias is None or not need_b2 else torch.zeros_like(down_bias)
    for e, seg in expert_segments(counts):
        x_e = rows[seg].to(cdt)
        dy_e = grad_out[seg].to(cdt)
        w_e = row_weights[seg].to(cdt).unsqueeze(1)
        gu = gate_up[seg].to(cdt)
        h = activation_forward(gu, activation, swiglu_limit).to(rows.dtype).to(cdt)
        dh_raw = q(dy_e, -1) @ q(down_proj[e].to(cdt), 0)
        dw = (dh_raw * h).sum(dim=1)
        if down_bias is not None:
            dw = dw + dy_e @ down_bias[e].to(cdt)
        if d_down_bias is not None:
            d_down_bias[e] = (w_e * dy_e).sum(dim=0).to(wdt)
        grad_w[seg] = dw.to(grad_w.dtype)
        if d_down_proj is not None:
            d_down_proj[e] = (q(dy_e, 0).T @ q(w_e * h, 0)).to(wdt)
        dgu = activation_backward(gu, w_e * dh_raw, activation, swiglu_limit).to(rows.dtype).to(cdt)
        if d_gate_up_proj is not None:
            d_gate_up_proj[e] = (q(dgu, 0).T @ q(x_e, 0)).to(wdt)
        if d_gate_up_bias is not None:
            d_gate_up_bias[e] = dgu.sum(dim=0).to(wdt)
        grad_rows[seg] = (q(dgu, -1) @ q(gate_up_proj[e].to(cdt), 0)).to(rows.dtype)
    return GroupedMLPGrads(grad_rows, grad_w, d_gate_up_proj, d_down_proj, d_gate_up_bias, d_down_bias)


# --------------------------------------------------------------------------
# combine: fixed-order weighted sum over the k slots of each token


def combine_slots(slots: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y_t = sum_j w_tj * slots[t, j] in fp32 (or wider), j = 0..k-1 in order."""
    cdt = compute_dtype(slots.dtype)
    acc = torch.zeros(slots.shape[0], slots.shape[2], dtype=cdt, device=slots.device)
    for j in range(slots.shape[1]):
        acc = acc + topk_weights[:, j : j + 1].to(cdt) * slots[:, j].to(cdt)
    return acc.to(out_dtype)


def sum_slots(slots: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dx_t = sum_j slots[t, j], j = 0..k-1 in order, in fp32 (or wider)."""
    cdt = compute_dtype(slots.dtype)
    acc = torch.zeros(slots.shape[0], slots.shape[2], dtype=cdt, device=slots.device)
    for j in range(slots.shape[1]):
        acc = acc + slots[:, j].to(cdt)
    return acc.to(out_dtype)


# --------------------------------------------------------------------------
# dispatch to the experts' ranks and the routed experts


@dataclass
class DispatchPlan:
    """Where each routed slot goes and where it lands on the expert rank.

    With a group of size P, rank r holds experts [r*E/P, (r+1)*E/P); tokens
    stay on their rank. Each slot (t, j) travels to its expert's rank, which
    computes the unweighted expert output and sends it back into the source
    slot [t*k + j]; the source sums the k slots in fixed order with its top-k
    weights. Received rows are concatenated by source rank (each block sorted
    by expert) and regrouped by local expert with a stable sort, so every
    reduction order is fixed and the outputs do not depend on P.

    order: [T*k] slot ids sorted by global expert (stable): the send order.
    send_splits / recv_splits: rows per peer rank.
    local: grouping of the received rows by local expert.
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    local: ExpertGrouping
    group: object

    def dispatch(self, rows_in_send_order: torch.Tensor) -> torch.Tensor:
        """Send rows to their expert ranks; result grouped by local expert."""
        received = distributed.all_to_all(rows_in_send_order, self.send_splits, self.recv_splits, self.group)
        return received[self.local.order]

    def undispatch(self, rows_grouped: torch.Tensor) -> torch.Tensor:
        """Inverse of dispatch: rows back to their source ranks, in send order."""
        received_order = torch.empty_like(rows_grouped)
        received_order[self.local.order] = rows_grouped
        return distributed.all_to_all(received_order, self.recv_splits, self.send_splits, self.group)


def build_dispatch_plan(topk_ids: torch.Tensor, num_experts: int, group, signature: dict | None = None) -> DispatchPlan:
    """signature: what the group's ranks must agree on (distributed.exchange_counts checks it with the counts)."""
    world, _ = distributed.group_size_and_rank(group)
    experts_per_rank = num_experts // world
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    sorted_ids = flat[order]
    # (this path reads the counts back to the host below anyway; an id outside [0, E) would otherwise wrap to
    # another rank's or expert's rows without a word)
    if sorted_ids.numel() and not 0 <= int(sorted_ids[0]) <= int(sorted_ids[-1]) < num_experts:
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got values in "
                         f"[{int(sorted_ids[0])}, {int(sorted_ids[-1])}]")
    dest = sorted_ids // experts_per_rank
    send_counts = torch.bincount(dest, minlength=world).to(torch.int64)
    recv_counts = distributed.exchange_counts(send_counts, group, signature)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    local_ids = distributed.all_to_all(sorted_ids - dest * experts_per_rank, send_splits, recv_splits, group)
    return DispatchPlan(order, send_splits, recv_splits, group_by_expert(local_ids, experts_per_rank), group)


@dataclass
class ExpertsSaved:
    plan: DispatchPlan
    rows: torch.Tensor  # received token rows, grouped by local expert
    gate_up: torch.Tensor  # [N_local, 2I]


def experts_forward(
    x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None,
    activation="swiglu", swiglu_limit=None, plan: DispatchPlan | None = None, precision="bf16",
):
    """Routed experts, sharded over plan.group (default: all experts local). Returns (y, ExpertsSaved)."""
    num_tokens, top_k = topk_ids.shape
    if plan is None:
        plan = build_dispatch_plan(topk_ids, gate_up_proj.shape[0], None)
    rows = plan.dispatch(x[plan.order // top_k])
    out, gate_up = grouped_mlp_forward(
        rows, plan.local.counts, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
        precision,
    )
    returned = plan.undispatch(out)
    slots = torch.empty_like(returned)
    slots[plan.order] = returned
    y = combine_slots(slots.view(num_tokens, top_k, slots.shape[-1]), topk_weights, x.dtype)
    return y, ExpertsSaved(plan, rows, gate_up)


def experts_backward(
    grad_y, saved: ExpertsSaved, x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None,
    down_bias=None, activation="swiglu", swiglu_limit=None, precision="bf16", grads_into=None, needs=None,
):
    """Backward of experts_forward. Returns (dx, d_topk_weights, GroupedMLPGrads of local experts).
    needs: which parameter gradients to compute (param_grads_needed; None: all).

    x is not read here (saved.rows holds this rank's rows, which may come from
    peers); it is part of the signature every backend shares. grads_into: a GroupedMLPGrads
    whose parameter gradients this call's are added to (add_param_grads), and returned.
    """
    num_tokens, top_k = topk_ids.shape
    plan = saved.plan
    token_of_slot = plan.order // top_k
    dy_rows = plan.dispatch(grad_y.to(saved.rows.dtype)[token_of_slot])
    w_rows = plan.dispatch(topk_weights.reshape(-1)[plan.order].contiguous())
    grads = grouped_mlp_backward(
        saved.rows, dy_rows, w_rows, saved.gate_up, plan.local.counts, gate_up_proj, down_proj,
        gate_up_bias, down_bias, activation, swiglu_limit, precision, needs,
    )
    dx_back = plan.undispatch(grads.grad_rows)
    dw_back = plan.undispatch(grads.grad_weights)
    dx_slots = torch.empty_like(dx_back)
    dx_slots[plan.order] = dx_back
    d_topk = torch.empty_like(dw_back)
    d_topk[plan.order] = dw_back
    dx = sum_slots(dx_slots.view(num_tokens, top_k, dx_slots.shape[-1]), saved.rows.dtype)
    if grads_into is not None:
        grads = add_param_grads(grads_into, grads)
    return dx, d_topk.view(num_tokens, top_k), grads
