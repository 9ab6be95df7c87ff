"""Diagnostic (not a test): where the GPU idles in one forward+backward of the routed experts.

    python tests/gpu/profile_gaps.py [shape] [tokens]

Runs the benchmark's mok_nn path (functional layer + MoKFunction) under torch.profiler, then
lists one step's kernels in order: start (us from the step's first kernel), duration, the idle
gap before it, and how long after its launch call it started ("lag"; near zero where the GPU
waited for the host). The totals at the end split the idle time into gaps after a kernel that
started late (the host was behind) and the rest (launch-to-launch overhead on a queued stream).
"""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import layer_runs  # the script's folder is on sys.path

shape = sys.argv[1] if len(sys.argv) > 1 else "deepseek-v3"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
step = dict(layer_runs.bench_steps(shape, tokens))["forward+backward"]

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

launch_ts = {}
for e in trace:
    if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
        launch_ts[e["args"]["correlation"]] = e["ts"]
last = max(e["ts"] for e in trace if e.get("name") == f"mok_step_{reps - 1}")
kernels = sorted((e for e in trace if e.get("cat") == "kernel"), key=lambda e: e["ts"])
one = [k for k in kernels if launch_ts.get(k["args"].get("correlation"), 0) >= last]
t0 = one[0]["ts"]
end = one[0]["ts"]
idle_host = idle_other = 0.0
print(f"{shape}: the last of {reps} steps, {len(one)} kernels; its first kernel started "
      f"{t0 - last:.1f} us after the step's call")
print(f"{'start':>9} {'dur':>9} {'gap':>7} {'lag':>8}  kernel (us)")
for k in one:
    gap = max(0.0, k["ts"] - end)
    lag = k["ts"] - launch_ts.get(k["args"].get("correlation"), k["ts"])
    if lag < 15:
        idle_host += gap
    else:
        idle_other += gap
    name = k["name"].replace("kernel_cutlass_kernel_mok_nnkernels", "mok:")[:90]
    print(f"{k['ts'] - t0:9.1f} {k['dur']:9.1f} {gap:7.1f} {lag:8.1f}  {name}")
    end = max(end, k["ts"] + k["dur"])
busy = sum(k["dur"] for k in one)
print(f"span {end - t0:.1f} us, kernel time {busy:.1f} us, idle {end - t0 - busy:.1f} us "
      f"(after late launches {idle_host:.1f}, other {idle_other:.1f})")
