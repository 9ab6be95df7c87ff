"""The list of kernel variants the library holds, and how their arguments look.

This module imports no DSL: the loader reads the same specs on machines that
have only PyTorch, to turn torch tensors into the argument structs of the
exported C wrappers. A tensor argument is described mode by mode: each extent
and each stride is either a fixed int or DYN (a run-time value). The exported
struct holds the run-time extents, then the run-time strides, in mode order.
"""

from __future__ import annotations

import dataclasses
import math
import hashlib
import pathlib

DYN = "dyn"
LIB_NAME = "libmok_kernels.so"
MANIFEST = "manifest.json"
BUILD_COMMAND = "python -m mok_nn.kernels.build --arch {arch} --out {out}"
TILE_M = 128  # rows per GEMM tile; the schedule pads each expert's segment to it
GEMM_TILE_N = 256  # output columns per GEMM tile
PINGPONG_TILE_N = 128  # output columns per tile of the ping-pong GEMMs (each consumer warp group: 128 x 128)
SCHEDULE_MAX_EXPERTS = 512  # experts per rank the schedule kernels' shared-memory tables hold
SCHEDULE_MC_WARPS = 16  # warps per CTA of the multi-CTA schedule; a chunk is a multiple of 32 slots per warp
SCHEDULE_MC_MAX_CHUNKS = 128  # chunks (count / place CTAs) of the multi-CTA schedule, at most
EP_COPY_THREADS = 256  # threads per CTA of the grid-stride row copies (ep_copy.py); a warp copies whole rows
EP_SCHED_THREADS = 256  # threads per CTA of mok_ep_schedule_outputs (ep_schedule.py)
MX_QUANT_THREADS = 256  # threads per CTA of mok_mx_quant (mx_quant.py)
MX_QUANT_CTAS_PER_SM = 4  # its resident CTAs per SM: the launch bound (64 registers a thread) and the grid
MX_QUANT_UNROLL = 4  # its 16-byte loads in flight per thread along the columns (mode 0)
# The mark in mok_gemm_bn_mxq[_f32]'s row factors (set by cuda_mx.column_marks, read by mx_swapped.SwappedMxColumnGemm;
# a bf16 power of two has no mantissa bit set): its 32 x 32 block holds a value that requantisation changes
ROUNDS_FLAG = 1
ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1, "u16": 2}
# The combine sums each token's slots over a fixed tree of COMBINE_LEAVES expert groups (kernels/combine.py):
# expert parallelism over P ranks, P dividing combine_leaves(E), can pre-reduce per rank with the EP = 1 bits.
COMBINE_LEAVES = 8
# mok_combine_cp stages this many 16-byte chunks per thread in shared memory: it takes top_k <= this
COMBINE_STAGED_ENTRIES = 16


def combine_leaves(num_experts: int) -> int:
    """G = gcd(E, 8): the expert groups (leaves) the combine's tree sums over; group g holds the
    E / G consecutive experts g E / G .. (g + 1) E / G - 1."""
    return math.gcd(num_experts, COMBINE_LEAVES)


@dataclasses.dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: str  # "bf16", "f32", "i32", "i64", "u8", "u16"
    shape: tuple  # ints or DYN
    stride: tuple  # ints or DYN
    divisibility: tuple = ()  # per mode, for DYN extents (default 1)
    align: int = 16
    stride_div: int = 0  # DYN strides are multiples of this (0: 16 bytes' worth of elements)

    @property
    def stride_divisibility(self) -> int:
        return self.stride_div or 16 // ITEMSIZE[self.dtype]

    def dyn_shape_modes(self):
        return [i for i, s in enumerate(self.shape) if s == DYN]

    def dyn_stride_modes(self):
        return [i for i, s in enumerate(self.stride) if s == DYN]


@dataclasses.dataclass(frozen=True)
class ScalarArg:
    name: str
    dtype: str  # "i32" or "f32"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str  # symbol prefix in the library
    module: str  # python module under mok_nn.kernels holding the kernel
    factory: str  # callable in that module returning the @cute.jit callable
    factory_kwargs: tuple  # ((key, value), ...)
    args: tuple  # TensorArg / ScalarArg, then the stream (implicit, last)


# The schedule as the varlen-M grouped GEMMs read it: each row tile's expert (-1: unused), each expert's
# padded segment end and its rows (cuda_backend.Schedule).
_SCHEDULE_ARGS = (
    TensorArg("tile_expert", "i32", (DYN,), (1,), align=4),
    TensorArg("seg_end", "i32", (DYN,), (1,), align=4),
    TensorArg("seg_rows", "i32", (DYN,), (1,), align=4),
)


def _gemm_spec(
    name: str, b_major: str, tile_n: int, c_dtype: str = "bf16", full_epi: bool = False, pingpong: bool = False,
    cluster_n: int = 1,
) -> KernelSpec:
    # A (M, K, 1) K-major; B (N, K, E) K- or N-major; C (M, N, 1) N-major.
    # seg_end / seg_rows: padded segment ends and real rows per expert (tiles' padding halves skip the MMA).
    b_stride = (DYN, 1, DYN) if b_major == "k" else (1, DYN, DYN)
    return KernelSpec(
        name=name,
        module="grouped_gemm",
        factory="VarlenMGroupedGemm",
        factory_kwargs=(("tile_n", tile_n), ("full_epi", full_epi)) + ((("pingpong", True),) if pingpong else ())
        + ((("cluster_n", cluster_n),) if cluster_n > 1 else ()),
        args=(
            TensorArg("a", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 8, 1)),
            TensorArg("b", "bf16", (DYN, DYN, DYN), b_stride, divisibility=(8, 8, 1)),
            TensorArg("c", c_dtype, (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 8, 1)),
            *_SCHEDULE_ARGS,
            ScalarArg("group_m", "i32"),
        ),
    )


def _gemm_dyn_spec(name: str, b_major: str, c_dtype: str = "bf16", full_epi: bool = False) -> KernelSpec:
    # the plain GEMM with dynamic tiles (VarlenMGroupedGemmDyn): + tile_counter, zeroed before each launch
    base = _gemm_spec(name, b_major, GEMM_TILE_N, c_dtype, full_epi=full_epi)
    counter = TensorArg("tile_counter", "i32", (1,), (1,), align=4)
    return dataclasses.replace(base, factory="VarlenMGroupedGemmDyn", args=base.args + (counter,))


def _gemm_push_spec(name: str, b_major: str) -> KernelSpec:
    # mok_gemm_bk_ef / bn_ef whose rows go to row row_slot[r] of the section at dst_base[row_rank[r]] (the EP
    # combine's slots of each source rank, forward and backward) instead of an output C (no C argument).
    base = _gemm_spec(name, b_major, GEMM_TILE_N, full_epi=True)
    idx = TensorArg("idx", "i64", (DYN,), (1,), align=8)
    extra = (TensorArg("dst_base", "i64", (DYN,), (1,), align=8), dataclasses.replace(idx, name="row_rank"),
             dataclasses.replace(idx, name="row_slot"))
    args = tuple(a for a in base.args if a.name != "c") + extra
    return dataclasses.replace(base, factory="VarlenMGroupedGemmPush", factory_kwargs=(("tile_n", GEMM_TILE_N),),
                               args=args)


def _pingpong_kwargs(pingpong: bool, cluster_n: int = 1) -> tuple:
    if not pingpong:
        return ()
    return (("tile_n", PINGPONG_TILE_N), ("pingpong", True)) + ((("cluster_n", cluster_n),) if cluster_n > 1 else ())


def _pp_suffix(pingpong: bool, cluster_n: int) -> str:
    return ("_ppc" if cluster_n > 1 else "_pp") if pingpong else ""


def _gemm_act_spec(kind: str, pingpong: bool = False, cluster_n: int = 1, full_epi: bool = False) -> KernelSpec:
    # gate/up GEMM with the activation in the epilogue: writes gate_up (M, 2I) and h (M, I).
    # full_epi (cooperative only): the whole gate/up tile in smem, suffix _ef as the plain GEMMs.
    return KernelSpec(
        name=f"mok_gemm_gate_up_{kind}" + _pp_suffix(pingpong, cluster_n) + ("_ef" if full_epi else ""),
        module="grouped_gemm",
        factory="VarlenMGroupedGemmAct",
        factory_kwargs=(("act", kind),) + _pingpong_kwargs(pingpong, cluster_n)
        + ((("full_epi", True),) if full_epi else ()),
        args=(
            TensorArg("a", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 8, 1)),
            TensorArg("b", "bf16", (DYN, DYN, DYN), (DYN, 1, DYN), divisibility=(256, 8, 1)),
            TensorArg("gate_up", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 256, 1)),
            TensorArg("h", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 128, 1)),
            *_SCHEDULE_ARGS,
            ScalarArg("h_mx", "i32"),  # nonzero: h as its MXFP8 values along I (the helper-warp forms: _ef, _mx)
            ScalarArg("limit", "f32"),
            ScalarArg("group_m", "i32"),
        ),
    )


# MXFP8 weights for the forward's GEMMs (kernels/mx_swapped.py): their E4M3 bytes (N, K, E) K-major and their scale
# pairs (N, K / 64, E), N fastest (cuda_mx.MxWeight.kernel_operands arranges them).
def _mx_b_args(n_div: int) -> tuple:
    return (TensorArg("b", "u8", (DYN, DYN, DYN), (DYN, 1, DYN), divisibility=(n_div, 64, 1)),
            TensorArg("b_scale", "u16", (DYN, DYN, DYN), (1, DYN, DYN), divisibility=(8, 1, 1)))


def _gemm_mx_spec() -> KernelSpec:
    # x_rows @ dequantize(W[e])^T with W as MXFP8: the plain GEMM, the weights as the wgmma's register A operand
    # (mx_swapped.py)
    base = _gemm_spec("mok_gemm_bk_mx", "k", GEMM_TILE_N)
    a, _, c, *rest = base.args
    return dataclasses.replace(base, module="mx_swapped", factory="SwappedMxGemm", factory_kwargs=(),
                               args=(a, *_mx_b_args(8), c, *rest))


def _gemm_act_mx_spec(kind: str) -> KernelSpec:
    # the gate/up GEMM + activation with gate_up_proj as MXFP8, the weights as the wgmma's register A operand
    # (mx_swapped.py)
    base = _gemm_act_spec(kind, full_epi=True)
    a, _, *rest = base.args
    return dataclasses.replace(base, name=f"mok_gemm_gate_up_{kind}_mx", module="mx_swapped",
                               factory="SwappedMxGemmAct", factory_kwargs=(("act", kind),),
                               args=(a, *_mx_b_args(256), *rest))


def _gemm_mx_cols_spec(c_dtype: str) -> KernelSpec:
    # the backward's dgrad (d rows @ B, B the MXFP8 values along K of W_q) from MXFP8-only weights: their E4M3 bytes
    # (N, K, E) N-major and a table of row factors (K, N / 32, E) u16, K fastest
    # (cuda_mx.MxColumnWeight.kernel_operands); the weights as the wgmma's register A operand (mx_swapped.py)
    base = _gemm_spec("mok_gemm_bn_mxq" + ("_f32" if c_dtype == "f32" else ""), "n", GEMM_TILE_N, c_dtype)
    a, _, c, *rest = base.args
    b = (TensorArg("b", "u8", (DYN, DYN, DYN), (1, DYN, DYN), divisibility=(32, 64, 1)),
         TensorArg("b_factors", "u16", (DYN, DYN, DYN), (1, DYN, DYN), divisibility=(64, 1, 1)))
    return dataclasses.replace(base, module="mx_swapped", factory="SwappedMxColumnGemm", factory_kwargs=(),
                               args=(a, *b, c, *rest))


def _gemm_dact_spec(kind: str, pingpong: bool = False, cluster_n: int = 1) -> KernelSpec:
    # dgrad of down with the activation backward in the epilogue: dy rows @ W2[e] -> d gate_up, w*h,
    # and per (column tile, row) partial top-k weight gradients. I % GEMM_TILE_N == 0.
    return KernelSpec(
        name=f"mok_gemm_dact_{kind}" + _pp_suffix(pingpong, cluster_n),
        module="grouped_gemm",
        factory="VarlenMGroupedGemmDact",
        factory_kwargs=(("dact", kind),) + _pingpong_kwargs(pingpong, cluster_n),
        args=(
            TensorArg("a", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 8, 1)),
            TensorArg("b", "bf16", (DYN, DYN, DYN), (1, DYN, DYN), divisibility=(256, 8, 1)),
            TensorArg("dgate_up", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 512, 1)),
            TensorArg("wh", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 256, 1)),
            TensorArg("gate_up", "bf16", (DYN, DYN, 1), (DYN, 1, 0), divisibility=(128, 512, 1)),
            TensorArg("w", "f32", (DYN,), (1,), divisibility=(128,), align=4),
            TensorArg("dw_part", "f32", (DYN, DYN), (DYN, 1), divisibility=(1, 128), align=4),
            *_SCHEDULE_ARGS,
            ScalarArg("limit", "f32"),
            ScalarArg("group_m", "i32"),
        ),
    )


def _wgrad_spec(
    name: str, tile_n: int, epi_n: int, epi_stages: int, lazy: bool = False, cluster_m: int = 1,
    pingpong: bool = False, accumulate: bool = False,
) -> KernelSpec:
    # C[m, n, e] = sum over expert e's rows r of A[m, r] * B[n, r]: the rows are read transposed.
    # lazy: the epilogue leaves its TMA stores in flight and waits for a buffer only before reusing it.
    # cluster_m = 2: CTA pairs on row tiles 2p, 2p + 1 share each B stage by TMA multicast.
    kwargs = (("tile_n", tile_n), ("epi_n", epi_n), ("epi_stages", epi_stages))
    kwargs += (("lazy_epilogue", True),) if lazy else ()
    kwargs += (("cluster_m", cluster_m),) if cluster_m > 1 else ()
    kwargs += (("pingpong", True),) if pingpong else ()  # whole 128x128 tiles per consumer warp group
    kwargs += (("accumulate", True),) if accumulate else ()  # C += the result (macrobatch passes)
    return KernelSpec(
        name=name,
        module="wgrad_gemm",
        factory="VarlenKGroupedGemm",
        factory_kwargs=kwargs,
        args=(
            TensorArg("a", "bf16", (DYN, DYN, 1), (1, DYN, 0), divisibility=(8, TILE_M, 1)),
            TensorArg("b", "bf16", (DYN, DYN, 1), (1, DYN, 0), divisibility=(8, TILE_M, 1)),
            TensorArg("c", "bf16", (DYN, DYN, DYN), (DYN, 1, DYN), divisibility=(8, 8, 1)),
            TensorArg("seg_end", "i32", (DYN,), (1,), align=4),
            TensorArg("seg_rows", "i32", (DYN,), (1,), align=4),
            ScalarArg("group_m", "i32"),
        ),
    )


def _combine_specs() -> tuple:
    # Combine in the fixed tree over expert groups (kernels/combine.py): on one GPU, and the two EP
    # halves (partial sums pushed by the expert ranks, finished on the source) with the same bits.
    rows = TensorArg("rows", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 8))
    tk = TensorArg("pos", "i64", (DYN, DYN), (DYN, 1), align=8, stride_div=1)
    local = KernelSpec(
        name="mok_combine",  # out[t] = tree over leaves of sum_j w[t, j] * rows[pos[t, j]]
        module="combine",
        factory="Combine",
        factory_kwargs=(),
        args=(
            rows,
            tk,
            TensorArg("w", "f32", (DYN, DYN), (DYN, 1), align=4, stride_div=1),
            dataclasses.replace(tk, name="ids"),
            dataclasses.replace(rows, name="out"),
            ScalarArg("experts_per_leaf", "i32"),
        ),
    )
    partial = KernelSpec(
        name="mok_ep_partial_push",  # part_base[s] row dst_row0 + t = this rank's node of token (s, t)
        module="combine",
        factory="PartialPush",
        factory_kwargs=(),
        args=(
            rows,
            TensorArg("slot_row", "i64", (DYN,), (1,), align=8),
            TensorArg("w_all", "f32", (DYN,), (1,), align=4),
            TensorArg("ids_all", "i64", (DYN, DYN, DYN), (DYN, DYN, 1), align=8, stride_div=1),
            TensorArg("part_base", "i64", (DYN,), (1,), align=8),
            ScalarArg("rank", "i32"),
            ScalarArg("experts_per_rank", "i32"),
            ScalarArg("experts_per_leaf", "i32"),
            ScalarArg("weighted", "i32"),
            ScalarArg("dst_row0", "i32"),
        ),
    )
    final = KernelSpec(
        name="mok_combine_final",  # out[t] = tree over the ranks' nodes in parts[:, t]
        module="combine",
        factory="FinalCombine",
        factory_kwargs=(),
        args=(
            TensorArg("parts", "f32", (DYN, DYN, DYN), (DYN, DYN, 1), divisibility=(1, 1, 8)),
            dataclasses.replace(tk, name="ids"),
            TensorArg("flags", "i32", (DYN,), (1,), align=4),
            dataclasses.replace(rows, name="out"),
            ScalarArg("experts_per_rank", "i32"),
            ScalarArg("experts_per_leaf", "i32"),
        ),
    )
    staged = dataclasses.replace(local, name="mok_combine_cp", factory_kwargs=(("staged", True),))  # top_k <= 16
    return local, staged, partial, final


def _act_specs(kind: str) -> tuple:
    te = TensorArg("tile_expert", "i32", (DYN,), (1,), align=4)
    fwd = KernelSpec(
        name=f"mok_act_fwd_{kind}",
        module="swiglu",
        factory="ActForward",
        factory_kwargs=(("kind", kind),),
        args=(
            TensorArg("gate_up", "bf16", (DYN, DYN), (DYN, 1), divisibility=(TILE_M, 16)),
            TensorArg("h", "bf16", (DYN, DYN), (DYN, 1), divisibility=(TILE_M, 8)),
            te,
            ScalarArg("limit", "f32"),
        ),
    )
    bwd = KernelSpec(
        name=f"mok_act_bwd_{kind}",
        module="swiglu",
        factory="ActBackward",
        factory_kwargs=(("kind", kind),),
        args=(
            TensorArg("gate_up", "bf16", (DYN, DYN), (DYN, 1), divisibility=(TILE_M, 16)),
            TensorArg("dh", "f32", (DYN, DYN), (DYN, 1), divisibility=(TILE_M, 8)),
            TensorArg("w", "f32", (DYN,), (1,), align=4),
            TensorArg("dgate_up", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 16)),
            TensorArg("wh", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 8)),
            TensorArg("dw", "f32", (DYN,), (1,), align=4),
            te,
            ScalarArg("limit", "f32"),
            ScalarArg("mx", "i32"),
        ),
    )
    return fwd, bwd


def _schedule_spec(name: str, factory: str, factory_kwargs: tuple = ()) -> KernelSpec:
    # "ScheduleMultiCta": three launches (per-chunk counts, one scan CTA, placement), scratch [C*E] and chunk
    # (slots per CTA).
    multi = factory == "ScheduleMultiCta"
    return KernelSpec(
        name=name,
        module="schedule",
        factory=factory,
        factory_kwargs=factory_kwargs,
        args=(
            TensorArg("ids", "i64", (DYN,), (1,), align=8),
            TensorArg("pos", "i64", (DYN,), (1,), align=8),
            TensorArg("row_token", "i64", (DYN,), (1,), align=8),
            *_SCHEDULE_ARGS,
            TensorArg("padded_rows", "i32", (DYN,), (1,), align=4),  # seg_rows rounded up to TILE_M
            *((TensorArg("scratch", "i32", (DYN,), (1,), align=4),) if multi else ()),
            ScalarArg("top_k", "i32"),
            *((ScalarArg("chunk", "i32"),) if multi else ()),
        ),
    )


def _schedule_gather_spec() -> KernelSpec:
    # mok_schedule_mc's arguments, then the forward's x gather by it (ScatterRows): x, pos as (T, k), x_rows, mx, grid
    mc = _schedule_spec("mok_schedule_mc", "ScheduleMultiCta")
    rows = TensorArg("x", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 8))
    return dataclasses.replace(mc, name="mok_schedule_gather", factory="ScheduleGather", args=(
        *mc.args, rows, TensorArg("slots", "i64", (DYN, DYN), (DYN, 1), align=8, stride_div=1),
        dataclasses.replace(rows, name="x_rows"), ScalarArg("mx", "i32"), ScalarArg("num_ctas", "i32"),
    ))


def _ep_schedule_outputs_spec() -> KernelSpec:
    # cuda_ep.make_ep_schedule's outputs from its bucket schedule in one launch (kernels/ep_schedule.py)
    i64 = TensorArg("t", "i64", (DYN,), (1,), align=8)
    i32 = TensorArg("t", "i32", (DYN,), (1,), align=4)
    return KernelSpec(
        name="mok_ep_schedule_outputs",
        module="ep_schedule",
        factory="EPScheduleOutputs",
        factory_kwargs=(),
        args=(
            *(dataclasses.replace(i64 if n in ("f_row_token", "key") else i32, name=n)
              for n in ("f_row_token", "f_tile_expert", "f_seg_end", "f_seg_rows", "key")),
            *(dataclasses.replace(i64, name=n) for n in ("row_token", "row_gslot", "row_src", "row_slot")),
            *(dataclasses.replace(i32, name=n) for n in ("tile_expert", "seg_end", "seg_rows", "padded_rows")),
            dataclasses.replace(i64, name="pull_src"),
            dataclasses.replace(i32, name="load"),
            ScalarArg("rank", "i32"),
            ScalarArg("top_k", "i32"),
            ScalarArg("tokens_cap", "i32"),
            ScalarArg("num_ctas", "i32"),
        ),
    )


def _ep_signal_spec() -> KernelSpec:
    # The barrier with one peer (kernels/ep_comm.py): signal its slot, wait for ours to reach epoch.
    return KernelSpec(
        name="mok_ep_signal",
        module="ep_comm",
        factory="PeerSignal",
        factory_kwargs=(),
        args=(
            TensorArg("peer_slot", "i32", (1,), (1,), align=4),
            TensorArg("my_slot", "i32", (1,), (1,), align=4),
            TensorArg("err", "i32", (1,), (1,), align=4),
            ScalarArg("epoch", "i32"),
            ScalarArg("timeout_us", "i32"),
        ),
    )


def _ep_copy_specs() -> tuple:
    # Grid-stride row copies, warp per row (kernels/ep_copy.py); MOK_EP_COPY=v2 picks them. num_ctas: the grid.
    rows = TensorArg("rows", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 8))
    idx = TensorArg("idx", "i64", (DYN,), (1,), align=8)
    base = TensorArg("base", "i64", (DYN,), (1,), align=8)
    grid = ScalarArg("num_ctas", "i32")
    tiles = TensorArg("tile_expert", "i32", (DYN,), (1,), align=4)  # the gathers skip rows of tiles < 0
    slot_row = TensorArg("slot_row", "i64", (DYN, DYN), (DYN, 1), align=8, stride_div=1)  # the scatters' (N, k)
    pull = KernelSpec(
        name="mok_ep_pull_peers",  # dst[p*Tc + t] = section p [pull_src[p, t]]: every peer's pull, one launch
        module="ep_copy",
        factory="PullPeers",
        factory_kwargs=(),
        args=(dataclasses.replace(base, name="src_base"),
              TensorArg("pull_src", "i64", (DYN, DYN), (DYN, 1), align=8, stride_div=1),
              dataclasses.replace(rows, name="dst"), grid),
    )
    push = KernelSpec(
        name="mok_ep_push_peers",  # section row_rank[r] [row_slot[r]] = src[r]: the push to every rank, one launch
        module="ep_copy",
        factory="PushPeers",
        factory_kwargs=(),
        args=(dataclasses.replace(rows, name="src"), dataclasses.replace(base, name="dst_base"),
              dataclasses.replace(idx, name="row_rank"), dataclasses.replace(idx, name="row_slot"), grid),
    )
    gather = KernelSpec(
        name="mok_gather_rows",  # dst[r] = src[idx[r]], zero where idx[r] >= src rows (the GEMM's A rows)
        module="ep_copy",
        factory="GatherRows",
        factory_kwargs=(),
        args=(dataclasses.replace(rows, name="src"), dataclasses.replace(idx, name="idx"), tiles,
              dataclasses.replace(rows, name="dst"), grid),
    )
    scatter = KernelSpec(
        name="mok_scatter_rows",  # mok_gather_rows' rows walked from the source side: each src row read once
        module="ep_copy",
        factory="ScatterRows",
        factory_kwargs=(),
        args=(dataclasses.replace(rows, name="src"),
              slot_row,
              dataclasses.replace(idx, name="row_src"), tiles, dataclasses.replace(rows, name="dst"),
              ScalarArg("mx", "i32"), grid),  # mx: nonzero, the source rows' MXFP8 values along the row
    )
    scatter_peers = KernelSpec(
        name="mok_scatter_rows_peers",  # mok_scatter_rows reading source row p*Tc + t from rank p's section
        module="ep_copy",
        factory="ScatterRowsPeers",
        factory_kwargs=(),
        args=(dataclasses.replace(rows, name="src"), dataclasses.replace(base, name="src_base"),
              slot_row,
              dataclasses.replace(idx, name="row_src"), tiles, dataclasses.replace(rows, name="dst"), grid),
    )
    return pull, push, gather, scatter, scatter_peers


def _ep_publish_spec() -> KernelSpec:
    # Steps 1 and 2 of the EP forward in one launch (kernels/ep_publish.py): x rows into the local tokens
    # section, ids / weights / token count into every rank's sections (addrs: [3, P] addresses), then
    # (epoch > 0) the barrier with every peer.
    return KernelSpec(
        name="mok_ep_publish",
        module="ep_publish",
        factory="Publish",
        factory_kwargs=(),
        args=(
            TensorArg("x", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 8)),
            TensorArg("topk_ids", "i64", (DYN, DYN), (DYN, DYN), align=8, stride_div=1),
            TensorArg("topk_weights", "f32", (DYN, DYN), (DYN, DYN), align=4, stride_div=1),
            TensorArg("tokens", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 8)),
            TensorArg("addrs", "i64", (3, DYN), (DYN, 1), align=8, stride_div=1),
            ScalarArg("rank", "i32"),
            ScalarArg("tokens_cap", "i32"),
            ScalarArg("num_tokens", "i32"),
            ScalarArg("num_ctas", "i32"),
            # step 2's barrier at the end of the launch (epoch > 0): every rank's pad section, the error
            # flag, the CTA arrival counter (0 between launches)
            TensorArg("pads", "i64", (DYN,), (1,), align=8),
            TensorArg("err", "i32", (1,), (1,), align=4),
            TensorArg("arrivals", "i32", (1,), (1,), align=4),
            ScalarArg("epoch", "i32"),
            ScalarArg("timeout_us", "i32"),
            # push = 1: the x rows into every rank's tokens section (tokens_all), the pull's work
            TensorArg("tokens_all", "i64", (DYN,), (1,), align=8),
            ScalarArg("push", "i32"),
            # the global expert count: an id outside [0, num_experts) stops the kernel (print, trap)
            ScalarArg("num_experts", "i32"),
        ),
    )


def _mx_quant_spec() -> KernelSpec:
    # dst = the MXFP8 values of src (bf16) along its columns (mode 0) or rows (1; 2: schedule rows, those that
    # are not routed rows as zeros; 3: 0 and 2 at once; 4: 2 of src's rows taken by row_src), cuda_backend.mx_values;
    # the schedule arguments are read in modes 2 to 4, row_src in mode 4
    mat = TensorArg("src", "bf16", (DYN, DYN), (DYN, 1), divisibility=(1, 32))
    return KernelSpec(
        name="mok_mx_quant",
        module="mx_quant",
        factory="MxQuant",
        factory_kwargs=(),
        args=(mat, dataclasses.replace(mat, name="dst"), *_SCHEDULE_ARGS,
              TensorArg("row_src", "i64", (DYN,), (1,), align=8), ScalarArg("mode", "i32"),
              ScalarArg("grid", "i32")),
    )


SPECS = (
    # Varlen-M grouped GEMMs (grouped_gemm.py). The layer picks the form per GEMM (cuda_backend.gemm_kernel):
    # cooperative 128 x 256 tiles with the output tile split in four smem buffers where K is long (bk, bn);
    # the whole tile in smem and tiles claimed by atomic add (_ef_dyn: all-padding warp groups skip their MMA);
    # ping-pong warp groups on 2-CTA clusters sharing A (_ppc) where K is short.
    _gemm_spec("mok_gemm_bk", "k", GEMM_TILE_N),  # x_rows @ W[e]^T, K > GEMM_FULL_EPI_MAX_K
    _gemm_spec("mok_gemm_bn", "n", GEMM_TILE_N),  # d rows @ W[e], K > GEMM_FULL_EPI_MAX_K
    _gemm_dyn_spec("mok_gemm_bk_ef_dyn", "k", full_epi=True),  # forward down (and gate/up where not fused)
    _gemm_dyn_spec("mok_gemm_bn_ef_dyn", "n", full_epi=True),  # dgrad of gate/up
    _gemm_dyn_spec("mok_gemm_bn_f32_dyn", "n", "f32"),  # dgrad of down, fp32 out for dSwiGLU and d topk-weights
    _gemm_spec("mok_gemm_bk_ppc", "k", PINGPONG_TILE_N, full_epi=True, pingpong=True, cluster_n=2),
    _gemm_spec("mok_gemm_bn_ppc", "n", PINGPONG_TILE_N, full_epi=True, pingpong=True, cluster_n=2),
    # gate/up GEMM + SwiGLU in the epilogue (I % 128 == 0, no gate/up bias): clustered ping-pong where
    # H <= 2048, else the cooperative kernel whose idle producer warps compute the activation
    _gemm_act_spec("swiglu", pingpong=True, cluster_n=2),
    _gemm_act_spec("swiglu", full_epi=True),
    _gemm_mx_spec(),
    _gemm_act_mx_spec("swiglu"),
    _gemm_mx_cols_spec("bf16"),  # the backward's d x from MXFP8-only weights, precision="mxfp8"
    _gemm_mx_cols_spec("f32"),  # its d h (the dgrad of down, fp32 out for dSwiGLU and d topk-weights)
    # dgrad of down + dSwiGLU + d topk-weight partials in the epilogue (I % 256 == 0, H <= 4096; the layer's rule:
    # cuda_backend.dact_max_k)
    _gemm_dact_spec("swiglu", pingpong=True, cluster_n=2),
    _gemm_dact_spec("swiglu_oai", pingpong=True, cluster_n=2),
    # Expert parallelism: the forward's down GEMM and the backward's dgrad of gate/up store each row into its
    # source rank's slots (the combine's, over NVLink) instead of an output C
    _gemm_push_spec("mok_gemm_bk_ef_push", "k"),
    _gemm_push_spec("mok_gemm_bn_ef_push", "n"),
    # Weight gradients, rows^T @ rows per expert (wgrad_gemm.py): deferred epilogue on 2-CTA clusters sharing
    # B by TMA multicast; its accumulating twin (C += A^T B, macrobatch passes after the first); ping-pong
    # where experts have few rows and the output few columns (cuda_backend.wgrad_kernel)
    _wgrad_spec("mok_gemm_wgrad_defer_c2", GEMM_TILE_N, 32, 8, lazy=True, cluster_m=2),
    _wgrad_spec("mok_gemm_wgrad_defer_c2_acc", GEMM_TILE_N, 32, 8, lazy=True, cluster_m=2, accumulate=True),
    _wgrad_spec("mok_gemm_wgrad_pp", PINGPONG_TILE_N, 32, 8, pingpong=True),
    *_combine_specs(),
    _schedule_spec("mok_schedule_mc", "ScheduleMultiCta"),
    _schedule_gather_spec(),  # mok_schedule_mc + the forward's x gather, one host call (EP = 1 forward)
    *_act_specs("swiglu"),
    *_act_specs("swiglu_oai"),
    _ep_signal_spec(),
    *_ep_copy_specs(),
    _ep_publish_spec(),
    _ep_schedule_outputs_spec(),  # mok_ep_schedule_outputs: make_ep_schedule's derived outputs, one launch
    _mx_quant_spec(),  # precision="mxfp8": every GEMM operand's MXFP8 values
)

SPECS_BY_NAME = {s.name: s for s in SPECS}
# accumulating twins (C += A^T B): WGRAD_ACC_KERNELS[name] adds where `name` writes
WGRAD_ACC_KERNELS = {s.name.removesuffix("_acc"): s.name for s in SPECS if dict(s.factory_kwargs).get("accumulate")}
WGRAD_KERNELS = tuple(s.name for s in SPECS if s.factory == "VarlenKGroupedGemm" and s.name not in WGRAD_ACC_KERNELS.values())
GEMM_DYN_KERNELS = tuple(s.name for s in SPECS if s.factory == "VarlenMGroupedGemmDyn")


def tile_n_of(name: str) -> int:
    """Output columns per tile of a GEMM variant (the factories' default: GEMM_TILE_N)."""
    return dict(SPECS_BY_NAME[name].factory_kwargs).get("tile_n", GEMM_TILE_N)


def csrc_dir() -> pathlib.Path | None:
    """The C glue linked into the library: `mok_nn/kernels/csrc/` in an installed wheel (package data, mapped from
    the repository's csrc/ by pyproject.toml), else the repository's `csrc/` beside the package (a checkout or an
    editable install). The packaged copy comes first: beside an installed package lies site-packages, whose csrc/
    (if any) is not ours."""
    here = pathlib.Path(__file__).resolve().parent
    for d in (here / "csrc", here.parent.parent / "csrc"):
        if d.is_dir():
            return d
    return None


def source_hash() -> str:
    """Hash of everything a built library depends on: `mok_nn/kernels/*.py` (less the loading logic) and every
    file of csrc_dir() (hidden files excepted, as the wheel's package-data glob skips them). File names and bytes
    only, in the order of their paths relative to their folder, so the two layouts (checkout: csrc/ beside mok_nn/;
    wheel: the same files in mok_nn/kernels/csrc/) hash alike and a wheel's packaged library matches its installed
    sources (.ci/run checks that in a venv holding only the wheel). The same bytes as before that layout existed,
    so libraries built in a checkout keep their hash."""
    here = pathlib.Path(__file__).resolve().parent
    csrc = csrc_dir()
    files = sorted(here.glob("*.py"))
    if csrc is not None:
        rel = sorted(p.relative_to(csrc).parts for p in csrc.rglob("*") if p.is_file())
        files += [csrc.joinpath(*parts) for parts in rel if not any(part.startswith(".") for part in parts)]
    h = hashlib.sha256()
    for f in files:
        if f.name in ("loader.py", "__init__.py"):
            continue  # loading logic does not change what is built
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
