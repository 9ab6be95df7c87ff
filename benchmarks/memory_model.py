"""The one-GPU path's memory, without a GPU: every kernel replaced by the allocation of its outputs (the kernels
allocate nothing else), then the forward's saved tensors, the backward's peak above its inputs and the whole
forward+backward's peak (the benchmark's peak_mem_gb), from the profiler's allocation events on the CPU. Run it
on two source trees to compare an ordering or a saving:

    PYTHONPATH=. python benchmarks/memory_model.py [--shapes qwen3-30b-a3b,deepseek-v3] [--tokens 8192]
                                                   [--precision bf16|mxfp8]
    PYTHONPATH=/path/to/other/tree python benchmarks/memory_model.py ...

It models allocations only: no kernel runs, no value is computed, the routing is random (uneven loads).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json

import torch
from torch.profiler import ProfilerActivity, profile

from mok_nn import autograd, mxfp8
from mok_nn import cuda_backend as cb
from mok_nn.bench import SHAPES


def _allocation_only() -> None:
    """Each kernel-launching step of cuda_backend becomes the allocation of what it returns."""
    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype)

    cb.check_supported = lambda *a: None
    cb.gather_rows = lambda x, sched, skip_tail=False: empty(sched.capacity, x.shape[1], dtype=x.dtype)
    cb.gate_up_act = lambda a, w, sched, act, lim: (empty(a.shape[0], w.shape[1]), empty(a.shape[0], w.shape[1] // 2))
    cb.act_forward = lambda gu, sched, act, lim: empty(gu.shape[0], gu.shape[1] // 2)
    cb.grouped_gemm = lambda a, w, sched, transpose_w, out_dtype=torch.bfloat16: empty(
        a.shape[0], w.shape[2] if transpose_w else w.shape[1], dtype=out_dtype)
    cb.dgrad_down_act = lambda dy, w2, gu, wr, sched, act, lim, in_place=False: (
        gu if in_place else torch.empty_like(gu), empty(gu.shape[0], gu.shape[1] // 2),
        empty(gu.shape[0], dtype=torch.float32))
    cb.weight_grad = lambda a, b, sched, counts, into=None, out=None, cols=None: (
        into if into is not None else out if out is not None else empty(sched.num_experts, a.shape[1], b.shape[1]))
    cb.combine = lambda rows, pos, w, ids, e, dt: empty(pos.shape[0], rows.shape[1], dtype=dt)
    cb.mx_values = lambda t, mode, sched=None: torch.empty_like(t)


def _peak(fn) -> tuple[int, object]:
    """(largest sum of live bytes allocated by fn, freed ones subtracted, in allocation order; fn's result).

    Each event counts its own allocations only (self_cpu_memory_usage): an op's total would count its
    children's again (empty_like allocates through empty_strided). The bytes still live at the end must be
    those of what fn returned, or the count is wrong (checked)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    kept = _bytes(result)
    if live != kept:
        raise AssertionError(f"allocation model: {live} bytes live after the call, {kept} bytes returned")
    return peak, result


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


def measure(shape: str, tokens: int, precision: str = "bf16") -> dict:
    """Bytes of one call: what the forward keeps for the backward (its saved rows), the backward's peak above
    its inputs (saved rows included), the peak of a whole forward + backward above the inputs and weights (the
    benchmark's peak_mem_gb), and the weight gradients alone. precision="mxfp8": trained weights (their MXFP8
    values made for each forward and backward, as MoKFunction has them made)."""
    hidden, inter, experts, top_k = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    x, dy = torch.empty(tokens, hidden, dtype=torch.bfloat16), torch.empty(tokens, hidden, dtype=torch.bfloat16)
    w = torch.rand(tokens, top_k, generator=g)
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, requires_grad=precision == "mxfp8")
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, requires_grad=precision == "mxfp8")
    sched = cb.make_schedule_torch(ids, experts)
    # as MoKFunction's backward runs it where the graph is not retained (trees without the argument: as they ran)
    once = {"consume_saved": True} if "consume_saved" in inspect.signature(cb.experts_backward).parameters else {}
    if precision != "bf16":
        once["precision"] = precision
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
    grads = (w13.numel() + w2.numel()) * 2
    sizes = {"saved": kept, "backward_peak": backward_peak, "fwd_bwd_peak": whole, "weight_grads": grads}
    return {"shape": shape, "tokens": tokens, "precision": precision,
            **{f"{k}_gib": round(v / 2**30, 3) for k, v in sizes.items()},
            **{f"{k}_bytes": v for k, v in sizes.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--precision", choices=("bf16", "mxfp8"), default="bf16")
    args = ap.parse_args(argv)
    _allocation_only()
    for shape in args.shapes.split(","):
        print(json.dumps(measure(shape, args.tokens, args.precision)), flush=True)


if __name__ == "__main__":
    main()
