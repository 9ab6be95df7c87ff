"""The portable backend: the routed experts from torch ops, on any device and dtype.

It computes the function of reference.py (same formulas, same saved tensors,
same fixed-order combine) but as a handful of batched ops instead of a Python
loop over experts:

- schedule: a stable sort of the flat expert ids groups the T*k routed rows by
  expert (row order inside an expert: ascending slot, as in the reference);
  per-expert row ranges come from searchsorted on the sorted ids. Everything
  stays on the device (no .item(), bincount, nonzero, boolean-mask indexing or
  tolist).
- grouped GEMMs: torch._grouped_mm over the expert row ranges; where it cannot
  run (float64, sizes whose rows are not 16-byte multiples) the same GEMMs run
  as one torch.bmm over rows padded per expert to a fixed capacity. At EP=1
  nothing is read back to the host on CPU and with bf16 on sm90 / sm100 GPUs;
  on other CUDA devices and dtypes torch._grouped_mm itself copies its offsets
  to the host once per GEMM (grouped_mm_reads_offsets_on_host).
- combine: y_t = sum_j w_tj * y_tj in fp32, j = 0..k-1 in order, as
  reference.combine_slots does; d x sums its k slots in the same order.

Every slot is written once, by gathers with a permutation and its inverse;
nothing scatters with repeated indices and nothing is accumulated atomically,
so outputs and gradients are bitwise identical run to run, and
torch.use_deterministic_algorithms(True) leaves every op here allowed.

With 16-bit storage the GEMMs accumulate in fp32 but round their outputs to
the storage dtype (torch._grouped_mm returns its inputs' dtype), where the
reference keeps d h' in fp32 up to the top-k weight gradient and d gate_up:
the two agree within the storage dtype's rounding. In fp32 they agree within
fp32 rounding (only the order of sums inside a GEMM differs).

Expert parallelism: the reference's DispatchPlan moves the rows (one
all-to-all each way, split sizes read on the host, as every EP baseline does);
the local experts run the grouped GEMMs above.

precision="mxfp8": every GEMM operand is fake-quantised (mxfp8.fake_quantize_fast,
the values of mxfp8.fake_quantize) along the GEMM's reduction dimension
(docs/mxfp8.md); weight-gradient operands in blocks of 32 rows of each
expert's own rows, the last block zero-padded. Then the same grouped GEMMs.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from . import reference
from .mxfp8 import fake_quantize_fast
from .reference import DispatchPlan, GroupedMLPGrads, activation_backward, activation_forward, compute_dtype

_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MX_BLOCK = 32


@functools.cache
def grouped_mm_reads_offsets_on_host(device_type: str, index: int | None, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm copies its offsets to the host (one synchronisation per GEMM) here: on CUDA
    everywhere but its CUTLASS kernel (bf16 on sm90 / sm100), where it loops over the groups; on CPU the
    offsets are host memory anyway."""
    if device_type != "cuda":
        return False
    return not (dtype == torch.bfloat16 and torch.cuda.get_device_capability(index)[0] in (9, 10))


def use_grouped_mm(device: torch.device, dtype: torch.dtype, sizes) -> bool:
    """torch._grouped_mm for these rows: its dtypes (bf16, fp16, fp32) and rows of 16-byte multiples (its stride
    rule). On CUDA outside bf16 on sm90 / sm100 it reads the offsets on the host once per GEMM
    (grouped_mm_reads_offsets_on_host), as transformers' default experts do there: the padded batched GEMM
    that avoids it does E / k times the work and does not fit in memory at model shapes. Elsewhere (float64,
    odd sizes) the padded batched GEMM runs."""
    if not hasattr(torch, "_grouped_mm") or dtype not in _GROUPED_MM_DTYPES or device.type not in ("cpu", "cuda"):
        return False
    align = 16 // torch.empty((), dtype=dtype).element_size()
    return not any(s % align for s in sizes)


# --------------------------------------------------------------------------
# rows grouped by expert


@dataclass
class Groups:
    """N rows grouped by expert (expert 0's rows first), described on the device.

    starts / counts: [E] int64 first row and row count of each expert; ends: [E] int32 cumulative ends (the
    offsets of torch._grouped_mm); expert / rank: [N] int64 expert of each row and its position among that
    expert's rows; capacity: a host bound on any expert's row count (the padded GEMM's batch rows);
    fused: torch._grouped_mm runs the GEMMs.
    """

    starts: torch.Tensor
    counts: torch.Tensor
    ends: torch.Tensor
    expert: torch.Tensor
    rank: torch.Tensor
    capacity: int
    fused: bool

    @property
    def num_rows(self) -> int:
        return self.expert.shape[0]

    @property
    def num_experts(self) -> int:
        return self.starts.shape[0]

    # -- GEMMs
    def mm(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rows [N, K] @ weight[e] [K, M] for each row's expert e -> [N, M] (weight may be a transposed view)."""
        if self.fused:
            return torch._grouped_mm(rows, weight, offs=self.ends)
        out = torch.bmm(self.pad(rows), weight)  # [E, C, M]
        return out.reshape(-1, out.shape[-1])[self.expert * self.capacity + self.rank]

    def wgrad(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """sum over each expert's rows r of a_r^T b_r: a [N, M], b [N, K] -> [E, M, K] (zero where no rows)."""
        if self.fused:
            return torch._grouped_mm(a.t(), b, offs=self.ends)
        return torch.bmm(self.pad(a).transpose(1, 2), self.pad(b))

    def segment_sum(self, rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """sum over each expert's rows of scale_r * rows_r -> [E, K], as a weight-gradient GEMM (fixed order,
        fp32 accumulation). scale [N] is rounded to rows.dtype first."""
        ones = rows.new_zeros(rows.shape[0], 16 // rows.element_size() if self.fused else 1)
        ones[:, 0] = 1 if scale is None else scale
        return self.wgrad(ones, rows)[:, 0].contiguous()

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [E, capacity, K]: each expert's rows, then zero rows (a gather, no scatter)."""
        e, c = self.num_experts, self.capacity
        slot = torch.arange(c, device=rows.device)
        valid = slot < self.counts[:, None]
        if rows.shape[0] == 0 or c == 0:
            return rows.new_zeros(e, c, rows.shape[1])
        src = (self.starts[:, None] + slot).clamp_(max=rows.shape[0] - 1)
        return torch.where(valid[..., None], rows[src], rows.new_zeros(()))

    # -- MXFP8 operands along the rows of each expert (weight-gradient GEMMs)
    def quantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """MXFP8 value of each row's elements in blocks of 32 consecutive rows of its expert (the last block of
        an expert zero-padded), as the reference quantises an expert's [rows, ...] operand along axis 0."""
        n = rows.shape[0]
        if n == 0:
            return rows
        blocks = (self.counts + MX_BLOCK - 1) // MX_BLOCK
        block_end = torch.cumsum(blocks, 0)  # int: exact
        block_start = block_end - blocks
        padded = MX_BLOCK * ((n + (MX_BLOCK - 1) * self.num_experts + MX_BLOCK - 1) // MX_BLOCK)  # static bound
        q = torch.arange(padded, device=rows.device)
        b = q // MX_BLOCK
        e = torch.searchsorted(block_end, b, right=True).clamp_(max=self.num_experts - 1)
        r = (b - block_start[e]) * MX_BLOCK + q % MX_BLOCK
        valid = (b < block_end[-1]) & (r < self.counts[e])
        src = (self.starts[e] + r).clamp_(0, n - 1)
        buf = torch.where(valid[:, None], rows[src], rows.new_zeros(()))
        buf = fake_quantize_fast(buf, axis=0)
        return buf[MX_BLOCK * block_start[self.expert] + self.rank]


def groups_from_sorted_ids(sorted_ids: torch.Tensor, num_experts: int, fused: bool, capacity: int) -> Groups:
    """Groups of rows whose expert ids are sorted ascending (on the device, no host read)."""
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    starts = torch.searchsorted(sorted_ids, experts)
    ends = torch.searchsorted(sorted_ids, experts, right=True)
    rank = torch.arange(sorted_ids.shape[0], device=sorted_ids.device) - starts[sorted_ids]
    return Groups(starts, ends - starts, ends.to(torch.int32), sorted_ids, rank, capacity, fused)


def groups_from_counts(counts: list[int], device, fused: bool) -> Groups:
    """Groups from host row counts (the EP path, where the all-to-all split sizes are on the host already)."""
    c = torch.tensor(counts, dtype=torch.int64, device=device)
    ends = torch.cumsum(c, 0)
    n = sum(counts)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), c, output_size=n)
    rank = torch.arange(n, device=device) - (ends - c)[expert]
    return Groups(ends - c, c, ends.to(torch.int32), expert, rank, max(counts, default=0), fused)


# --------------------------------------------------------------------------
# the schedule


@dataclass
class Schedule:
    """order: [T*k] slot ids sorted by expert (stable), the rows' send order; inverse: [T*k] position of each slot
    in that order; groups: the local expert rows; plan: the EP dispatch plan (None at EP=1, where the rows are
    the sorted slots themselves)."""

    order: torch.Tensor
    inverse: torch.Tensor
    groups: Groups
    plan: DispatchPlan | None


def build_schedule(topk_ids: torch.Tensor, num_experts: int, hidden_size: int, intermediate_size: int,
                   dtype: torch.dtype, group=None, signature: dict | None = None) -> Schedule:
    sizes = (hidden_size, intermediate_size)
    fused = use_grouped_mm(topk_ids.device, dtype, sizes)
    if group is not None:
        plan = reference.build_dispatch_plan(topk_ids, num_experts, group, signature)
        groups = groups_from_counts(plan.local.counts, topk_ids.device, fused)
        return Schedule(plan.order, torch.argsort(plan.order), groups, plan)
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    groups = groups_from_sorted_ids(sorted_ids, num_experts, fused, capacity=flat.shape[0])
    return Schedule(order, torch.argsort(order), groups, None)


def _to_rows(schedule: Schedule, t: torch.Tensor) -> torch.Tensor:
    """Per-slot values in send order -> the local expert rows (the dispatch all-to-all at EP > 1)."""
    return t if schedule.plan is None else schedule.plan.dispatch(t)


def _from_rows(schedule: Schedule, rows: torch.Tensor) -> torch.Tensor:
    """Local expert rows -> per-slot values in slot order t*k + j."""
    if schedule.plan is not None:
        rows = schedule.plan.undispatch(rows)
    return rows[schedule.inverse]


# --------------------------------------------------------------------------
# the expert MLP on grouped rows


def _quantizer(precision: str):
    if precision == "bf16":
        return lambda t, axis: t
    if precision == "mxfp8":
        return fake_quantize_fast
    raise ValueError(f"precision must be 'bf16' or 'mxfp8', got {precision!r}")


def _row_quantizer(precision: str, groups: Groups):
    return (lambda t: t) if precision == "bf16" else groups.quantize_rows


def _add_bias(t, bias, groups, cdt):
    if bias is None:
        return t
    return (t.to(cdt) + bias.to(cdt)[groups.expert]).to(t.dtype)


def mlp_forward(rows, groups: Groups, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
                precision="bf16"):
    """rows [N, H] grouped by expert -> (out [N, H], gate_up [N, 2I], h [N, I]), all in rows.dtype (gate_up and h
    are what backward needs: keeping h spares backward the activation's recomputation)."""
    cdt = compute_dtype(rows.dtype)
    q = _quantizer(precision)
    gate_up = _add_bias(groups.mm(q(rows, -1), q(gate_up_proj, -1).transpose(1, 2)), gate_up_bias, groups, cdt)
    h = activation_forward(gate_up.to(cdt), activation, swiglu_limit).to(rows.dtype)
    out = _add_bias(groups.mm(q(h, -1), q(down_proj, -1).transpose(1, 2)), down_bias, groups, cdt)
    return out, gate_up, h


def mlp_backward(rows, grad_out, row_weights, gate_up, h, groups: Groups, gate_up_proj, down_proj, gate_up_bias,
                 down_bias, activation, swiglu_limit, precision="bf16", needs=None) -> GroupedMLPGrads:
    """Backward of w * MLP(rows) (reference.grouped_mlp_backward's formulas), rows grouped by expert. needs: the
    parameter gradients to compute (reference.param_grads_needed); the others are None, their GEMMs not run."""
    need13, need2, need_b13, need_b2 = reference.param_grads_needed(needs)
    dt, wdt = rows.dtype, gate_up_proj.dtype
    cdt = compute_dtype(dt)
    q, qr = _quantizer(precision), _row_quantizer(precision, groups)
    w = row_weights.to(cdt).unsqueeze(1)
    gu = gate_up.to(cdt)
    dh_raw = groups.mm(q(grad_out, -1), q(down_proj, -2)).to(cdt)
    dw = (dh_raw * h.to(cdt)).sum(dim=1)
    d_down_bias = None
    if down_bias is not None:
        dw = dw + (grad_out.to(cdt) * down_bias.to(cdt)[groups.expert]).sum(dim=1)
        if need_b2:
            d_down_bias = groups.segment_sum(grad_out, row_weights).to(wdt)
    d_down_proj = groups.wgrad(qr(grad_out), qr((w * h.to(cdt)).to(dt))).to(wdt).contiguous() if need2 else None
    dgu = activation_backward(gu, w * dh_raw, activation, swiglu_limit).to(dt)
    d_gate_up_proj = groups.wgrad(qr(dgu), qr(rows)).to(wdt).contiguous() if need13 else None
    d_gate_up_bias = None if gate_up_bias is None or not need_b13 else groups.segment_sum(dgu).to(wdt)
    grad_rows = groups.mm(q(dgu, -1), q(gate_up_proj, -2))
    return GroupedMLPGrads(grad_rows, dw.to(row_weights.dtype), d_gate_up_proj, d_down_proj, d_gate_up_bias,
                           d_down_bias)


# --------------------------------------------------------------------------
# the routed experts: dispatch, MLP, fixed-order combine


@dataclass
class TorchSaved:
    schedule: Schedule
    rows: torch.Tensor  # the local expert rows, grouped by expert
    gate_up: torch.Tensor  # [N_local, 2I]
    h: torch.Tensor | None = None  # [N_local, I] act(gate_up); None: recomputed in backward


def combine_slots(slots: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y_t = sum_j w_tj * slots[t, j] in fp32 (or wider), j = 0..k-1 in order (reference.combine_slots)."""
    cdt = compute_dtype(slots.dtype)
    w = topk_weights.to(cdt)
    acc = w[:, 0:1] * slots[:, 0].to(cdt)
    for j in range(1, slots.shape[1]):
        acc = acc + w[:, j:j + 1] * slots[:, j].to(cdt)
    return acc.to(out_dtype)


def sum_slots(slots: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """sum_j slots[t, j], j = 0..k-1 in order, in fp32 (or wider) (reference.sum_slots)."""
    cdt = compute_dtype(slots.dtype)
    acc = slots[:, 0].to(cdt)
    for j in range(1, slots.shape[1]):
        acc = acc + slots[:, j].to(cdt)
    return acc.to(out_dtype)


def experts_forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None,
                    activation="swiglu", swiglu_limit=None, schedule: Schedule | None = None, precision="bf16"):
    """Routed experts (reference.experts_forward's function). Returns (y [T, H], TorchSaved)."""
    num_tokens, top_k = topk_ids.shape
    if schedule is None:
        schedule = build_schedule(topk_ids, gate_up_proj.shape[0], x.shape[1], down_proj.shape[2], x.dtype)
    rows = _to_rows(schedule, x[schedule.order // top_k])
    out, gate_up, h = mlp_forward(rows, schedule.groups, gate_up_proj, down_proj, gate_up_bias, down_bias,
                                  activation, swiglu_limit, precision)
    slots = _from_rows(schedule, out).view(num_tokens, top_k, out.shape[-1])
    return combine_slots(slots, topk_weights, x.dtype), TorchSaved(schedule, rows, gate_up, h)


def experts_backward(grad_y, saved: TorchSaved, x, topk_ids, topk_weights, gate_up_proj, down_proj,
                     gate_up_bias=None, down_bias=None, activation="swiglu", swiglu_limit=None, precision="bf16",
                     grads_into=None, needs=None):
    """Backward of experts_forward. Returns (dx, d_topk_weights, GroupedMLPGrads of the local experts); needs: which
    parameter gradients to compute (reference.param_grads_needed; None: all)."""
    num_tokens, top_k = topk_ids.shape
    schedule = saved.schedule
    dy_rows = _to_rows(schedule, grad_y.to(saved.rows.dtype)[schedule.order // top_k])
    w_rows = _to_rows(schedule, topk_weights.reshape(-1)[schedule.order])
    h = saved.h
    if h is None:
        h = activation_forward(saved.gate_up.to(compute_dtype(x.dtype)), activation, swiglu_limit).to(x.dtype)
    grads = mlp_backward(saved.rows, dy_rows, w_rows, saved.gate_up, h, schedule.groups, gate_up_proj, down_proj,
                         gate_up_bias, down_bias, activation, swiglu_limit, precision, needs)
    dx_slots = _from_rows(schedule, grads.grad_rows).view(num_tokens, top_k, saved.rows.shape[-1])
    dx = sum_slots(dx_slots, saved.rows.dtype)
    d_topk = _from_rows(schedule, grads.grad_weights).view(num_tokens, top_k)
    if grads_into is not None:
        grads = reference.add_param_grads(grads_into, grads)
    return dx, d_topk, grads
