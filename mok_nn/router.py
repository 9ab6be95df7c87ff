"""Routing math: scores, deterministic top-k selection, top-k weights, aux losses.

Everything here is ordinary differentiable PyTorch in fp32: the router trains
through autograd of these functions, and the expert kernels only see the
selected expert ids and the top-k weights.

Selection is a pure function of its inputs: a stable descending sort puts
equal scores in ascending expert order, so ties go to the lower expert index
on every device and every run (torch.topk makes no such promise).
"""

from __future__ import annotations

import functools

import torch

from . import triton_ops
from .reference import compute_dtype

SCORE_FUNCS = ("softmax", "sigmoid")


def router_logits(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits x2d @ weight^T (+ bias) in the compute dtype (fp32 for 16-bit x).

    The products of 16-bit values are exact in fp32 and are summed in fp32 either way. Where x and the weight are
    bf16 (or fp16) on a CUDA GPU with 16-bit tensor cores, one tensor-core GEMM with an fp32 output computes them
    (_TensorCoreLogits); elsewhere, and under torch.compile, x and the weight are cast to fp32 first (an FFMA GEMM
    and an fp32 copy of x: on the H100 at qwen3's 8192 x 2048 tokens that took 0.15 ms of a 1.67 ms forward)."""
    if _tensor_core_logits_run_on(x2d, weight):
        logits = _TensorCoreLogits.apply(x2d, weight)
    else:
        cdt = compute_dtype(x2d.dtype)
        logits = x2d.to(cdt) @ weight.to(cdt).T
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    return logits


_MM_HAS_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=) (torch 2.8 and later)


def _tensor_core_logits_run_on(x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_MM_HAS_OUT_DTYPE and x2d.is_cuda and x2d.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x2d.dtype and weight.device == x2d.device and not torch.compiler.is_compiling()
            and _has_16bit_tensor_cores(x2d.device.index))


@functools.cache
def _has_16bit_tensor_cores(device_index: int) -> bool:
    """sm_80 or later; cached: the capability query costs the host ~20 us, on every layer forward otherwise."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


class _TensorCoreLogits(torch.autograd.Function):
    """fp32 x @ w^T of 16-bit x and w by torch.mm(..., out_dtype=torch.float32), saving x and w (not an fp32 copy
    of x: 64 MB less activation memory at qwen3's 8192 tokens).

    Backward in bf16: d logits (fp32) is split exactly into three bf16 parts (_bf16_parts), so d x and d w are
    again fp32 sums of exact products on tensor cores: d x one GEMM over the stacked parts, d w three GEMMs
    summed in fp32. In fp16 (whose range cannot hold the parts) the fp32 GEMMs of x.float() and w.float()."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, d_logits):
        x, w = ctx.saved_tensors
        return logits_backward(x, w, d_logits, *ctx.needs_input_grad[:2])


def logits_backward(x, w, d_logits, need_x: bool, need_w: bool, parts=None):
    """(d x, d w) (None where not needed) of the tensor-core logits x @ w^T for fp32 d_logits (_TensorCoreLogits).
    fp16, or off CUDA (no mm with an fp32 output there): fp32 GEMMs. parts: d_logits' three bf16 parts side by
    side [T, 3E] where already made (triton_ops.route_backward)."""
    d_x = d_w = None
    if x.dtype != torch.bfloat16 or not x.is_cuda:
        if need_x:
            d_x = d_logits.mm(w.float()).to(x.dtype)
        if need_w:
            d_w = x.float().t().mm(d_logits).t().to(w.dtype)
        return d_x, d_w
    if parts is None:
        parts = torch.cat(_bf16_parts(d_logits), dim=1)
    if need_x:
        d_x = torch.mm(parts, w.repeat(3, 1), out_dtype=torch.float32).to(x.dtype)
    if need_w:
        hi, mid, lo = torch.mm(parts.t(), x, out_dtype=torch.float32).chunk(3)
        d_w = ((hi + mid) + lo).to(w.dtype)
    return d_x, d_w


def _bf16_parts(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, mid, lo) in bf16 with hi + mid + lo == d for fp32 d: each part takes the next 8 significant bits, and
    each remainder is exact in fp32. Non-finite d (and finite d beyond bf16's largest value, which rounds to
    inf) stay in hi alone."""
    hi = d.to(torch.bfloat16)
    rest = torch.where(hi.isfinite(), d - hi.float(), 0.0)
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def compute_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Router scores in fp32 from fp32 logits [T, E]."""
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")


def stable_topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; ties to the lower index: the first k of a stable
    descending sort (-0 equals +0, NaN above everything, NaNs equal).

    The fastest form with that result, by device (benchmarks/router_variants.py): on CPU torch.topk on unique keys
    (topk_by_keys, 3x faster there than the sort); on CUDA one Triton kernel (triton_ops.topk_indices, checked
    on its first use against the sort; not under torch.compile), else the stable sort itself (on the H200 the keys
    took 0.55 ms against the sort's 0.26 ms for 8192 x 128 scores)."""
    if values.device.type == "cpu":
        return topk_by_keys(values, k)
    if not torch.compiler.is_compiling() and triton_ops.topk_runs_on(values, k) and triton_ops.verified(
            ("topk_indices", k), values.device,
            lambda: (triton_ops.topk_indices(values[:64], k), topk_by_sort(values[:64], k)), exact=True):
        return triton_ops.topk_indices(values, k)
    return topk_by_sort(values, k)


def topk_by_sort(values: torch.Tensor, k: int) -> torch.Tensor:
    """stable_topk_indices as the first k of a stable descending sort of every row."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_by_keys(values: torch.Tensor, k: int) -> torch.Tensor:
    """stable_topk_indices as torch.topk on unique int64 keys (the value's order-preserving bits, then the reversed
    index): with no two keys equal, topk's result and order are those of the stable sort whatever its algorithm.
    32-bit and 16-bit floats; other dtypes sort."""
    n = values.shape[-1]
    if values.dtype not in (torch.float32, torch.bfloat16, torch.float16) or n >= 2**31 or values.numel() == 0:
        return topk_by_sort(values, k)
    v = values.float() + 0.0  # exact; -0 -> +0
    bits = v.view(torch.int32)
    # int order of the float order: negatives (sign bit set) map to -1 - their magnitude bits
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = key.masked_fill_(v.isnan(), 0x7F800001).to(torch.int64)  # every NaN one key, above +inf (0x7F800000)
    key = key.mul_(n).add_(torch.arange(n - 1, -1, -1, device=values.device))  # ties: the lower index first
    return torch.topk(key, k, dim=-1).indices


def select_experts(
    scores_for_choice: torch.Tensor,
    top_k: int,
    n_group: int | None = None,
    topk_group: int | None = None,
) -> torch.Tensor:
    """Expert ids [T, top_k] (int64) chosen from selection scores [T, E].

    Group-limited routing (DeepSeek-V3): experts form n_group equal groups; a
    group's score is the sum of its two best selection scores (its best score
    when a group holds one expert); only the topk_group best groups stay
    eligible, the others are masked to -inf before the final top-k.
    """
    num_tokens, num_experts = scores_for_choice.shape
    if n_group is not None and n_group > 1:
        group_size = num_experts // n_group
        grouped = scores_for_choice.view(num_tokens, n_group, group_size)
        # each group's two best scores, largest first (the first two of its stable descending sort)
        top2 = stable_topk_indices(grouped.reshape(num_tokens * n_group, group_size), min(2, group_size))
        group_scores = grouped.gather(-1, top2.view(num_tokens, n_group, top2.shape[-1])).sum(dim=-1)
        keep_groups = stable_topk_indices(group_scores, topk_group)
        group_mask = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=scores_for_choice.device)
        group_mask.scatter_(1, keep_groups, True)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, group_size).reshape(num_tokens, num_experts)
        scores_for_choice = scores_for_choice.masked_fill(~expert_mask, float("-inf"))
    return stable_topk_indices(scores_for_choice, top_k)


def route(
    logits: torch.Tensor,
    top_k: int,
    score_func: str = "softmax",
    norm_topk_prob: bool = True,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route tokens from fp32 logits [T, E].

    Returns (topk_ids int64 [T, k], topk_weights fp32 [T, k], scores fp32 [T, E]).
    The weights are differentiable w.r.t. the logits; the ids are not. The
    correction bias only affects which experts are selected, never the weights.

    On CUDA without expert groups the whole routing is one Triton kernel each way (triton_ops.route: the same
    selection rule, scores and weights within fp32 rounding of these torch ops, checked on its first use); under
    torch.compile the torch ops, which the compiler fuses itself.
    """
    opts = (top_k, score_func, norm_topk_prob, routed_scaling_factor, e_score_correction_bias)
    if not torch.compiler.is_compiling() and triton_ops.route_runs_on(logits, top_k, n_group) and triton_ops.verified(
            ("route", top_k, score_func, bool(norm_topk_prob), e_score_correction_bias is not None), logits.device,
            lambda: _route_forms(logits[:64], *opts), exact=False):
        return triton_ops.route(logits, *opts)
    return route_torch(logits, top_k, score_func, norm_topk_prob, n_group, topk_group, routed_scaling_factor,
                       e_score_correction_bias)


def route_tokens(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    logit_bias: torch.Tensor | None,
    top_k: int,
    score_func: str = "softmax",
    norm_topk_prob: bool = True,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, topk_ids, topk_weights, scores): router_logits(x2d, weight, logit_bias), then route of them.

    On CUDA with 16-bit x, at most triton_ops.ROUTER_MAX_COLS experts and no expert groups, one Triton kernel
    computes all four (the logits' exact products summed in fp32 on the tensor cores, then route's kernel from the
    registers; _FusedRouter), checked on its first use against the two steps; its backward is route's and
    router_logits'. The same function: only the logits' fp32 summation order differs from the cuBLAS GEMM's.
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    opts = (top_k, score_func, norm_topk_prob, routed_scaling_factor, e_score_correction_bias)
    if (_tensor_core_logits_run_on(x2d, weight)  # (not under torch.compile either)
            and triton_ops.router_runs_on(x2d, weight, top_k, n_group) and triton_ops.verified(
                ("router", x2d.dtype, top_k, score_func, bool(norm_topk_prob), logit_bias is not None,
                 e_score_correction_bias is not None), x2d.device,
                lambda: _router_forms(x2d[:64], weight, logit_bias, *opts), exact=False)):
        return _FusedRouter.apply(x2d, weight, logit_bias, *opts)
    logits = router_logits(x2d, weight, logit_bias)
    return (logits, *route(logits, top_k, score_func, norm_topk_prob, n_group, topk_group, routed_scaling_factor,
                           e_score_correction_bias))


class _FusedRouter(torch.autograd.Function):
    """route_tokens as triton_ops.router_forward: forward one kernel; backward route's d logits kernel (plus the
    incoming d logits, e.g. of a z-loss), then router_logits' backward GEMMs. Saves x, the weight, the scores and
    the ids, as the two steps do."""

    @staticmethod
    def forward(ctx, x, weight, logit_bias, top_k, score_func, norm_topk_prob, scale, bias):
        softmax = score_func == "softmax"
        logits, ids, weights, scores = triton_ops.router_forward(x, weight, logit_bias, bias, top_k, softmax,
                                                                 bool(norm_topk_prob), float(scale))
        ctx.save_for_backward(x, weight, scores, ids)
        ctx.opts = (top_k, softmax, bool(norm_topk_prob), float(scale))
        ctx.set_materialize_grads(False)  # (unused outputs, the logits and scores without aux losses: no zeros)
        ctx.logit_bias_dtype = None if logit_bias is None else logit_bias.dtype
        ctx.mark_non_differentiable(ids)
        return logits, ids, weights, scores

    @staticmethod
    def backward(ctx, d_logits, _d_ids, d_weights, d_scores):
        x, weight, scores, ids = ctx.saved_tensors
        if d_weights is None and d_scores is None:
            d_l, parts = d_logits.float(), None
        else:  # d logits and, for bf16 GEMMs, its bf16 parts from route's backward kernel
            d_l, parts = triton_ops.route_backward(scores, ids, d_weights, d_scores, *ctx.opts, d_logits_in=d_logits,
                                                   parts=x.dtype == torch.bfloat16)
        d_x, d_w = logits_backward(x, weight, d_l, *ctx.needs_input_grad[:2], parts=parts)
        d_b = d_l.sum(0).to(ctx.logit_bias_dtype) if ctx.needs_input_grad[2] else None
        return d_x, d_w, d_b, None, None, None, None, None


def _router_forms(x, weight, logit_bias, top_k, score_func, norm_topk_prob, routed_scaling_factor, bias):
    """(fused, two steps) (logits, ids, weights, scores, d x, d weight) on these rows, for fixed pseudo-random
    gradients of the logits, the weights and the scores: triton_ops.verified's pair for route_tokens."""
    g = torch.Generator(device=x.device).manual_seed(0)
    d_l = torch.randn(x.shape[0], weight.shape[0], device=x.device, generator=g)
    d_w = torch.randn(x.shape[0], top_k, device=x.device, generator=g)
    d_s = torch.randn(x.shape[0], weight.shape[0], device=x.device, generator=g)
    out = []
    for fused in (True, False):
        with torch.enable_grad():  # (the first call may come under no_grad, e.g. in inference)
            xs, ws = x.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
            if fused:
                logits, ids, w, s = _FusedRouter.apply(xs, ws, logit_bias, top_k, score_func, norm_topk_prob,
                                                       routed_scaling_factor, bias)
            else:
                logits = router_logits(xs, ws, logit_bias)
                ids, w, s = route_torch(logits, top_k, score_func, norm_topk_prob, None, None,
                                        routed_scaling_factor, bias)
            d_x, d_wr = torch.autograd.grad((logits * d_l).sum() + (w * d_w).sum() + (s * d_s).sum(), (xs, ws))
        out.append((logits.detach(), ids, w.detach(), s.detach(), d_x, d_wr))
    return tuple(out)


def route_torch(logits, top_k, score_func="softmax", norm_topk_prob=True, n_group=None, topk_group=None,
                routed_scaling_factor=1.0, e_score_correction_bias=None):
    """route by torch ops (any device, expert groups)."""
    scores = compute_scores(logits, score_func)
    with torch.no_grad():
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
        topk_ids = select_experts(choice, top_k, n_group, topk_group)
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_ids, topk_weights, scores


def _route_forms(logits, top_k, score_func, norm_topk_prob, routed_scaling_factor, bias):
    """(the Triton kernels', the torch ops') (ids, weights, scores, d logits) on these rows, d logits for fixed
    pseudo-random gradients of the weights and the scores: triton_ops.verified's pair."""
    g = torch.Generator(device=logits.device).manual_seed(0)
    d_w = torch.randn(logits.shape[0], top_k, device=logits.device, generator=g)
    d_s = torch.randn(logits.shape, device=logits.device, generator=g)
    out = []
    for fn in (triton_ops.route, route_torch):
        with torch.enable_grad():  # (the first call may come under no_grad, e.g. in inference)
            x = logits.detach().clone().requires_grad_(True)
            if fn is triton_ops.route:
                ids, w, s = fn(x, top_k, score_func, norm_topk_prob, routed_scaling_factor, bias)
            else:
                ids, w, s = fn(x, top_k, score_func, norm_topk_prob, None, None, routed_scaling_factor, bias)
            (d_l,) = torch.autograd.grad((w * d_w).sum() + (s * d_s).sum(), x)
        out.append((ids, w.detach(), s.detach(), d_l))
    return tuple(out)


def expert_counts(topk_ids: torch.Tensor, num_experts: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[E] routed (token, slot) pairs per expert, by an integer scatter_add_ (exact and order-free), not bincount:
    bincount reads the ids' range back to the host, a synchronisation on a GPU."""
    flat = topk_ids.reshape(-1)
    ones = torch.ones_like(flat, dtype=dtype)
    return torch.zeros(num_experts, dtype=dtype, device=flat.device).scatter_add_(0, flat, ones)


def load_balancing_loss(scores: torch.Tensor, topk_ids: torch.Tensor, score_func: str) -> torch.Tensor:
    """Switch-style load-balancing loss  E * sum_e f_e * P_e  (1.0 at perfect balance).

    f_e: fraction of the T*k routed (token, slot) assignments that go to
    expert e (not differentiable). P_e: mean over tokens of the router
    probability of e; sigmoid scores are first normalised per token to sum to 1.
    """
    num_experts = scores.shape[-1]
    if scores.shape[0] == 0:
        return scores.sum() * 0.0
    probs = scores if score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    counts = expert_counts(topk_ids, num_experts).to(scores.dtype)
    fraction = counts / topk_ids.numel()
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()
