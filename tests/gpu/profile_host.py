"""Diagnostic (not a test): host time of mok_nn's routed experts at EP = 1, against their GPU time.

    python tests/gpu/profile_host.py [shape] [tokens]

The GPU is kept busy (torch.cuda._sleep) while the host issues N calls, so the host's time per call
is its own issue time, not a wait for the GPU. A forward whose host time is above its GPU time
leaves the GPU idle (the benchmark times each call from an idle GPU). Then cProfile of the same
calls: the Python functions with the most host time.
"""
import cProfile
import pstats
import sys
import time

import torch

from mok_nn import bench

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
p = bench.make_problem(shape, tokens, "cuda")
fn = bench.mok_experts("cuda")
leaves = bench._leaves(p)
x, w, gu, dn = leaves


def fwd():
    with torch.no_grad():
        fn(x, p["ids"], w, gu, dn)


def fwd_bwd():
    for t in leaves:
        t.grad = None
    fn(x, p["ids"], w, gu, dn).backward(p["dy"])


def gpu_ms(call, reps=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        s.record()
        call()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[reps // 2]


def host_ms(call, reps):
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time: every launch below only queues
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    dt = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return dt


for call in (fwd, fwd_bwd):
    for _ in range(3):
        call()
for name, call, reps in (("forward", fwd, 20), ("forward+backward", fwd_bwd, 8)):
    print(f"{shape} {name}: host {host_ms(call, reps):.3f} ms per call (GPU busy), "
          f"call from an idle GPU {gpu_ms(call):.3f} ms", flush=True)

torch.cuda.synchronize()
torch.cuda._sleep(1_000_000_000)
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    fwd()
prof.disable()
torch.cuda.synchronize()
print(f"\ncProfile of 20 forward calls ({shape}), by own time:")
pstats.Stats(prof).sort_stats("tottime").print_stats(22)
