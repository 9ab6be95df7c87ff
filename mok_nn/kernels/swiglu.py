"""Activation of the expert rows, forward and backward.

Forward:  h[r, i] = act(gate_up[r, i], gate_up[r, I + i])             (bf16 out, fp32 math)
Backward: with h recomputed and rounded to bf16 as in the forward,
          dw[r]        = sum_i dh[r, i] * h[r, i]                      (the top-k weight gradient)
          dgate, dup   = act'(gate, up) * (w[r] * dh[r, i])            (bf16 out)
act: "swiglu"      silu(g) * u
     "swiglu_oai"  (u + 1) * g * sigmoid(1.702 g)
both with g = min(g, L), u = clamp(u, -L, L) first (L = +inf when no limit);
the derivative is zero where a clamp was active.

One warp per row. Rows whose tile belongs to no expert (tile_expert < 0, the
unused tail of the schedule) are skipped. The row sum of the backward is
reduced in a fixed order (per-lane partials in column order, then a warp
butterfly), so it is bitwise reproducible. With mx set, the backward stores d
gate_up's MXFP8 values along its columns (precision="mxfp8": the d x GEMM's
operand, the bits of mok_mx_quant's mode 0), each block of 32 columns held by
four adjacent lanes: no pass over d gate_up afterwards.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .mx_quant import mx_values_of_lane_block
from .registry import TILE_M

VEC = 8
THREADS = 128
ROWS_PER_CTA = THREADS // 32  # one warp per row
OAI_ALPHA = 1.702


def _act(kind: str, g, u, limit):
    """(h, d h / d g, d h / d u) at fp32 scalars, after clamping.

    The sigmoid uses ex2.approx and rcp.approx (a few ulp of fp32, far below the bf16 rounding of
    the outputs): the precise expf and IEEE division took ~3x the instructions, which made the
    activation the slowest part of the dSwiGLU GEMM epilogue (grouped_gemm.VarlenMGroupedGemmDact)."""
    g_ok = g <= limit
    u_ok = (u >= -limit) & (u <= limit)
    g = cute.arch.fmin(g, limit)
    u = cute.arch.fmax(cute.arch.fmin(u, limit), -limit)
    if cutlass.const_expr(kind == "swiglu"):
        sig = cute.arch.rcp_approx(1.0 + cute.math.exp(-g, fastmath=True))
        glu = g * sig
        h = glu * u
        dg = u * sig * (1.0 + g * (1.0 - sig))
        du = glu
    else:
        sig = cute.arch.rcp_approx(1.0 + cute.math.exp(-OAI_ALPHA * g, fastmath=True))
        glu = g * sig
        h = (u + 1.0) * glu
        dg = (u + 1.0) * sig * (1.0 + OAI_ALPHA * g * (1.0 - sig))
        du = glu
    dg = cutlass.Float32(cutlass.select_(g_ok, dg, cutlass.Float32(0.0)))
    du = cutlass.Float32(cutlass.select_(u_ok, du, cutlass.Float32(0.0)))
    return h, dg, du


@cute.jit
def act_piece(kind: cutlass.Constexpr, gate: cute.Tensor, up: cute.Tensor, out: cute.Tensor, f_g: cute.Tensor,
              f_u: cute.Tensor, f_h: cute.Tensor, f_hq: cute.Tensor, limit: cutlass.Float32, h_mx=0):
    """h = act(gate, up) of one 16-byte piece (gate, up: VEC bf16 values in memory) into out, through registers
    f_g, f_u (gate / up dtype), f_h (fp32) and f_hq (out's dtype). h_mx != 0: h's MXFP8 values instead, the piece
    one lane's of a 32-column block that four adjacent lanes hold (mx_values_of_lane_block: every lane of the
    warp takes part)."""
    cute.autovec_copy(gate, f_g)
    cute.autovec_copy(up, f_u)
    for v in cutlass.range_constexpr(cute.size(f_h)):
        hv, _, _ = _act(kind, f_g[v].to(cutlass.Float32), f_u[v].to(cutlass.Float32), limit)
        f_h[v] = hv
    f_hq.store(f_h.load().to(f_hq.element_type))
    if h_mx != 0:
        mx_values_of_lane_block(f_hq, f_h, True)
    cute.autovec_copy(f_hq, out)


class ActForward:
    def __init__(self, kind: str):
        self.kind = kind

    @cute.jit
    def __call__(
        self,
        gate_up: cute.Tensor,  # (M, 2I) bf16
        h: cute.Tensor,  # (M, I) bf16
        tile_expert: cute.Tensor,  # (M / TILE_M,) int32
        limit: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        rows = cute.size(h, mode=[0])
        grid = (rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        self.kernel(gate_up, h, tile_expert, limit).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, gate_up: cute.Tensor, h: cute.Tensor, tile_expert: cute.Tensor, limit: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        r = bidx * ROWS_PER_CTA + tidx // 32
        if tile_expert[r // TILE_M] >= 0:
            inter = cute.size(h, mode=[1])
            gu_v = cute.zipped_divide(gate_up[(r, None)], (VEC,))
            h_v = cute.zipped_divide(h[(r, None)], (VEC,))
            n_vec = inter // VEC
            fg = cute.make_rmem_tensor((VEC,), gate_up.element_type)
            fu = cute.make_rmem_tensor((VEC,), gate_up.element_type)
            acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            res = cute.make_rmem_tensor((VEC,), h.element_type)
            for c in range(lane, n_vec, 32):
                act_piece(self.kind, gu_v[(None, c)], gu_v[(None, c + n_vec)], h_v[(None, c)], fg, fu, acc, res, limit)


class ActBackward:
    def __init__(self, kind: str):
        self.kind = kind

    @cute.jit
    def __call__(
        self,
        gate_up: cute.Tensor,  # (M, 2I) bf16
        dh: cute.Tensor,  # (M, I) fp32: dy @ W2[e], not yet scaled by w
        w: cute.Tensor,  # (M,) fp32 top-k weight of each row
        dgate_up: cute.Tensor,  # (M, 2I) bf16 out
        wh: cute.Tensor,  # (M, I) bf16 out: w[r] * h[r], input of the down-proj weight gradient
        dw: cute.Tensor,  # (M,) fp32 out
        tile_expert: cute.Tensor,  # (M / TILE_M,) int32
        limit: cutlass.Float32,
        mx: cutlass.Int32,  # 1: d gate_up as its MXFP8 values along its columns (I % 32 == 0)
        stream: cuda.CUstream,
    ):
        rows = cute.size(dh, mode=[0])
        grid = (rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        self.kernel(gate_up, dh, w, dgate_up, wh, dw, tile_expert, limit, mx).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        gate_up: cute.Tensor,
        dh: cute.Tensor,
        w: cute.Tensor,
        dgate_up: cute.Tensor,
        wh: cute.Tensor,
        dw: cute.Tensor,
        tile_expert: cute.Tensor,
        limit: cutlass.Float32,
        mx: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        r = bidx * ROWS_PER_CTA + tidx // 32
        if tile_expert[r // TILE_M] >= 0:
            inter = cute.size(dh, mode=[1])
            n_vec = inter // VEC
            gu_v = cute.zipped_divide(gate_up[(r, None)], (VEC,))
            dgu_v = cute.zipped_divide(dgate_up[(r, None)], (VEC,))
            dh_v = cute.zipped_divide(dh[(r, None)], (VEC,))
            wh_v = cute.zipped_divide(wh[(r, None)], (VEC,))
            fg = cute.make_rmem_tensor((VEC,), gate_up.element_type)
            fu = cute.make_rmem_tensor((VEC,), gate_up.element_type)
            fdh = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            ag = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            agd = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            au = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            hb = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            og = cute.make_rmem_tensor((VEC,), dgate_up.element_type)
            ou = cute.make_rmem_tensor((VEC,), dgate_up.element_type)
            hq = cute.make_rmem_tensor((VEC,), gate_up.element_type)
            wr = w[r]
            part = cutlass.Float32(0.0)
            # the whole warp takes every pass (the MXFP8 blocks' shuffles need all its lanes); lane c0 + lane
            # holds columns 8 c .. 8 c + 7 of gate and of up
            for c0 in range(0, n_vec, 32):
                c = c0 + lane
                live = c < n_vec
                if live:
                    cute.autovec_copy(gu_v[(None, c)], fg)
                    cute.autovec_copy(gu_v[(None, c + n_vec)], fu)
                    cute.autovec_copy(dh_v[(None, c)], fdh)
                    for i in cutlass.range_constexpr(VEC):
                        hv, dg, du = _act(self.kind, fg[i].to(cutlass.Float32), fu[i].to(cutlass.Float32), limit)
                        hb[i] = hv
                        d = fdh[i] * wr
                        agd[i] = dg * d
                        au[i] = du * d
                    # h as the forward stored it (bf16), back in fp32 for the weight gradient
                    hq.store(hb.load().to(gate_up.element_type))
                    hb.store(hq.load().to(cutlass.Float32))
                    for i in cutlass.range_constexpr(VEC):
                        part = part + fdh[i] * hb[i]
                        ag[i] = hb[i] * wr
                    hq.store(ag.load().to(wh.element_type))
                    cute.autovec_copy(hq, wh_v[(None, c)])
                    og.store(agd.load().to(dgate_up.element_type))
                    ou.store(au.load().to(dgate_up.element_type))
                if mx != 0:  # the bf16 values' MXFP8 values, as mok_mx_quant makes them from the stored d gate_up
                    mx_values_of_lane_block(og, agd, live)
                    mx_values_of_lane_block(ou, au, live)
                if live:
                    cute.autovec_copy(og, dgu_v[(None, c)])
                    cute.autovec_copy(ou, dgu_v[(None, c + n_vec)])
            part = cute.arch.warp_reduction_sum(part)  # fixed butterfly order
            if lane == 0:
                dw[r] = part
