"""Diagnostic (not a test): deepseek-v3's three independent backward GEMMs (dgrad of gate/up, the two weight
gradients), one after the other on every SM (today) against side by side on two streams, each on half the SMs
(the *_sm66 registry variants: persistent grids sized for 66 SMs). The question: does a write-heavy weight
gradient beside a compute-bound dgrad use the GPU better than either alone? Bits must not change.

    python tests/gpu/diag_backward_split.py [shape]
"""
import os
import sys

import torch

from layer_runs import median_ms_queued
from mok_nn import bench
from mok_nn import cuda_backend as cb

shape = sys.argv[1] if len(sys.argv) > 1 else "deepseek-v3"
p = bench.make_problem(shape, 8192, "cuda")
W13, W2 = p["gate_up_proj"], p["down_proj"]  # [E, 2I, H], [E, H, I]
E, two_i, H = W13.shape
I = two_i // 2
sched = cb.make_schedule(p["ids"], E)
counts = cb.expert_row_counts(p["ids"], E)
M = sched.capacity
g = torch.Generator(device="cuda").manual_seed(0)


def rows(n):
    return (torch.randn(M, n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)


dgu, x_rows, dy_rows, wh = rows(2 * I), rows(H), rows(H), rows(I)
dgrad_name = cb.gemm_kernel(True, torch.bfloat16, k=2 * I, pingpong=False)
wd_name = cb.wgrad_kernel(sched, I)
wgu_name = cb.wgrad_kernel(sched, H)
print(f"{shape}: dgrad {dgrad_name}, d down {wd_name}, d gate_up {wgu_name}; M = {M}", flush=True)
dx = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")


def dgrad(suffix=""):
    cb.launch_gemm(dgrad_name + suffix, dgu, W13.permute(2, 1, 0), dx, sched)


def wgrad(name, a, b):
    os.environ["MOK_WGRAD_KERNEL"] = name
    try:
        return cb.weight_grad(a, b, sched, counts)
    finally:
        del os.environ["MOK_WGRAD_KERNEL"]


def wd(suffix=""):
    return wgrad(wd_name + suffix, dy_rows, wh)


def wgu(suffix=""):
    return wgrad(wgu_name + suffix, dgu, x_rows)


print(f"  CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}", flush=True)


def bits(t):
    return t.view(torch.int16).clone()


for label, fn in (("dgrad", dgrad), ("d down", wd), ("d gate_up", wgu)):
    full = median_ms_queued(fn, 10)
    half = median_ms_queued(lambda: fn("_sm66"), 10)
    a = fn()
    a = bits(dx if a is None else a)
    b = fn("_sm66")
    b = bits(dx if b is None else b)
    print(f"  {label:10s} 132 SMs {full:7.3f} ms   66 SMs {half:7.3f} ms   ({half / full:.2f}x)  same bits: "
          f"{torch.equal(a, b)}", flush=True)


def sequential():
    dgrad()
    return wd(), wgu()


side = torch.cuda.Stream()


def side_by_side():
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    dgrad("_sm66")
    with torch.cuda.stream(side):
        a, b = wd("_sm66"), wgu("_sm66")
    main.wait_stream(side)
    for t in (a, b):
        t.record_stream(main)
    return a, b


seq = median_ms_queued(sequential, 10)
par = median_ms_queued(side_by_side, 10)
print(f"  all three: one after the other {seq:7.3f} ms   side by side on 66 + 66 SMs {par:7.3f} ms", flush=True)
dgrad()
want = (dx.clone(), *sequential())
torch.cuda.synchronize()
dx.fill_(float("nan"))
got = side_by_side()
torch.cuda.synchronize()
same = [torch.equal(u.view(torch.int16), v.view(torch.int16)) for u, v in zip(want, (dx, *got))]
print(f"  same bits (dx, d down, d gate_up): {same}", flush=True)
# the side stream's kernels alone, while the main stream idles: do two streams overlap here at all?
main = torch.cuda.current_stream()
t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
side.wait_stream(main)
t0.record()
dgrad("_sm66")
with torch.cuda.stream(side):
    wd("_sm66")
main.wait_stream(side)
t1.record()
torch.cuda.synchronize()
print(f"  dgrad_sm66 beside d down_sm66 once: {t0.elapsed_time(t1):7.3f} ms", flush=True)
