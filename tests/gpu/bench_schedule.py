"""Diagnostic (not a test): schedule implementations side by side at the benchmark shapes.

    python tests/gpu/bench_schedule.py [--tokens 8192] [--reps 50]

Routing as in mok_nn.bench (x @ random router, softmax top-k). Each
implementation is first checked equal to make_schedule_torch (all fields), then
timed two ways over `reps` back-to-back calls:
  gpu_ms   device time per call: the calls are queued behind a sleep kernel, so
           host launch overhead is hidden (what the layer sees when the host runs ahead)
  call_ms  per call with the host in the loop (events around plain calls)
and the kernels of one call are listed with their durations (torch profiler).
Prints a table; writes bench_schedule.json and bench_schedule.txt to $OUT (default /tmp).
"""

import argparse
import json
import os
import statistics

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

from layer_runs import median_ms  # the script's folder is on sys.path

IMPLS = {"mc": "mc", "mc_pdl": "mc_pdl", "single": "single", "torch": "torch"}  # name -> MOK_SCHEDULE
SHAPES = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
FIELDS = ("pos", "row_token", "tile_expert", "seg_end", "seg_rows")


def routing(shape, tokens):
    hidden, _, num_experts, top_k = bench.SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    router = torch.randn(num_experts, hidden, device="cuda", generator=g) / hidden**0.5
    ids = torch.topk(torch.softmax(x.float() @ router.T, dim=-1), top_k, dim=-1).indices
    return ids, num_experts


def gpu_ms(fn, reps):
    """Per-call device time: queue reps calls behind a ~20 ms sleep, time them with events."""
    times = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(40_000_000)  # ~20 ms of cycles: the host queues every call meanwhile
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps)
    return statistics.median(times)


def kernel_times(fn):
    """[(kernel name, us)] of one call, from the torch profiler; [] where it is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        out = []
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                name = ev.name.removeprefix("kernel_cutlass_").split("_mok_nn")[0][:40]
                out.append((name, round(ev.time_range.elapsed_us(), 2)))
        return out
    except Exception as err:  # noqa: BLE001 - a diagnostic extra, never fatal
        return [(f"profiler unavailable: {err}", None)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    records, lines = [], []
    header = f"{'shape':<14} {'impl':<7} {'gpu_ms':>8} {'call_ms':>8} {'vs single':>9}  exact"
    print(header, flush=True)
    lines.append(header)
    for shape in SHAPES:
        ids, num_experts = routing(shape, args.tokens)
        want = cb.make_schedule_torch(ids, num_experts)
        base = None
        for impl, env in IMPLS.items():
            os.environ["MOK_SCHEDULE"] = env

            def fn():
                return cb.make_schedule(ids, num_experts)

            got = fn()
            torch.cuda.synchronize()
            exact = all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS)
            again = fn()
            torch.cuda.synchronize()
            exact = exact and all(torch.equal(getattr(got, f), getattr(again, f)) for f in FIELDS)
            g_ms, c_ms = gpu_ms(fn, args.reps), median_ms(fn, args.reps)
            if impl == "single":
                base = g_ms
            rec = dict(shape=shape, tokens=args.tokens, experts=num_experts, top_k=ids.shape[1], impl=impl,
                       gpu_ms=round(g_ms, 4), call_ms=round(c_ms, 4), exact=exact,
                       kernels=kernel_times(fn) if impl != "torch" else [])
            records.append(rec)
        for rec in records[-len(IMPLS):]:
            ratio = f"{base / rec['gpu_ms']:8.2f}x" if base else ""
            line = (f"{shape:<14} {rec['impl']:<7} {rec['gpu_ms']:8.4f} {rec['call_ms']:8.4f} {ratio:>9}  "
                    f"{'yes' if rec['exact'] else 'NO'}")
            if rec["kernels"]:
                line += "  [" + ", ".join(f"{n}: {t} us" for n, t in rec["kernels"]) + "]"
            print(line, flush=True)
            lines.append(line)
    os.environ.pop("MOK_SCHEDULE", None)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, reps=args.reps)
    with open(os.path.join(out_dir, "bench_schedule.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    with open(os.path.join(out_dir, "bench_schedule.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not all(r["exact"] for r in records):
        raise SystemExit("some schedule differs from make_schedule_torch (see the 'exact' column)")


if __name__ == "__main__":
    main()
