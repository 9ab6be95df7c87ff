"""The routed experts' memory on one GPU, without a GPU: every kernel replaced by the allocation of its outputs
(the kernels allocate nothing else), from the profiler's allocation events on the CPU. Run it on two source trees
to compare an ordering or a saving:

    PYTHONPATH=. python benchmarks/memory_model.py [--shapes qwen3-30b-a3b,deepseek-v3] [--tokens 8192]
                                                   [--precision bf16|mxfp8] [--backend cuda|torch] [--frozen]
    PYTHONPATH=/path/to/other/tree python benchmarks/memory_model.py ...

--backend cuda (the fused path): the forward's saved tensors, the backward's peak above its inputs and the whole
forward+backward's peak (the benchmark's peak_mem_gb). --backend torch: the forward+backward peak above the inputs
and weights of the portable backend (its Triton kernels' outputs as on CUDA), transformers' default experts (if
installed) and the torch baseline, each through autograd as the benchmark runs it (torch._grouped_mm replaced by
the allocation of its output, keeping its inputs for the backward as its derivative does).

It models allocations only: no GEMM runs, no value is meaningful, the routing is random (uneven loads).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from mok_nn import autograd, mxfp8
from mok_nn import cuda_backend as cb
from mok_nn.bench import SHAPES


def _allocation_only() -> None:
    """Each kernel-launching step of cuda_backend becomes the allocation of what it returns."""
    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype)

    cb.check_supported = lambda *a: None
    cb.gather_rows = lambda x, sched, skip_tail=False, mx=False: empty(sched.capacity, x.shape[1], dtype=x.dtype)
    cb.gate_up_act = lambda a, w, sched, act, lim, h_mx=False: (  # (h_mx: h's MXFP8 values from the kernel itself)
        empty(a.shape[0], w.shape[1]), empty(a.shape[0], w.shape[1] // 2))
    cb.act_forward = lambda gu, sched, act, lim: empty(gu.shape[0], gu.shape[1] // 2)
    cb.grouped_gemm = lambda a, w, sched, transpose_w, out_dtype=torch.bfloat16: empty(
        a.shape[0], w.shape[2] if transpose_w else w.shape[1], dtype=out_dtype)
    def dgrad_down_act(dy_rows, w2, gu, wr, sched, act, lim, in_place=False, mx=False):
        # where the two kernels run (the rule off H200: this CPU device), their fp32 d h [M, I] is live while the
        # activation backward writes the outputs, and handed-over d y rows ([rows]) are gone by then
        dy = dy_rows.pop()
        inter = gu.shape[1] // 2
        dh = None
        if not cb._use_fused_dact(inter, act, dy.shape[1], dy.device):
            dh = empty(gu.shape[0], inter, dtype=torch.float32)
            del dy
        out = (gu if in_place else torch.empty_like(gu), empty(gu.shape[0], inter),
               empty(gu.shape[0], dtype=torch.float32))
        del dh
        return out

    cb.dgrad_down_act = dgrad_down_act
    cb.weight_grad = lambda a, b, sched, counts, into=None, out=None, cols=None: (
        into if into is not None else out if out is not None else empty(sched.num_experts, a.shape[1], b.shape[1]))
    cb.combine = lambda rows, pos, w, ids, e, dt: empty(pos.shape[0], rows.shape[1], dtype=dt)
    cb.mx_values = lambda t, mode, sched=None: torch.empty_like(t)
    cb.row_segments = lambda src, sched: empty(sched.capacity, src.shape[1], dtype=src.dtype)


def _peak(fn) -> tuple[int, object]:
    """(largest sum of live bytes allocated by fn, freed ones subtracted, in allocation order; fn's result).
    The bytes still live at the end must be those of what fn returned, or the count is wrong (checked; the
    profiler now and then records none or part of a call's allocations: such a count is taken again)."""
    for _ in range(3):
        peak, live, result = _allocations(fn)
        kept = _bytes(result)
        if live == kept:
            return peak, result
    raise AssertionError(f"allocation model: {live} bytes live after the call, {kept} bytes returned")


def _allocations(fn) -> tuple[int, int, object]:
    """(peak, bytes still live at the end, fn's result) of the allocations fn makes, from the profiler's
    allocation records in time order (each allocation and free with its size; the ops' self memory would place
    a Python-level free inside a long op, e.g. an autograd Function's, at that op's start)."""
    gc.collect()  # garbage of earlier calls (reference cycles) is not freed inside this count
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    records = []

    def walk(event):
        if event.tag == _EventType.Allocation:
            records.append((event.start_time_ns, event.extra_fields.alloc_size))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(records, key=lambda r: r[0]):
        live += size
        peak = max(peak, live)
    return peak, live, result


def _bytes(obj, seen=None) -> int:
    """Bytes of the distinct tensor storages in obj (tensors, tuples / lists, dataclasses)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or not obj.untyped_storage().nbytes():
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_bytes(o, seen) for o in obj)
    if dataclasses.is_dataclass(obj):
        return sum(_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


def measure(shape: str, tokens: int, precision: str = "bf16", frozen: bool = False) -> dict:
    """Bytes of one call: what the forward keeps for the backward (its saved rows), the backward's peak above
    its inputs (saved rows included), the peak of a whole forward + backward above the inputs and weights (the
    benchmark's peak_mem_gb), and the weight gradients alone. precision="mxfp8": trained weights (their MXFP8
    values made for each forward and backward, as MoKFunction has them made). frozen: the expert weights get no
    gradient (the backward computes d x and d topk-weights only; the benchmark's *_frozen rows)."""
    hidden, inter, experts, top_k = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    x, dy = torch.empty(tokens, hidden, dtype=torch.bfloat16), torch.empty(tokens, hidden, dtype=torch.bfloat16)
    w = torch.rand(tokens, top_k, generator=g)
    trained = precision == "mxfp8" and not frozen
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, requires_grad=trained)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, requires_grad=trained)
    sched = cb.make_schedule_torch(ids, experts)
    # as MoKFunction's backward runs it where the graph is not retained (trees without the argument: as they ran)
    once = {"consume_saved": True} if "consume_saved" in inspect.signature(cb.experts_backward).parameters else {}
    if precision != "bf16":
        once["precision"] = precision
    if frozen:
        once["needs"] = (False, False, False, False)
    # the scope MoKFunction opens for one pass (trees before weight_scope_for: mxfp8.weight_scope)
    scope = getattr(autograd, "weight_scope_for", None) or (lambda passes: mxfp8.weight_scope())

    def forward():
        with scope(1):
            return cb.experts_forward(x, ids, w, w13, w2, None, None, "swiglu", None, sched, precision=precision)

    def backward(saved):
        with scope(1):
            return cb.experts_backward(dy, saved, x, ids, w, w13, w2, **once)

    def forward_backward():
        y, saved = forward()
        return y, backward(saved)

    _, saved = forward()
    kept = _bytes(saved) - _bytes(saved.sched)
    backward_peak, _ = _peak(lambda: backward(saved))
    del saved
    whole, _ = _peak(forward_backward)
    grads = 0 if frozen else (w13.numel() + w2.numel()) * 2
    sizes = {"saved": kept, "backward_peak": backward_peak, "fwd_bwd_peak": whole, "weight_grads": grads}
    return {"shape": shape, "tokens": tokens, "precision": precision, "weights": "frozen" if frozen else "trained",
            **{f"{k}_gib": round(v / 2**30, 3) for k, v in sizes.items()},
            **{f"{k}_bytes": v for k, v in sizes.items()}}


class _AllocOnlyGroupedMM(torch.autograd.Function):
    """torch._grouped_mm's allocations: its output, and in backward its operands' gradients; it keeps both
    operands for the backward (torch's derivative reads each to make the other's gradient)."""

    @staticmethod
    def forward(ctx, a, b, offs, out_dtype):
        ctx.save_for_backward(a, b)
        dt = out_dtype or a.dtype
        if a.dim() == 2 and b.dim() == 3:  # rows [N, K] @ weights [E, K, M] -> [N, M]
            return torch.empty(a.shape[0], b.shape[2], dtype=dt)
        return torch.empty(offs.shape[0], a.shape[0], b.shape[1], dtype=dt)  # [M, N] @ [N, K] -> [E, M, K]

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        # each in its operand's layout, as torch's derivative makes it (a weight's gradient then reaches .grad
        # without a copy: AccumulateGrad takes it as it is)
        grads = [torch.empty_like(t) if need else None for t, need in zip((a, b), ctx.needs_input_grad)]
        return grads[0], grads[1], None, None


class _NoLaunch:
    """A Triton kernel whose launches do nothing (kernel[grid](...)): the wrappers around it allocate as on CUDA."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _portable_allocation_only() -> None:
    """The portable backend as it runs on CUDA (its Triton kernels: their wrappers allocate, nothing launches; its
    chunked passes in chunks of a GPU's size), transformers' experts and the baseline, with every grouped GEMM an
    allocation."""
    from types import SimpleNamespace

    from mok_nn import triton_ops

    def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
        return _AllocOnlyGroupedMM.apply(a, b, offs, out_dtype)

    torch._grouped_mm = grouped_mm
    if hasattr(torch.nn.functional, "grouped_mm"):
        torch.nn.functional.grouped_mm = grouped_mm
    triton_ops.runs_on = lambda t: t.dtype in (torch.bfloat16, torch.float16, torch.float32)
    mxfp8.chunk_bytes = lambda device: 1 << 28  # the chunked passes' temporaries as on a GPU (mxfp8.chunk_bytes)
    triton_ops.verified = lambda *args, **kwargs: True
    triton_ops._kernels = lambda: SimpleNamespace(**{name: _NoLaunch() for name in (
        "fake_quantize_kernel", "dequantize_kernel", "activation_forward_kernel", "mlp_backward_rows_kernel")})


def measure_portable(shape: str, tokens: int, dtype=torch.bfloat16) -> list[dict]:
    """Forward+backward peak above the inputs and weights (the benchmark's peak_mem_gb, measure_calls) and what
    the forward keeps for the backward (act_mem_gb, y included), per implementation."""
    from mok_nn import bench

    hidden, inter, experts, top_k = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    leaves = [torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_(True),
              torch.rand(tokens, top_k, generator=g).requires_grad_(True),
              torch.empty(experts, 2 * inter, hidden, dtype=dtype).requires_grad_(True),
              torch.empty(experts, hidden, inter, dtype=dtype).requires_grad_(True)]
    dy = torch.empty(tokens, hidden, dtype=dtype)
    impls = {"mok_nn portable": bench.mok_experts("torch"), "torch baseline": bench.baseline_experts}
    if bench._hf_available():
        impls["hf_default"] = bench.hf_experts(shape, "cpu", dtype)
    records = []
    for name, impl in impls.items():
        def call():
            x, w, w13, w2 = leaves
            return impl(x, ids, w, w13, w2)

        def forward_backward():
            for t in leaves:
                t.grad = None
            call().backward(dy)
            return [t.grad for t in leaves]

        forward_backward()  # first-call allocations (the workspace's) outside the count
        for _ in range(3):  # y and what its graph keeps (at least y: else the profiler missed allocations)
            _, kept, y = _allocations(call)
            enough = kept >= _bytes(y)
            del y
            if enough:
                break
        else:
            raise AssertionError("allocation model: the forward's allocations were not recorded")
        peak, _ = _peak(forward_backward)
        for t in leaves:
            t.grad = None
        records.append({"shape": shape, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "impl": name,
                        "fwd_bwd_peak_gib": round(peak / 2**30, 3), "act_gib": round(kept / 2**30, 3),
                        "fwd_bwd_peak_bytes": peak, "act_bytes": kept})
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--precision", choices=("bf16", "mxfp8"), default="bf16")
    ap.add_argument("--backend", choices=("cuda", "torch"), default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="--backend torch: the tensors' dtype")
    ap.add_argument("--frozen", action="store_true", help="--backend cuda: frozen expert weights (no weight gradients)")
    args = ap.parse_args(argv)
    if args.backend == "torch":
        _portable_allocation_only()
        for shape in args.shapes.split(","):
            for rec in measure_portable(shape, args.tokens, torch.bfloat16 if args.dtype == "bf16" else torch.float32):
                print(json.dumps(rec), flush=True)
        return
    _allocation_only()
    for shape in args.shapes.split(","):
        print(json.dumps(measure(shape, args.tokens, args.precision, args.frozen)), flush=True)


if __name__ == "__main__":
    main()
