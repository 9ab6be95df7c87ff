"""MoKFunction: the routed experts as one torch.autograd.Function.

The backward is written out (see the formulas in reference.py), not taken by
autograd through the forward, so the fused kernels implement the very same
formulas and the reference path is their oracle. The router and the shared
expert stay outside, in ordinary autograd.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from . import cuda_mx, distributed, functional, triton_ops
from .functional import ExpertParams, Workspace
from .mxfp8 import MXFP8Tensor, dequantize, mark_values, row_chunks, weight_scope


def autocast_off(device_type: str):
    """A context without autocast on device_type: mok_nn computes in its parameter dtype (fp32
    accumulation) whatever the caller's autocast, as its explicit backward does."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta): nothing to turn off
        enabled = False
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def _split_saved(saved):
    """(tensors, rebuild): the tensor fields of a backend's saved-for-backward dataclass, and a
    function that puts them back. The tensors go through ctx.save_for_backward, so saved-tensor
    hooks (activation checkpointing, CPU offload) apply to the large expert activations."""
    if not dataclasses.is_dataclass(saved):
        return [], lambda tensors: saved
    fields = [f.name for f in dataclasses.fields(saved)]
    names = [n for n in fields if isinstance(getattr(saved, n), torch.Tensor)]
    others = {n: getattr(saved, n) for n in fields if n not in names}
    cls = type(saved)
    return [getattr(saved, n) for n in names], lambda tensors: cls(**others, **dict(zip(names, tensors)))


def weight_scope_for(num_passes: int):
    """mxfp8.weight_scope where a forward or backward runs several macrobatch passes (trained weights' MXFP8
    values made once for all of them), else nothing: one pass asks for each weight's values once, and outside a
    scope they are freed right after their GEMM instead of held to the end of the pass (a copy of the expert
    weights at the backward's peak)."""
    return weight_scope() if num_passes > 1 else contextlib.nullcontext()


def pass_bounds(num_tokens: int, size: int) -> list[tuple[int, int]]:
    """Token ranges [start, end) of passes of `size` tokens over num_tokens (the last one shorter)."""
    return [(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """t's rows [start, end): t itself where that is all of them (a slice costs the host a view op, and
    the one-pass call is host-bound at small shapes)."""
    return t if start == 0 and end == t.shape[0] else t[start:end]


def macrobatch_passes(num_tokens: int, workspace: Workspace) -> list[tuple[int, int]] | None:
    """Token ranges [start, end) of the macrobatch passes (MoKConfig.macrobatch_size tokens each, the last
    one shorter), or None where every token runs in one pass.

    With expert parallelism every rank must run the same passes, so the ranks compare their token
    counts (one all-reduce, a host synchronisation, only when macrobatch_size is set): where some rank
    needs passes, every rank must have the same count (else ValueError on every rank), and on the
    CUDA path the workspace's token capacity is grown to a pass first (all ranks alike), so no pass
    is flagged for exceeding it.
    """
    size = workspace.config.macrobatch_size
    if size is None:
        return None
    if workspace.ep_size > 1:
        lo, hi = distributed.token_count_range(num_tokens, workspace.ep_group, workspace.device)
        if hi <= size:
            return None  # one pass on every rank, whatever the counts
        if lo != hi:
            raise ValueError(
                f"MoKConfig.macrobatch_size ({size}) splits this call into passes, and with expert parallelism "
                f"every rank must then pass the same number of tokens; this call has {lo} to {hi} tokens "
                f"across the ranks"
            )
        if workspace.backend == "cuda":
            from . import cuda_ep

            cuda_ep.reserve_pass(workspace, size)
    if num_tokens <= size:
        return None
    return pass_bounds(num_tokens, size)


def expert_weights(gate_up_proj, down_proj, gate_up_scale, down_scale, dtype, workspace: Workspace | None = None):
    """The expert weights the GEMMs take: the tensors given, or, with scales (MXFP8-only weights: E4M3 data and
    E8M0 scales, blocks of 32 along the last dimension), W_q = dequantize(stored) in dtype, a new tensor, marked
    as its own MXFP8 values along that dimension (mxfp8.mark_values). Where the fused forward reads them as
    MXFP8 (cuda_mx.forward_reason), cuda_mx.MxWeight views of the stored tensors instead: no copy."""
    if gate_up_scale is None:
        return gate_up_proj, down_proj
    if workspace is not None and cuda_mx.forward_reason(workspace, gate_up_proj, gate_up_scale, down_proj, down_scale,
                                                        dtype) is None:
        return cuda_mx.MxWeight(gate_up_proj, gate_up_scale), cuda_mx.MxWeight(down_proj, down_scale)
    weights = (dequantize(MXFP8Tensor(gate_up_proj, gate_up_scale, 2), dtype),
               dequantize(MXFP8Tensor(down_proj, down_scale, 2), dtype))
    if dtype in (torch.bfloat16, torch.float32):  # (fp16 overflows near its top: there the values may differ)
        for w in weights:  # precision="mxfp8"'s forward operands: W_q itself, no second pass
            mark_values(w, -1)
    return weights


def backward_expert_weights(gate_up_proj, down_proj, gate_up_scale, down_scale, dtype, workspace: Workspace):
    """The expert weights the backward takes. MXFP8-only weights with precision="mxfp8": the backward reads them
    only as its d x / d h GEMMs' operands, MXFP8 values of W_q along N (they get no gradient), so it gets those,
    computed from the stored data (triton_ops.requantize_rows in one pass, else a few experts at a time by
    functional.weight_values_along_n) and marked as such:
    no whole copy of W_q is held beside them, which halves the weights' transient memory (45 -> 22.5 GB at
    deepseek-v3). On the fused path (cuda_mx.column_reason None) not even those: cuda_mx.MxColumnWeight views of
    the stored tensors, which the dgrad kernels read as they are stored. Otherwise what expert_weights gives."""
    if gate_up_scale is None or workspace.precision != "mxfp8" or dtype not in (torch.bfloat16, torch.float32):
        return expert_weights(gate_up_proj, down_proj, gate_up_scale, down_scale, dtype)
    if cuda_mx.column_reason(workspace, gate_up_proj, gate_up_scale, down_proj, down_scale, dtype) is None:
        return cuda_mx.MxColumnWeight(gate_up_proj, gate_up_scale), cuda_mx.MxColumnWeight(down_proj, down_scale)
    weights = []
    for data, scale in ((gate_up_proj, gate_up_scale), (down_proj, down_scale)):
        w = values_along_n(data, scale, dtype, workspace.backend)
        mark_values(w, -2)
        weights.append(w)
    return weights


def values_along_n(data, scale, dtype, backend: str) -> torch.Tensor:
    """The MXFP8 values along N of stored MXFP8 weights [E, N, K] (blocks along K) in dtype, as `backend` computes
    them: triton_ops.requantize_rows in one pass (checked on first use), else a few experts at a time dequantised
    and quantised along N (functional.weight_values_along_n), never a whole copy of W_q."""
    if _requantizes_in_one_pass(data, scale, dtype, backend):
        return triton_ops.requantize_rows(data, scale, dtype)
    w = torch.empty(data.shape, dtype=dtype, device=data.device)
    for a, b in row_chunks(data.shape[0], data[:1].numel() * w.element_size(), data.device):  # whole experts
        w[a:b] = _values_along_n(data[a:b], scale[a:b], dtype, backend)
    return w


def _values_along_n(data, scale, dtype, backend: str):
    """The MXFP8 values along N of stored MXFP8 weights: dequantised, then quantised along N by the backend."""
    return functional.weight_values_along_n(dequantize(MXFP8Tensor(data, scale, 2), dtype), backend)


def _requantizes_in_one_pass(data, scale, dtype, backend: str) -> bool:
    """Whether triton_ops.requantize_rows makes values_along_n's values (CUDA, Triton): one read of the bytes and
    one write, where dequantising and quantising again move about seven bytes an element. Checked on its first use
    (per dtype and device) against the two steps on one expert, bit for bit."""
    return triton_ops.requantize_runs_on(data, dtype) and triton_ops.verified(
        ("requantize_rows", dtype), data.device,
        lambda: (triton_ops.requantize_rows(data[:1], scale[:1], dtype), _values_along_n(data[:1], scale[:1], dtype,
                                                                                          backend)), exact=True)


def graph_kept() -> bool:
    """Whether the running backward keeps the autograd graph (retain_graph=True, create_graph): then the saved
    tensors may be read by a later backward and must not be overwritten. True outside a backward, and where
    torch does not say."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


def _needs(ctx, mxfp8_weights: bool) -> tuple:
    """Which expert tensors get a gradient (gate_up_proj, down_proj and their biases): those that require grad;
    MXFP8-only weights never (their data is frozen)."""
    needs = tuple(ctx.needs_input_grad[2:6])
    return (False, False) + needs[2:] if mxfp8_weights else needs


class MoKFunction(torch.autograd.Function):
    """y = sum_j w_tj * expert_{ids_tj}(x_t), with gradients for x, w and the expert parameters.

    apply(x [T, H], topk_weights [T, k], gate_up_proj [E_l, 2I, H], down_proj [E_l, H, I],
          gate_up_bias [E_l, 2I] | None, down_bias [E_l, H] | None, topk_ids [T, k] int64,
          workspace: functional.Workspace[, gate_up_scale, down_scale[, schedule]]) -> y [T, H] in x.dtype

    schedule: functional.build_schedule(topk_ids, workspace, x) made by the caller (one pass only), e.g. right after
    the router's launch, so the GPU builds it while the host prepares the rest of the call; else made here.

    MXFP8-only expert weights (MoKMoELayer.quantize_experts_): gate_up_proj / down_proj are their float8_e4m3fn
    data and gate_up_scale [E_l, 2I, H/32] / down_scale [E_l, H, I/32] their uint8 E8M0 scales; the GEMMs take
    W_q = dequantize(stored) in x.dtype, computed anew in forward (a transient copy: only the MXFP8 tensors are
    saved), and in backward, with precision="mxfp8", W_q's values along N, which its GEMMs take
    (backward_expert_weights); they get no gradient.

    Expert tensors that do not require grad (frozen experts, ctx.needs_input_grad) get no gradient, and the
    backends skip the GEMMs (and sums) that would compute it; d x and d topk-weights are the same bits either way.

    With MoKConfig.macrobatch_size set and more tokens than that, the tokens run in passes of that
    many (macrobatch_passes), forward and backward, so the per-pass buffers (the EP workspace, the
    rows of one pass) are sized by the pass. y, d x and d topk-weights are bitwise those of separate
    calls on each pass's tokens, concatenated; on the CUDA path they also equal the one-pass result
    bitwise (every token's rows are computed alike), on the reference path only within rounding (BLAS
    may round a row differently for another row count; tests/test_macrobatch.py). The parameter
    gradients are the sum over the passes in pass order, each pass's added in the parameters' dtype
    (the CUDA weight-gradient kernel adds in its stores).
    """

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, topk_ids,
                workspace: Workspace, gate_up_scale=None, down_scale=None, schedule=None):
        params = ExpertParams(*expert_weights(gate_up_proj, down_proj, gate_up_scale, down_scale, x.dtype, workspace),
                              gate_up_bias, down_bias)
        passes = macrobatch_passes(x.shape[0], workspace) or [(0, x.shape[0])]
        if schedule is not None and len(passes) > 1:
            raise ValueError("a schedule made by the caller covers one pass; macrobatch passes make their own")
        needs = _needs(ctx, gate_up_scale is not None)
        ys, saved_passes = [], []
        with autocast_off(x.device.type), weight_scope_for(len(passes)):
            for start, end in passes:
                ids, xs = _rows(topk_ids, start, end), _rows(x, start, end)
                sched = schedule if schedule is not None else functional.build_schedule(ids, workspace, xs)
                y_pass, saved = functional.forward(xs, ids, _rows(topk_weights, start, end), params, sched,
                                                   workspace, needs)
                ys.append(y_pass)
                saved_passes.append(saved)
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        saved_tensors, ctx.rebuild_saved, ctx.saved_counts = [], [], []
        for saved in saved_passes:
            tensors, rebuild = _split_saved(saved)
            saved_tensors += tensors
            ctx.rebuild_saved.append(rebuild)
            ctx.saved_counts.append(len(tensors))
        del params  # (the dequantised copy of MXFP8-only weights is not kept for backward)
        ctx.passes = passes
        ctx.workspace = workspace
        ctx.mxfp8_weights = gate_up_scale is not None
        ctx.save_for_backward(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                              gate_up_scale, down_scale, *saved_tensors)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        (x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_scale, down_scale,
         *saved) = ctx.saved_tensors
        params = ExpertParams(*backward_expert_weights(gate_up_proj, down_proj, gate_up_scale, down_scale, x.dtype,
                                                       ctx.workspace), gate_up_bias, down_bias)
        needs = _needs(ctx, ctx.mxfp8_weights)
        saved_passes, first = [], 0
        for rebuild, count in zip(ctx.rebuild_saved, ctx.saved_counts):
            saved_passes.append(rebuild(saved[first:first + count]))
            first += count
        grad_y = grad_y.contiguous()
        consume = not graph_kept()  # (the saved activations' buffers may then be reused: peak memory)
        dxs, d_topks, grads = [], [], None
        # (autocast off: a backward called inside an autocast region)
        with autocast_off(grad_y.device.type), weight_scope_for(len(ctx.passes)):
            for (start, end), saved_pass in zip(ctx.passes, saved_passes):
                # later passes add their parameter gradients into the first one's (grads_into)
                dx, d_topk, grads = functional.backward(
                    _rows(grad_y, start, end), saved_pass, _rows(x, start, end), _rows(topk_ids, start, end),
                    _rows(topk_weights, start, end), params, ctx.workspace, grads_into=grads, needs=needs,
                    consume_saved=consume,
                )
                dxs.append(dx)
                d_topks.append(d_topk)
        if len(dxs) > 1:
            dx, d_topk = torch.cat(dxs), torch.cat(d_topks)
        return (dx, d_topk, grads.gate_up_proj, grads.down_proj, grads.gate_up_bias, grads.down_bias, None, None,
                None, None, None)
