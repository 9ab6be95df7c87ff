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
    TILE_M, GemmOperands, Schedule, mlp_rows_backward, mlp_rows_forward, take_rows,
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

    def gather(self, t: torch.Tensor, skip_tail: bool = True, mx: bool = False) -> torch.Tensor:
        """t's rows [N, K] in schedule order, zero on padding rows (skip_tail: past the last segment unwritten; mx:
        of t's MXFP8 values along K, take_rows)."""
        return take_rows(t, self.src, tile_expert=self.sched.tile_expert if skip_tail else None, mx=mx)

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
    out_rows, gate_up = mlp_rows_forward([lr.gather(rows, mx=q.mxfp8)], lr.sched, gate_up_proj, down_proj,
                                         gate_up_bias, down_bias, activation, swiglu_limit, q)
    return out_rows.index_select(0, lr.dst), gate_up


def local_mlp_backward(rows, grad_out, row_weights, gate_up, lr: LocalRows, gate_up_proj, down_proj, gate_up_bias,
                       down_bias, activation, swiglu_limit, precision="bf16", needs=None):
    """torch_backend.mlp_backward's GroupedMLPGrads (grad_rows [N, H], grad_weights [N], parameter gradients) on the
    kernels: the backward of w * MLP(rows) with grad_out [N, H] the rows' d y (not scaled by w)."""
    grad_rows, dw_rows, *param = mlp_rows_backward(
        grad_out.to(rows.dtype).contiguous(), lr.gather, lr.scatter(row_weights.float(), 0.0), gate_up,
        rows, lr.sched, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
        swiglu_limit, GemmOperands(precision), needs, (None, None), lambda dx_rows: dx_rows.index_select(0, lr.dst),
    )  # fmt: skip
    grad_weights = dw_rows.index_select(0, lr.dst).to(row_weights.dtype)
    return reference.GroupedMLPGrads(grad_rows, grad_weights, *param)
