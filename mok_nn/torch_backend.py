"""The portable backend: the routed experts from torch ops, on any device and dtype.

It computes the function of reference.py (same formulas, same saved tensors,
same fixed-order combine) but as a handful of batched ops instead of a Python
loop over experts:

- schedule: a stable sort of the flat expert ids groups the T*k routed rows by
  expert (row order inside an expert: ascending slot, as in the reference);
  per-expert row ranges come from searchsorted on the sorted ids; the inverse
  permutation is one scatter of the permutation (each position written once).
  Gathers are index_select (several times faster on CPU than advanced
  indexing). Everything stays on the device (no .item(), bincount, nonzero, boolean-mask indexing or
  tolist).
- grouped GEMMs: torch._grouped_mm over the expert row ranges; where it cannot
  run (float64, sizes whose rows are not 16-byte multiples) the same GEMMs run
  as one torch.bmm over rows padded per expert to a fixed capacity. At EP=1
  nothing is read back to the host on CPU and with bf16 on sm90 / sm100 GPUs;
  on other CUDA devices and dtypes torch._grouped_mm itself copies its offsets
  to the host once per GEMM (grouped_mm_reads_offsets_on_host).
- combine: y_t = sum_j w_tj * y_tj in fp32, j = 0..k-1 in order, as
  reference.combine_slots does; d x sums its k slots in the same order.
- elementwise work (the activation and its derivative, the combine) in few
  passes: each half of gate_up converted once, in-place updates of our own
  tensors, no torch.cat and no mixed-dtype ops (unvectorised on CPU).

Every slot is written once, by gathers with a permutation and its inverse;
nothing scatters with repeated indices and nothing is accumulated atomically,
so outputs and gradients are bitwise identical run to run, and
torch.use_deterministic_algorithms(True) leaves every op here allowed.

With 16-bit storage the GEMMs accumulate in fp32 but round their outputs to
the storage dtype (torch._grouped_mm returns its inputs' dtype), where the
reference keeps d h' in fp32 up to the top-k weight gradient and d gate_up:
the two agree within the storage dtype's rounding. In fp32 they agree within
fp32 rounding (only the order of sums inside a GEMM differs).

Expert parallelism: with MoKConfig.schedule_capacity_multiplier set (the
default) the bounded exchange (BoundedPlan: fixed blocks of C rows per peer,
the counts sent as data, nothing read on the host; an overflow makes the
outputs NaN and raises EPError at the next call or check_errors); with None
the reference's DispatchPlan (one all-to-all each way, split sizes read on the
host, as every EP baseline does). The local experts run the grouped GEMMs above.

precision="mxfp8": every GEMM operand is fake-quantised (mxfp8.fake_quantize_fast,
the values of mxfp8.fake_quantize) along the GEMM's reduction dimension
(docs/mxfp8.md); weight-gradient operands in blocks of 32 rows of each
expert's own rows, the last block zero-padded. Then the same grouped GEMMs. The weights' MXFP8 values are
cached per weight tensor and version (mxfp8.weight_values): quantised once while the weights do not change.
"""

from __future__ import annotations

import dataclasses
import functools

from dataclasses import dataclass, field

import torch

from . import mxfp8, reference, triton_ops
from .mxfp8 import fake_quantize_fast, row_chunks
from .reference import DispatchPlan, GroupedMLPGrads, compute_dtype
from .torch_ep import BoundedPlan, build_bounded_plan

_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PARAM_GRADS = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
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
    _mx_index: tuple | None = field(default=None, init=False, repr=False)
    _mx_blocks: tuple | None = field(default=None, init=False, repr=False)

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
        return out.reshape(-1, out.shape[-1]).index_select(0, self.expert * self.capacity + self.rank)

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
        return torch.where(valid[..., None], rows.index_select(0, src.reshape(-1)).view(e, c, -1), rows.new_zeros(()))

    # -- MXFP8 operands along the rows of each expert (weight-gradient GEMMs)
    def quantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """MXFP8 value of each row's elements in blocks of 32 consecutive rows of its expert (the last block of
        an expert zero-padded), as the reference quantises an expert's [rows, ...] operand along axis 0."""
        n = rows.shape[0]
        if n == 0:
            return rows
        if rows.dim() == 2 and triton_ops.runs_on(rows) and triton_ops.verified(
                ("fake_quantize_rows", rows.dtype), rows.device, lambda: self._quantize_rows_both(rows), exact=True):
            return triton_ops.fake_quantize_rows(rows, *self._mx_row_blocks(n, rows.device))  # CUDA: one pass
        return self._quantize_rows_torch(rows)

    def _quantize_rows_torch(self, rows: torch.Tensor) -> torch.Tensor:
        """quantize_rows in torch ops: a copy of the rows with every expert's padded to blocks of 32 by zero rows,
        quantised along the rows, each row gathered back."""
        src, back = self._mx_row_index(rows.shape[0], rows.device)
        buf = torch.cat([rows, rows.new_zeros(1, rows.shape[1])]).index_select(0, src)
        return fake_quantize_fast(buf, axis=0).index_select(0, back)

    def _quantize_rows_both(self, rows):
        """(the kernel's, the torch ops') quantize_rows of rows, on the rows of the experts (not padding rows)."""
        got = triton_ops.fake_quantize_rows(rows, *self._mx_row_blocks(rows.shape[0], rows.device))
        real = self.rank < self.counts.index_select(0, self.expert)
        return got[real], self._quantize_rows_torch(rows)[real]

    def _mx_blocks_of(self, n: int, device):
        """(block_start [E], block_end [E], block b [B], its expert [B]): the blocks of 32 rows of each expert
        (B a static bound on their count, (n + 31 E) / 32 rounded up; blocks past the last belong to none and
        carry the last expert)."""
        blocks = (self.counts + MX_BLOCK - 1) // MX_BLOCK
        block_end = torch.cumsum(blocks, 0)  # int: exact
        block_start = block_end - blocks
        b = torch.arange((n + (MX_BLOCK - 1) * self.num_experts + MX_BLOCK - 1) // MX_BLOCK, device=device)
        e = torch.searchsorted(block_end, b, right=True).clamp_(max=self.num_experts - 1)
        return block_start, block_end, b, e

    def _mx_row_blocks(self, n: int, device):
        """(row0, nrows) of triton_ops.fake_quantize_rows, computed once per Groups: per block of 32 rows of an
        expert (_mx_blocks_of) its first row and rows (0 past the last block)."""
        if self._mx_blocks is None:
            block_start, block_end, b, e = self._mx_blocks_of(n, device)
            within = (b - block_start.index_select(0, e)) * MX_BLOCK
            nrows = (self.counts.index_select(0, e) - within).clamp_(0, MX_BLOCK)
            nrows = torch.where(b < block_end[-1], nrows, 0)
            row0 = torch.where(nrows > 0, self.starts.index_select(0, e) + within, 0)
            self._mx_blocks = (row0.contiguous(), nrows.contiguous())
        return self._mx_blocks

    def _mx_row_index(self, n: int, device):
        """(src, back) of quantize_rows, computed once per Groups: src [P] the row each row of the padded
        buffer reads (n: the zero row appended; P = 32 x _mx_blocks_of's bound), back [n] each row's place in the
        buffer."""
        if self._mx_index is None:
            block_start, block_end, blocks, block_expert = self._mx_blocks_of(n, device)
            q = torch.arange(blocks.numel() * MX_BLOCK, device=device)
            b = q // MX_BLOCK
            e = block_expert.index_select(0, b)
            r = (b - block_start.index_select(0, e)) * MX_BLOCK + q % MX_BLOCK
            valid = (b < block_end[-1]) & (r < self.counts.index_select(0, e))
            # padding rows read the zero row n (a gather; torch.where over the rows is slow on CPU)
            src = torch.where(valid, (self.starts.index_select(0, e) + r).clamp_(0, n - 1), n)
            back = MX_BLOCK * block_start.index_select(0, self.expert) + self.rank
            self._mx_index = (src, back)
        return self._mx_index


def groups_from_sorted_ids(sorted_ids: torch.Tensor, num_experts: int, fused: bool, capacity: int,
                           padded: bool = False) -> Groups:
    """Groups of rows whose expert ids are sorted ascending (on the device, no host read). padded: the ids may
    end in padding rows of id num_experts (the bounded EP exchange); they lie past the last expert's end, so no
    GEMM group and no sum reads them, and their own outputs are unspecified (they are the last expert's as far as
    Groups.expert goes, placed past its rows)."""
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    starts = torch.searchsorted(sorted_ids, experts)
    ends = torch.searchsorted(sorted_ids, experts, right=True)
    expert = sorted_ids.clamp(max=num_experts - 1) if padded else sorted_ids
    rank = torch.arange(sorted_ids.shape[0], device=sorted_ids.device) - starts.index_select(0, expert)
    return Groups(starts, ends - starts, ends.to(torch.int32), expert, rank, capacity, fused)


def groups_from_counts(counts: list[int], device, fused: bool) -> Groups:
    """Groups from host row counts (the EP path, where the all-to-all split sizes are on the host already)."""
    c = torch.tensor(counts, dtype=torch.int64, device=device)
    ends = torch.cumsum(c, 0)
    n = sum(counts)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), c, output_size=n)
    rank = torch.arange(n, device=device) - (ends - c).index_select(0, expert)
    return Groups(ends - c, c, ends.to(torch.int32), expert, rank, max(counts, default=0), fused)


# --------------------------------------------------------------------------
# the schedule


@dataclass
class Schedule:
    """order: [T*k] slot ids sorted by expert (stable), the rows' send order; inverse: [T*k] position of each slot
    in that order; groups: the local expert rows; plan: the EP dispatch plan (None at EP=1, where the rows are
    the sorted slots themselves); token: [T*k] order // k, the token of each row in send order (None: computed
    where needed)."""

    order: torch.Tensor
    inverse: torch.Tensor
    groups: Groups
    plan: DispatchPlan | None
    token: torch.Tensor | None = None

    def token_of_rows(self, top_k: int) -> torch.Tensor:
        return self.token if self.token is not None else self.order // top_k


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[i]] = i: one scatter of a permutation (every position written once; cheaper than argsort)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


def build_schedule(topk_ids: torch.Tensor, num_experts: int, hidden_size: int, intermediate_size: int,
                   dtype: torch.dtype, group=None, signature: dict | None = None,
                   capacity_multiplier: float | None = None, ep_state: dict | None = None) -> Schedule:
    """The schedule of one call. With a group: capacity_multiplier and ep_state (the workspace's EP state, a dict)
    given, the bounded exchange (BoundedPlan, no host read); otherwise the reference's DispatchPlan (split sizes
    read on the host)."""
    sizes = (hidden_size, intermediate_size)
    fused = use_grouped_mm(topk_ids.device, dtype, sizes)
    top_k = topk_ids.shape[1]
    if group is not None and capacity_multiplier is not None and ep_state is not None:
        plan = build_bounded_plan(topk_ids, num_experts, group, capacity_multiplier, ep_state, signature)
        e_l = num_experts // plan.world
        groups = groups_from_sorted_ids(plan.local_ids, e_l, fused, capacity=plan.local_ids.shape[0], padded=True)
        return Schedule(plan.order, inverse_permutation(plan.order), groups, plan, plan.order // top_k)
    if group is not None:
        plan = reference.build_dispatch_plan(topk_ids, num_experts, group, signature)
        groups = groups_from_counts(plan.local.counts, topk_ids.device, fused)
        return Schedule(plan.order, inverse_permutation(plan.order), groups, plan, plan.order // top_k)
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    groups = groups_from_sorted_ids(sorted_ids, num_experts, fused, capacity=flat.shape[0])
    return Schedule(order, inverse_permutation(order), groups, None, order // top_k)


def _to_rows(schedule: Schedule, t: torch.Tensor) -> torch.Tensor:
    """Per-slot values in send order -> the local expert rows (the dispatch all-to-all at EP > 1)."""
    return t if schedule.plan is None else schedule.plan.dispatch(t)


def _dispatch_mxfp8(schedule: Schedule, t: torch.Tensor, top_k: int) -> torch.Tensor:
    """t's token rows [T, H] to the local expert rows as MXFP8 bytes (E4M3 data and E8M0 scales along H: H + H/32
    bytes a row instead of 2H in bf16), dequantised on arrival in t.dtype: the rows' MXFP8 values along H, the
    same bits as quantising the rows there. Only where nothing but GEMMs taking them along H reads the rows (no
    weight gradient of theirs, no bias term)."""
    q = mxfp8.quantize(t, axis=-1)
    tok = schedule.token_of_rows(top_k)
    data = _to_rows(schedule, q.data.view(torch.uint8).index_select(0, tok))
    scale = _to_rows(schedule, q.scale.index_select(0, tok))
    return mxfp8.dequantize(mxfp8.MXFP8Tensor(data.view(torch.float8_e4m3fn), scale, 1), t.dtype)


def _dy_rows(grad_y, schedule: Schedule, dt, top_k: int, precision: str, needs, down_bias) -> torch.Tensor:
    """d y's rows in the local expert rows' order (dispatched to the expert ranks as MXFP8 bytes where only GEMMs
    taking them along H read them: precision="mxfp8" with no d W2 and no down bias term)."""
    if (precision == "mxfp8" and schedule.plan is not None and not reference.param_grads_needed(needs)[1]
            and down_bias is None):
        return _dispatch_mxfp8(schedule, grad_y.to(dt), top_k)
    return _to_rows(schedule, grad_y.to(dt).index_select(0, schedule.token_of_rows(top_k)))


def _from_rows(schedule: Schedule, rows: torch.Tensor) -> torch.Tensor:
    """Local expert rows -> per-slot values in slot order t*k + j."""
    if isinstance(schedule.plan, BoundedPlan):
        return schedule.plan.undispatch_to_slots(rows, schedule.inverse)
    if schedule.plan is not None:
        rows = schedule.plan.undispatch(rows)
    return rows.index_select(0, schedule.inverse)


# --------------------------------------------------------------------------
# the activation and its derivative, in few passes
#
# reference.activation_forward / activation_backward on gate_up converted to the compute dtype, the result
# rounded once to the storage dtype: the same fp32 operations in the same order, but converting gate and up
# separately (no copy of gate_up, no torch.cat), updating in place where a tensor is ours, and without
# mixed-dtype ops (which torch runs unvectorised on CPU, 2-15x slower than a conversion and the op). torch's
# vectorised sigmoid / silu may round differently from its scalar tail loop, which depends on the tensors'
# layout: where I is not a multiple of the SIMD width the two differ in the last bit of a few values.


def _halves(gate_up: torch.Tensor, limit):
    """(gate, up, gate_ok, up_ok) as reference._clamp_masks, in the compute dtype; gate is a fresh tensor (ours
    to update in place), up too where clamped (else it may be a view of gate_up)."""
    cdt = compute_dtype(gate_up.dtype)
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter].to(cdt, copy=True)
    up = gate_up[..., inter:].to(cdt, copy=limit is not None)
    if limit is None:
        return gate, up, None, None
    gate_ok = gate <= limit
    up_ok = (up >= -limit) & (up <= limit)
    return gate.clamp_(max=limit), up.clamp_(-limit, limit), gate_ok, up_ok


def _plus_one(up: torch.Tensor, fresh: bool) -> torch.Tensor:
    """up + 1, a fresh tensor (in place where up is one already)."""
    return up.add_(1) if fresh else up + 1


def activation_forward(gate_up: torch.Tensor, activation: str, swiglu_limit) -> torch.Tensor:
    """reference.activation_forward(gate_up.to(cdt), ...).to(gate_up.dtype) (see above), in row chunks."""
    inter = gate_up.shape[-1] // 2
    gate_up2 = gate_up.reshape(-1, 2 * inter)
    if _triton_forward_ok(gate_up2, activation, swiglu_limit):  # CUDA: one kernel (the chunks below: a dozen passes)
        return triton_ops.activation_forward(gate_up2, activation, swiglu_limit).view(gate_up.shape[:-1] + (inter,))
    h = torch.empty(gate_up2.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    cdt = compute_dtype(gate_up.dtype)
    for a, b in row_chunks(gate_up2.shape[0], inter * torch.empty((), dtype=cdt).element_size(), gate_up.device):
        h[a:b].copy_(_activation_forward(gate_up2[a:b], activation, swiglu_limit))
    return h.view(gate_up.shape[:-1] + (inter,))


def activation_backward(gate_up: torch.Tensor, grad_h: torch.Tensor, activation: str, swiglu_limit) -> torch.Tensor:
    """reference.activation_backward(gate_up.to(cdt), grad_h, ...).to(gate_up.dtype) (see above), in row chunks.
    grad_h: in the compute dtype, read only."""
    inter = gate_up.shape[-1] // 2
    gate_up2, grad_h2 = gate_up.reshape(-1, 2 * inter), grad_h.reshape(-1, inter)
    out = torch.empty(gate_up2.shape, dtype=gate_up.dtype, device=gate_up.device)
    for a, b in row_chunks(gate_up2.shape[0], inter * grad_h.element_size(), gate_up.device):
        _activation_backward(gate_up2[a:b], grad_h2[a:b], activation, swiglu_limit, out[a:b])
    return out.view(gate_up.shape)


def _activation_forward(gate_up: torch.Tensor, activation: str, swiglu_limit) -> torch.Tensor:
    """act(gate_up) in the compute dtype (rows of gate_up in its storage dtype)."""
    gate, up, _, _ = _halves(gate_up, swiglu_limit)
    if activation == "swiglu":  # silu(gate) * up
        h = torch.nn.functional.silu(gate, inplace=True).mul_(up)
    elif activation == "swiglu_oai":  # (up + 1) * gate * sigmoid(alpha * gate)
        sig = torch.mul(gate, reference.OAI_ALPHA).sigmoid_()
        h = _plus_one(up, swiglu_limit is not None).mul_(gate).mul_(sig)
    else:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    return h


def _activation_backward(gate_up, grad_h, activation: str, swiglu_limit, out) -> None:
    """d act / d [gate | up] applied to grad_h, stored (rounded once) into out [rows, 2I]."""
    gate, up, gate_ok, up_ok = _halves(gate_up, swiglu_limit)
    inter = gate.shape[-1]
    if activation == "swiglu":
        sig = torch.sigmoid(gate)
        d_act = torch.rsub(sig, 1).mul_(gate).add_(1).mul_(sig)  # sig * (1 + gate * (1 - sig))
        d_gate = torch.mul(grad_h, up)  # grad_h * up * d_act
    elif activation == "swiglu_oai":
        sig = torch.mul(gate, reference.OAI_ALPHA).sigmoid_()
        # sig * (1 + alpha * gate * (1 - sig))
        d_act = torch.mul(gate, reference.OAI_ALPHA).mul_(torch.rsub(sig, 1)).add_(1).mul_(sig)
        d_gate = _plus_one(up, swiglu_limit is not None).mul_(grad_h)  # grad_h * (up + 1) * d_act
    else:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    d_gate.mul_(d_act)
    d_up = gate.mul_(sig).mul_(grad_h)  # grad_h * (gate * sig)
    if gate_ok is not None:
        d_gate.mul_(gate_ok)
        d_up.mul_(up_ok)
    out[..., :inter] = d_gate
    out[..., inter:] = d_up


# --------------------------------------------------------------------------
# the expert MLP on grouped rows


def _quantizer(precision: str, mxfp8_fn=fake_quantize_fast):
    """(tensor, axis) -> the GEMM operand: itself in bf16, its MXFP8 values along axis (mxfp8_fn) in mxfp8."""
    if precision == "bf16":
        return lambda t, axis: t
    if precision == "mxfp8":
        return mxfp8_fn
    raise ValueError(f"precision must be 'bf16' or 'mxfp8', got {precision!r}")


def _row_quantizer(precision: str, groups: Groups):
    return (lambda t: t) if precision == "bf16" else groups.quantize_rows


def _add_bias(t, bias, groups, cdt):
    if bias is None:
        return t
    return (t.to(cdt) + bias.to(cdt).index_select(0, groups.expert)).to(t.dtype)


def mlp_forward(rows, groups: Groups, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit,
                precision="bf16"):
    """rows [N, H] grouped by expert -> (out [N, H], gate_up [N, 2I], h [N, I]), all in rows.dtype (what backward
    needs: gate_up, and h where the backward's rows kernel does not make it again, experts_forward)."""
    cdt = compute_dtype(rows.dtype)
    q, qw = _quantizer(precision), _quantizer(precision, mxfp8.weight_values)
    gate_up = _add_bias(groups.mm(q(rows, -1), qw(gate_up_proj, -1).transpose(1, 2)), gate_up_bias, groups, cdt)
    h = activation_forward(gate_up, activation, swiglu_limit)
    out = _add_bias(groups.mm(q(h, -1), qw(down_proj, -1).transpose(1, 2)), down_bias, groups, cdt)
    return out, gate_up, h


def _triton_forward_ok(gate_up, activation, swiglu_limit) -> bool:
    """triton_ops.activation_forward runs here (checked once against _activation_forward, triton_ops.verified)."""
    s = slice(0, 8)
    return triton_ops.runs_on(gate_up) and triton_ops.verified(
        ("activation_forward", gate_up.dtype, activation, swiglu_limit is None), gate_up.device,
        lambda: (triton_ops.activation_forward(gate_up[s], activation, swiglu_limit),
                 _activation_forward(gate_up[s], activation, swiglu_limit).to(gate_up.dtype)), exact=False)


def _triton_backward_ok(gate_up, dh_raw, row_weights, activation, swiglu_limit, write_wh) -> bool:
    """triton_ops.mlp_backward_rows runs here (checked once against _mlp_backward_rows, triton_ops.verified)."""
    s = slice(0, 8)

    def pair():  # (the torch ops given the forward kernel's h, which the kernel makes again)
        h = triton_ops.activation_forward(gate_up[s], activation, swiglu_limit)
        return (triton_ops.mlp_backward_rows(gate_up[s], dh_raw[s], row_weights[s], activation, swiglu_limit, write_wh),
                _mlp_backward_rows(None, row_weights[s], gate_up[s], h, dh_raw[s].clone(), None, None, activation,
                                   swiglu_limit, write_wh))

    return triton_ops.runs_on(gate_up) and triton_ops.verified(
        ("mlp_backward_rows", gate_up.dtype, activation, swiglu_limit is None, write_wh), gate_up.device, pair,
        exact=False)


def _down_bias_dw(grad_out, b2, expert, cdt):
    """The down bias's term of the rows' top-k weight gradient: <d y, b2 of the row's expert> in cdt."""
    return (grad_out.to(cdt) * b2.index_select(0, expert)).sum(dim=1)


def _mlp_backward_rows(grad_out, row_weights, gate_up, h, dh_raw, groups: Groups, b2, activation, swiglu_limit,
                       need_wh: bool, dgu_out=None):
    """(dw, w h or None, d gate_up) of the rows in torch ops, a chunk of rows at a time (mlp_backward). dgu_out:
    where d gate_up goes (gate_up itself may: each chunk reads its rows of it before writing them)."""
    n, inter = h.shape
    cdt = compute_dtype(h.dtype)
    dw = torch.empty(n, dtype=cdt, device=h.device)
    wh = torch.empty_like(h) if need_wh else None
    dgu = torch.empty(n, 2 * inter, dtype=h.dtype, device=h.device) if dgu_out is None else dgu_out
    for a, b in row_chunks(n, inter * torch.empty((), dtype=cdt).element_size(), h.device):
        w = row_weights[a:b].to(cdt).unsqueeze(1)
        dh = dh_raw[a:b].to(cdt)  # (in fp32 a view of the fresh GEMM output: ours to update)
        h32 = h[a:b].to(cdt)
        dw_c = (dh * h32).sum(dim=1)
        if b2 is not None:
            dw_c = dw_c + _down_bias_dw(grad_out[a:b], b2, groups.expert[a:b], cdt)
        dw[a:b] = dw_c
        if wh is not None:
            wh[a:b] = w * h32  # (w * h) rounded to dt
        _activation_backward(gate_up[a:b], dh.mul_(w), activation, swiglu_limit, dgu[a:b])  # d h = w * d h'
    return dw, wh, dgu


def mlp_backward(rows, grad_out, row_weights, gate_up, h, groups: Groups, gate_up_proj, down_proj, gate_up_bias,
                 down_bias, activation, swiglu_limit, precision="bf16", needs=None, consume=False,
                 finish_rows=None) -> GroupedMLPGrads:
    """Backward of w * MLP(rows) (reference.grouped_mlp_backward's formulas), rows grouped by expert. needs: the
    parameter gradients to compute (reference.param_grads_needed); the others are None, their GEMMs not run.

    Peak memory: the steps run in the order that frees each operand soonest (d h', then the rows' activation
    terms, d down_proj, the rows' gradient, d gate_up_proj), so a caller that holds no reference to grad_out has
    it freed after d down_proj. h: the forward's activation, or None where it kept none (the rows kernel makes it
    again; the torch ops here). consume: gate_up is this call's to overwrite (d gate_up takes its buffer).
    finish_rows: applied to the rows' gradient as soon as it exists (the caller sums it into d x), before the
    gate/up weight's gradient is allocated, so the two are never held together; grad_rows is what it returns."""
    need13, need2, need_b13, need_b2 = reference.param_grads_needed(needs)
    dt, wdt = rows.dtype, gate_up_proj.dtype
    cdt = compute_dtype(dt)
    q, qw, qr = _quantizer(precision), _quantizer(precision, mxfp8.weight_values), _row_quantizer(precision, groups)
    dh_raw = groups.mm(q(grad_out, -1), qw(down_proj, -2))  # d h' rows, rounded to dt by the GEMM
    n, inter = dh_raw.shape
    b2 = None if down_bias is None else down_bias.to(cdt)
    dgu_out = gate_up if consume and gate_up.is_contiguous() else None
    if _triton_backward_ok(gate_up, dh_raw, row_weights, activation, swiglu_limit, need2):  # CUDA: one kernel
        dw, wh, dgu = triton_ops.mlp_backward_rows(gate_up, dh_raw, row_weights, activation, swiglu_limit, need2,
                                                   dgu_out)
        if b2 is not None:
            for a, b in row_chunks(n, inter * torch.empty((), dtype=cdt).element_size(), dh_raw.device):
                dw[a:b] += _down_bias_dw(grad_out[a:b], b2, groups.expert[a:b], cdt)
    else:
        if h is None:
            h = activation_forward(gate_up, activation, swiglu_limit)
        dw, wh, dgu = _mlp_backward_rows(grad_out, row_weights, gate_up, h, dh_raw, groups, b2, activation,
                                         swiglu_limit, need2, dgu_out)
    del dh_raw, h
    d_down_bias = None if down_bias is None or not need_b2 else groups.segment_sum(grad_out, row_weights).to(wdt)
    d_down_proj = groups.wgrad(qr(grad_out), qr(wh)).to(wdt).contiguous() if need2 else None
    del grad_out, wh
    grad_rows = groups.mm(q(dgu, -1), qw(gate_up_proj, -2))
    if finish_rows is not None:
        grad_rows = finish_rows(grad_rows)
    d_gate_up_proj = groups.wgrad(qr(dgu), qr(rows)).to(wdt).contiguous() if need13 else None
    d_gate_up_bias = None if gate_up_bias is None or not need_b13 else groups.segment_sum(dgu).to(wdt)
    return GroupedMLPGrads(grad_rows, dw.to(row_weights.dtype), d_gate_up_proj, d_down_proj, d_gate_up_bias,
                           d_down_bias)


# --------------------------------------------------------------------------
# the routed experts: dispatch, MLP, fixed-order combine


@dataclass
class TorchSaved:
    schedule: Schedule
    rows: torch.Tensor  # the local expert rows, grouped by expert
    gate_up: torch.Tensor  # [N_local, 2I]; with local kernels [M_cap, 2I] in their schedule's order
    h: torch.Tensor | None = None  # [N_local, I] act(gate_up); None: made again in backward (CUDA: by its kernel)
    local: object = None  # cuda_local.LocalRows where the local experts ran on the kernels


def combine_slots(slots, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y_t = sum_j w_tj * slots[t, j] in fp32 (or wider), j = 0..k-1 in order, the sums of reference.combine_slots
    (which adds the first product to +0: a -0 result reads +0 there): per chunk of tokens the k products in one
    multiply, then k - 1 adds in order. slots: [T, k, H], a tensor or GatheredSlots."""
    cdt = compute_dtype(slots.dtype)
    w = topk_weights.to(cdt).unsqueeze(2)
    return _sum_in_order(slots, out_dtype, lambda a, b: slots[a:b].to(cdt) * w[a:b])


def sum_slots(slots, out_dtype: torch.dtype) -> torch.Tensor:
    """sum_j slots[t, j], j = 0..k-1 in order, in fp32 (or wider) (reference.sum_slots's sums). slots: [T, k, H], a
    tensor or GatheredSlots."""
    cdt = compute_dtype(slots.dtype)
    return _sum_in_order(slots, out_dtype, lambda a, b: slots[a:b].to(cdt))


def _sum_in_order(slots, out_dtype: torch.dtype, terms) -> torch.Tensor:
    """((s_0 + s_1) + s_2) + ... over dim 1 of terms(a, b) (the slots of tokens [a, b) in the compute dtype), per
    chunk of tokens, stored in out_dtype."""
    num_tokens, k, hidden = slots.shape
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=slots.device)
    cdt = compute_dtype(slots.dtype)
    for a, b in row_chunks(num_tokens, k * hidden * torch.empty((), dtype=cdt).element_size(), slots.device):
        t = terms(a, b)
        acc = t[:, 0] if k == 1 else t[:, 0] + t[:, 1]
        for j in range(2, k):
            acc.add_(t[:, j])
        out[a:b] = acc
    return out


class GatheredSlots:
    """The slots [T, k, H] of rows in send order at EP = 1, read a chunk of tokens at a time (slots[a:b]: one
    index_select of their k rows each), so the sums never hold a whole [T*k, H] copy of the rows."""

    def __init__(self, rows: torch.Tensor, inverse: torch.Tensor, num_tokens: int, top_k: int):
        self.rows, self.inverse = rows, inverse
        self.shape = (num_tokens, top_k, rows.shape[-1])
        self.dtype, self.device = rows.dtype, rows.device

    def __getitem__(self, tokens: slice) -> torch.Tensor:
        a, b, k = tokens.start, tokens.stop, self.shape[1]
        return self.rows.index_select(0, self.inverse[a * k:b * k]).view(b - a, k, self.shape[2])


def _slots(schedule: Schedule, rows: torch.Tensor, num_tokens: int, top_k: int):
    """The per-slot values [T, k, H] of the local expert rows (_from_rows): at EP = 1 gathered by chunk, with an
    exchange its result."""
    if schedule.plan is None:
        return GatheredSlots(rows, schedule.inverse, num_tokens, top_k)
    return _from_rows(schedule, rows).view(num_tokens, top_k, rows.shape[-1])


def experts_forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, gate_up_bias=None, down_bias=None,
                    activation="swiglu", swiglu_limit=None, schedule: Schedule | None = None, precision="bf16",
                    local_kernels: bool = False, needs=None):
    """Routed experts (reference.experts_forward's function). Returns (y [T, H], TorchSaved). local_kernels: the
    local experts' MLP on the fused one-GPU kernels (cuda_local.local_mlp_forward), the exchange and the
    combine as here (expert parallelism across hosts on Hopper). needs: the parameter gradients the backward
    will compute (reference.param_grads_needed): where the gate/up weights get none, precision="mxfp8" sends
    the token rows to the expert ranks as MXFP8 bytes (_dispatch_mxfp8)."""
    num_tokens, top_k = topk_ids.shape
    if schedule is None:
        schedule = build_schedule(topk_ids, gate_up_proj.shape[0], x.shape[1], down_proj.shape[2], x.dtype)
    if precision == "mxfp8" and schedule.plan is not None and not reference.param_grads_needed(needs)[0]:
        rows = _dispatch_mxfp8(schedule, x, top_k)
    else:
        rows = _to_rows(schedule, x.index_select(0, schedule.token_of_rows(top_k)))
    mlp_args = (gate_up_proj, down_proj, gate_up_bias, down_bias, activation, swiglu_limit, precision)
    local = None
    if local_kernels:
        from . import cuda_local

        g = schedule.groups
        local = cuda_local.local_rows(g.expert, g.rank, g.counts)
        out, gate_up = cuda_local.local_mlp_forward(rows, local, *mlp_args)
        h = None
    else:
        out, gate_up, h = mlp_forward(rows, schedule.groups, *mlp_args)
        if triton_ops.runs_on(gate_up):  # the backward's rows kernel makes h again: not kept (peak memory)
            h = None
    y = combine_slots(_slots(schedule, out, num_tokens, top_k), topk_weights, x.dtype)
    if isinstance(schedule.plan, BoundedPlan):
        y = schedule.plan.poison(y)
    return y, TorchSaved(schedule, rows, gate_up, h, local)


def experts_backward(grad_y, saved: TorchSaved, x, topk_ids, topk_weights, gate_up_proj, down_proj,
                     gate_up_bias=None, down_bias=None, activation="swiglu", swiglu_limit=None, precision="bf16",
                     grads_into=None, needs=None, consume_saved=False):
    """Backward of experts_forward. Returns (dx, d_topk_weights, GroupedMLPGrads of the local experts, grad_rows
    None: summed into dx); needs: which parameter gradients to compute (reference.param_grads_needed; None: all).
    consume_saved: nothing reads saved after this call (autograd keeps no graph), so d gate_up takes the saved
    gate_up's buffer (peak memory; the same results)."""
    num_tokens, top_k = topk_ids.shape
    schedule = saved.schedule
    dt = saved.rows.dtype
    w_rows = _to_rows(schedule, topk_weights.reshape(-1).index_select(0, schedule.order))

    def to_dx(grad_rows):
        return sum_slots(_slots(schedule, grad_rows, num_tokens, top_k), dt)

    # (d y's rows are passed on, not held here: mlp_backward frees them after d down_proj)
    if saved.local is not None:
        from . import cuda_local

        grads = cuda_local.local_mlp_backward(saved.rows, _dy_rows(grad_y, schedule, dt, top_k, precision, needs,
                                                                   down_bias), w_rows, saved.gate_up, saved.local,
                                                gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
                                                swiglu_limit, precision, needs)
        dx = to_dx(grads.grad_rows)
    else:
        grads = mlp_backward(saved.rows, _dy_rows(grad_y, schedule, dt, top_k, precision, needs, down_bias), w_rows,
                             saved.gate_up, saved.h, schedule.groups, gate_up_proj, down_proj, gate_up_bias, down_bias,
                             activation, swiglu_limit, precision, needs, consume=consume_saved, finish_rows=to_dx)
        dx = grads.grad_rows
    grads = dataclasses.replace(grads, grad_rows=None)
    d_topk = _from_rows(schedule, grads.grad_weights).view(num_tokens, top_k)
    if isinstance(schedule.plan, BoundedPlan):  # a flagged step: every output NaN, the expert gradients too
        bad = schedule.plan.poison
        dx, d_topk = bad(dx), bad(d_topk)
        grads = dataclasses.replace(grads, **{name: bad(getattr(grads, name)) for name in _PARAM_GRADS
                                              if getattr(grads, name) is not None})
    if grads_into is not None:
        grads = reference.add_param_grads(grads_into, grads)
    return dx, d_topk, grads
