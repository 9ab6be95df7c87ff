"""Time cuda_ep.make_ep_schedule and cuda_ep.dispatch_plan against the earlier constructions on one GPU
(qwen3-30b-a3b at EP=2: 8192 tokens per rank, k=8, 64 experts per rank; capacity multiplier 2), host
and device time per call and the GPU kernels of one call.

    python tests/gpu/bench_ep_schedule.py        # ~15 s; table on stdout, $OUT/bench_ep_schedule.json
"""

import json
import os
import time

import torch

from mok_nn import cuda_ep

import layer_runs  # tests/gpu is on sys.path (pytest rootdir insertion, or the script's folder)

equiv = layer_runs.load_cpu_test("test_cuda_ep_schedule_equiv")
overlap = layer_runs.load_cpu_test("test_cuda_ep_overlap")


def timed(fn, iters=50):
    """(host ms per call: Python + launches, device ms per call: CUDA events, queue kept full)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / iters


def main():
    P, tc, k, e_l = 2, 8192, 8, 64
    gen = torch.Generator().manual_seed(0)
    ids = torch.full((P, tc, k), -1, dtype=torch.int64)
    for s in range(P):
        ids[s] = torch.topk(torch.randn(tc, P * e_l, generator=gen), k, dim=1).indices
    ids = ids.cuda()
    cap = cuda_ep.schedule_capacity(tc, k, e_l, P, 2.0)
    rows = []
    eps = cuda_ep.make_ep_schedule(ids, tc, 0, e_l, cap)
    impls = (("sched_77e2e79", lambda: equiv._make_ep_schedule_old(ids, tc, 0, e_l, cap)),
             ("sched_ca28148", lambda: equiv._make_ep_schedule_sorted(ids, tc, 0, e_l, cap)),
             ("sched_new", lambda: cuda_ep.make_ep_schedule(ids, tc, 0, e_l, cap)),
             ("plan_ca28148", lambda: overlap._dispatch_plan_sorted(eps.sched.row_token, P, tc, 0)),
             ("plan_new", lambda: cuda_ep.dispatch_plan(eps, 0)))
    for name, fn in impls:
        host, dev = timed(fn)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        rows.append({"impl": name, "host_ms": round(host, 4), "device_ms": round(dev, 4), "gpu_ops": kernels})
    print(f"make_ep_schedule P={P} tc={tc} k={k} E_l={e_l} cap={cap}")
    print(f"{'impl':14s} {'host ms':>8s} {'device ms':>10s} {'gpu ops':>8s}")
    for r in rows:
        print(f"{r['impl']:14s} {r['host_ms']:8.3f} {r['device_ms']:10.3f} {r['gpu_ops']:8d}")
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "bench_ep_schedule.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
