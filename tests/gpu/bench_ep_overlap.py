"""Diagnostic (not a test): EP forward, sequential vs overlapped dispatch, at the benchmark shapes.

    torchrun --nproc_per_node 2 tests/gpu/bench_ep_overlap.py [--tokens 8192] [--iters 15]
             [--shapes qwen3-30b-a3b,deepseek-v3] [--comm 8,16,24,32,48]

Routed experts only (MoKFunction forward under no_grad; router excluded), BF16, random
routing (softmax top-k of x @ a random router), the same inputs for every implementation:
  ep1         the single-GPU path (ep_group=None, all experts on each GPU, own tokens)
  seq         cuda_ep forward, MOK_EP_FWD=sequential (pull, then gate/up GEMM on all SMs)
  ov<c>       cuda_ep forward, overlapped (dispatch beside gate/up, push beside down), fwd_num_comm_sms=c
  ov<c>d      the same with the combine push after the down GEMM (MOK_EP_COMBINE=sequential): the
              dispatch overlap alone
  ov<c>dyn    ov<c> with dynamic tiles (MOK_EP_OV_TILES=dynamic: the _dyn GEMMs on every SM, tiles
              claimed by atomic add, the comm SMs join the GEMM once the comm kernel ends)
  ov<c>dsp    ov<c> with dynamic tiles for the dispatch pair only (MOK_EP_OV_TILES=dispatch)
Implementations alternate inside each timed iteration (clock drift hits all alike); an
iteration's time is the slowest rank's (all_reduce MAX); medians reported, with TFLOP/s
per GPU (6*T*k*H*I / time) and the ratio to ep1 (target: >= 0.90). Before timing, y of
every EP variant is compared bitwise with seq. Prints a table; writes
bench_ep_overlap.json and bench_ep_overlap.txt to $OUT (default /tmp).
"""

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("MOK_EP_TIMEOUT_S", "20")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mok_nn import MoKConfig, bench, cuda_ep, functional  # noqa: E402
from mok_nn.autograd import MoKFunction  # noqa: E402


def _inputs(shape, tokens, rank):
    hidden, inter, num_experts, top_k = bench.SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    gw = torch.Generator(device="cuda").manual_seed(7)  # router and weights: the same on every rank
    router = torch.randn(num_experts, hidden, device="cuda", generator=gw) / hidden**0.5
    top = torch.topk(torch.softmax(x.float() @ router.T, dim=-1), top_k, dim=-1)
    w = top.values / top.values.sum(dim=-1, keepdim=True)
    W13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gw) / hidden**0.5).to(torch.bfloat16)
    W2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gw) / inter**0.5).to(torch.bfloat16)
    return x, top.indices, w, W13, W2


def kernel_timeline(fn):
    """[(kernel, start us, duration us)] of one call (torch profiler), start relative to the first kernel."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)
        t0 = evs[0].time_range.start if evs else 0
        out = []
        for ev in evs:
            name = ev.name.removeprefix("kernel_cutlass_kernel_").removeprefix("mok_nnkernels").split("_object_at")[0]
            out.append((name[:48], ev.time_range.start - t0, ev.time_range.elapsed_us()))
        return out
    except Exception as err:  # noqa: BLE001 - a diagnostic extra, never fatal
        return [(f"profiler unavailable: {err}", 0, 0)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--comm", default="8,16,24,32,48")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    lines, records = [], []

    def log(s):
        if rank == 0:
            print(s, flush=True)
            lines.append(s)

    comms = [int(c) for c in args.comm.split(",") if c]
    log(f"EP={world}, {args.tokens} tokens per rank, {args.iters} iterations (median of the slowest rank)")
    log(f"{'shape':<15} {'impl':<8} {'fwd ms':>8} {'TFLOP/s':>8} {'vs ep1':>7}  y bitwise = seq")
    ok_all = True
    for shape in [s for s in args.shapes.split(",") if s]:
        hidden, inter, num_experts, top_k = bench.SHAPES[shape]
        x, ids, w, W13, W2 = _inputs(shape, args.tokens, rank)
        per = num_experts // world
        local = (W13[rank * per:(rank + 1) * per], W2[rank * per:(rank + 1) * per], None, None)
        common = dict(hidden_size=hidden, intermediate_size=inter, num_experts=num_experts, top_k=top_k,
                      device=x.device, dtype=x.dtype, backend="cuda")
        impls = {"ep1": (functional.get_workspace(ep_group=None, **common), (W13, W2, None, None), None, None)}
        ws_seq = functional.get_workspace(ep_group=dist.group.WORLD, **common)
        impls["seq"] = (ws_seq, local, "sequential", "sequential")
        for c in comms:
            ws = functional.get_workspace(ep_group=dist.group.WORLD, config=MoKConfig(fwd_num_comm_sms=c), **common)
            impls[f"ov{c}"] = (ws, local, "overlap", "overlap")
            impls[f"ov{c}dyn"] = (ws, local, "overlap", "overlap", "dynamic")
            if c == 16:
                impls[f"ov{c}d"] = (ws, local, "overlap", "sequential")
                impls[f"ov{c}dsp"] = (ws, local, "overlap", "overlap", "dispatch")

        def run(name):
            ws, params, mode, combine, *tiles = impls[name]
            if mode:
                os.environ["MOK_EP_FWD"], os.environ["MOK_EP_COMBINE"] = mode, combine
                os.environ["MOK_EP_OV_TILES"] = tiles[0] if tiles else "static"
            try:
                with torch.no_grad():
                    return MoKFunction.apply(x, w, *params, ids, ws)
            finally:
                os.environ.pop("MOK_EP_FWD", None)
                os.environ.pop("MOK_EP_COMBINE", None)
                os.environ.pop("MOK_EP_OV_TILES", None)

        ys = {n: run(n) for n in impls}
        for n, (ws, _, mode, *_) in impls.items():
            if mode:
                cuda_ep.check_errors(ws)
        for _ in range(args.warmup):
            for n in impls:
                run(n)
        times = {n: [] for n in impls}
        for _ in range(args.iters):
            for n in impls:
                torch.cuda.synchronize()
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(n)
                end.record()
                end.synchronize()
                times[n].append(start.elapsed_time(end))
        c0 = comms[0] if 16 not in comms else 16
        timelines = {n: kernel_timeline(lambda: run(n)) for n in ("seq", f"ov{c0}", f"ov{c0}dyn")}
        for n, (ws, _, mode, *_) in impls.items():
            if mode:
                cuda_ep.check_errors(ws)
        flops = 6 * args.tokens * top_k * hidden * inter
        med = {}
        for n in impls:
            t = torch.tensor(times[n], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            med[n] = statistics.median(t.tolist())
        for n in impls:
            same = "-" if n == "ep1" else torch.equal(ys[n], ys["seq"])
            flag = torch.tensor([0 if same is False else 1], device="cuda")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            same = same if same == "-" else bool(flag.item())
            ok_all &= same is not False
            tf = flops / med[n] / 1e9
            log(f"{shape:<15} {n:<8} {med[n]:8.3f} {tf:8.1f} {med['ep1'] / med[n]:7.2f}  {same}")
            records.append(dict(shape=shape, ep=world, tokens_per_rank=args.tokens, impl=n, fwd_ms=med[n],
                                fwd_tflops=tf, ratio_vs_ep1=med["ep1"] / med[n], y_bitwise_eq_seq=same,
                                gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                commit=os.environ.get("MOK_COMMIT", "unknown")))
        for n, tl in timelines.items():
            log(f"  kernels of one {shape} {n} forward on rank 0 (start us, duration us; overlap shows as starts "
                "before the previous kernel's end):")
            for name, t, d in tl:
                if d >= 5:  # skip the small torch ops
                    log(f"    {t:9.1f} {d:9.1f}  {name}")
        torch.cuda.synchronize()
        dist.barrier()  # no peer reads this rank's buffers any more: they may be freed
        del impls, ys, x, W13, W2, local
        functional.release_workspaces()
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "/tmp")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_ep_overlap.json"), "w") as f:
            json.dump(records, f, indent=1)
        with open(os.path.join(out, "bench_ep_overlap.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
