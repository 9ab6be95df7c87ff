"""The local experts of the portable backend's expert parallelism on the fused one-GPU kernels.

Where the EP kernels cannot take a group (across hosts; MXFP8 over EP) the portable backend exchanges the rows
(torch_backend, torch_ep); each rank then holds its rows grouped by local expert (torch_backend.Groups, with the
bounded exchange's padding rows after them). These functions run those rows' MLP on cuda_backend's kernels: a
schedule of the rows (local_rows: each expert's rows at the start of its TILE_M-padded segment, in their
order), the gate/up and down GEMMs with the activation (cuda_backend.mlp_rows_forward), and in the backward
the dgrad with the activation backward, the weight gradients and the dgrad of gate/up, as the one-GPU path
runs them; the results go back in the rows' order. Bitwise what the one-GPU path gives on the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference
from .cuda_backend import (
    MX_ALONG_COLS, TILE_M, GemmOperands, Schedule, bias_rows, dgrad_down_act, grouped_gemm, mlp_rows_forward,
    mx_values, segment_sum, take_rows, weight_grad_of,
)  # fmt: skip


@dataclass
class LocalRows:
    """A schedule over N rows sorted by expert (rows past their expert's count are padding of the bounded
    exchange: no schedule row), and how the rows map to it."""

    sched: Schedule
    src: torch.Tensor  # [M_cap] int64: the row each schedule row takes (N: none, a zero row)
    dst: torch.Tensor  # [N] int64: each row's schedule row to read (padding rows: the last one, in an unused tile)
    valid: torch.Tensor  # [N] bool: not padding
    # [N] int64: where each row writes into a buffer of M_cap + N (padding rows: M_cap + their index, past the
    # schedule's rows, each its own: a scatter with no repeated index, deterministic)
    scatter_to: torch.Tensor

    def scatter(self, values: torch.Tensor, fill) -> torch.Tensor:
        """[M_cap] buffer of values [N] at their rows' schedule rows, fill elsewhere."""
        cap = self.src.shape[0]
        buf = torch.full((cap + values.shape[0],), fill, dtype=values.dtype, device=values.device)
        return buf.scatter_(0, self.scatter_to, values)[:cap]


def local_rows(expert: torch.Tensor, rank: torch.Tensor, counts: torch.Tensor) -> LocalRows:
    """LocalRows of N rows sorted by expert: expert / rank [N] each row's expert and place among its rows,
    counts [E] routed rows per expert (torch_backend.Groups' fields; on the device, no host read). Capacity: the
    worst case N + E (TILE_M - 1), rounded up, and one more tile that no expert owns (the padding rows' row)."""
    n, e = expert.shape[0], counts.shape[0]
    dev = expert.device
    cap = -(-(n + e * (TILE_M - 1)) // TILE_M) * TILE_M + TILE_M
    counts = counts.long()
    padded = (counts + TILE_M - 1) // TILE_M * TILE_M
    seg_end = torch.cumsum(padded, 0)
    valid = rank < counts.index_select(0, expert)
    row = torch.arange(n, device=dev)
    at = (seg_end - padded).index_select(0, expert) + rank
    dst = torch.where(valid, at, cap - 1)
    scatter_to = torch.where(valid, at, cap + row)
    src = torch.full((cap + n,), n, dtype=torch.int64, device=dev).scatter_(0, scatter_to, row)[:cap]
    tiles = torch.arange(0, cap, TILE_M, device=dev)
    tile_expert = torch.searchsorted(seg_end, tiles, right=True)
    tile_expert = torch.where(tile_expert < e, tile_expert, -1).to(torch.int32)
    sched = Schedule(dst.view(n, 1), src, tile_expert, seg_end.to(torch.int32), counts.to(torch.int32))
    return LocalRows(sched, src, dst, valid, scatter_to)


def local_mlp_forward(rows, lr: LocalRows, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
                      swiglu_limit, precision="bf16"):
    """(out [N, H], gate_up [M_cap, 2I] in schedule order): the experts' MLP of each row (unweighted; padding
    rows' out unspecified), on the kernels, as experts_forward computes it."""
    q = GemmOperands(precision)
    a = take_rows(mx_values(rows, MX_ALONG_COLS) if q.mxfp8 else rows, lr.src, tile_expert=lr.sched.tile_expert)
    out_rows, gate_up = mlp_rows_forward(a, lr.sched, gate_up_proj, down_proj, gate_up_bias, down_bias,
                                         activation, swiglu_limit, q)
    return out_rows.index_select(0, lr.dst), gate_up


def local_mlp_backward(rows, grad_out, row_weights, gate_up, lr: LocalRows, gate_up_proj, down_proj, gate_up_bias,
                       down_bias, activation, swiglu_limit, precision="bf16", needs=None):
    """torch_backend.mlp_backward's GroupedMLPGrads (grad_rows [N, H], grad_weights [N], parameter gradients) on the
    kernels: the backward of w * MLP(rows) with grad_out [N, H] the rows' d y (not scaled by w)."""
    q = GemmOperands(precision)
    need13, need2, need_b13, need_b2 = reference.param_grads_needed(needs)
    sched, wdt, dt = lr.sched, gate_up_proj.dtype, rows.dtype
    dy_rows = take_rows(grad_out.to(dt).contiguous(), lr.src, tile_expert=sched.tile_expert if down_bias is None
                        else None)
    w_rows = lr.scatter(row_weights.float(), 0.0)  # (0 on padding rows and past the segments)
    dy_a = take_rows(mx_values(grad_out.to(dt).contiguous(), MX_ALONG_COLS), lr.src,
                     tile_expert=sched.tile_expert) if q.mxfp8 else dy_rows
    dgu, wh, dw_rows = dgrad_down_act(dy_a, q.weight(down_proj, -2), gate_up, w_rows, sched, activation,
                                      swiglu_limit)
    del dy_a
    if down_bias is not None:
        dw_rows = dw_rows + (dy_rows.float() * bias_rows(down_bias, sched)).sum(dim=1)
    d_down_bias = None
    if down_bias is not None and need_b2:
        d_down_bias = segment_sum((w_rows.unsqueeze(1) * dy_rows.float()).to(dt), sched).to(down_bias.dtype)
    d_down = weight_grad_of(dy_rows, wh, sched, wdt, None, q) if need2 else None
    del dy_rows, wh
    dx_rows = grouped_gemm(q.rows(dgu), q.weight(gate_up_proj, -2), sched, transpose_w=True)
    grad_rows = dx_rows.index_select(0, lr.dst)
    del dx_rows
    d_gate_up_bias = None if gate_up_bias is None or not need_b13 else segment_sum(dgu, sched).to(gate_up_bias.dtype)
    d_gate_up = None
    if need13:
        x_rows = take_rows(rows, lr.src, tile_expert=sched.tile_expert)
        d_gate_up = weight_grad_of(dgu, x_rows, sched, wdt, None, q)
    grad_weights = dw_rows.index_select(0, lr.dst).to(row_weights.dtype)
    return reference.GroupedMLPGrads(grad_rows, grad_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias)
