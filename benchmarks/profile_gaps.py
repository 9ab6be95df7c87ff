"""Where does the GPU idle during one forward+backward of mok_nn's routed experts?

    python benchmarks/profile_gaps.py [--shape deepseek-v3] [--tokens 8192]

Runs the benchmark's mok_nn step under torch.profiler, then lists one step's kernels in order: start (us from
the step's first kernel), duration, the idle gap before it, and how long after its launch call it started
("lag"; near zero where the GPU waited for the host). The totals split the idle time into gaps before a
kernel that started as soon as it was launched (the host was behind) and the rest.
"""
import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mok_nn import bench
from steps import bench_steps  # benchmarks/ is on sys.path when run as a script

HOST_BOUND_LAG_US = 15  # a kernel starting within this of its launch call waited for the host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="deepseek-v3", choices=[s for s in bench.SHAPES if s != "tiny"])
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    step = dict(bench_steps(a.shape, a.tokens))["forward+backward"]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    reps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            with record_function(f"mok_step_{i}"):  # the last step's kernels: those launched inside its range
                step()
            torch.cuda.synchronize()  # as the benchmark: each call starts on an idle GPU
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)["traceEvents"]

    launch_ts = {e["args"]["correlation"]: e["ts"] for e in trace
                 if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    last = max(e["ts"] for e in trace if e.get("name") == f"mok_step_{reps - 1}")
    kernels = sorted((e for e in trace if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    one = [k for k in kernels if launch_ts.get(k["args"].get("correlation"), 0) >= last]
    t0 = end = one[0]["ts"]
    idle_host = idle_other = 0.0
    print(f"{a.shape}: the last of {reps} steps, {len(one)} kernels; its first kernel started "
          f"{t0 - last:.1f} us after the step's call")
    print(f"{'start':>9} {'dur':>9} {'gap':>7} {'lag':>8}  kernel (us)")
    for k in one:
        gap = max(0.0, k["ts"] - end)
        lag = k["ts"] - launch_ts.get(k["args"].get("correlation"), k["ts"])
        if lag < HOST_BOUND_LAG_US:
            idle_host += gap
        else:
            idle_other += gap
        name = k["name"].replace("kernel_cutlass_kernel_mok_nnkernels", "mok:")[:90]
        print(f"{k['ts'] - t0:9.1f} {k['dur']:9.1f} {gap:7.1f} {lag:8.1f}  {name}")
        end = max(end, k["ts"] + k["dur"])
    busy = sum(k["dur"] for k in one)
    print(f"span {end - t0:.1f} us, kernel time {busy:.1f} us, idle {end - t0 - busy:.1f} us "
          f"(host behind {idle_host:.1f}, other {idle_other:.1f})")


if __name__ == "__main__":
    main()
