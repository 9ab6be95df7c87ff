"""Diagnostic (not a test): every CUDA kernel of mok_nn's routed experts, forward + backward, by time.

    python tests/gpu/profile_layer.py [shape] [tokens]

Runs the benchmark's mok_nn path (functional layer + MoKFunction) under torch.profiler and
prints the kernels sorted by total CUDA time, so time outside the named stages shows up;
wall time above kernel time is the GPU waiting for the host.
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import layer_runs  # the script's folder is on sys.path

shape = sys.argv[1] if len(sys.argv) > 1 else "deepseek-v3"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
step = dict(layer_runs.bench_steps(shape, tokens))["forward+backward"]

for _ in range(3):
    step()
torch.cuda.synchronize()
reps = 5
t0 = time.perf_counter()
for _ in range(reps):
    step()
torch.cuda.synchronize()
wall = (time.perf_counter() - t0) / reps * 1e3  # outside the profiler: its hooks slow the host
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
events.sort(key=lambda e: -e.device_time_total)
total = sum(e.device_time_total for e in events) / reps / 1e3
print(f"{shape}: {total:.3f} ms of kernel time per forward+backward, {wall:.3f} ms wall ({reps} reps)")
for e in events[:30]:
    print(f"{e.device_time_total / reps / 1e3:9.3f} ms  x{e.count // reps:<3} {e.key[:110]}")
