"""Diagnostic (not a test): time each stage of the CUDA experts path with CUDA events.

    python tests/gpu/profile_stages.py [shape] [tokens]

STAGE_ENERGY=1: also the energy per call of each stage (NVML counter, diag_energy.Nvml) over ~0.6 s of
back-to-back calls, with the mean power and SM clock: which stage costs the energy where the GPU runs at
its power limit (deepseek-v3).
"""
import os
import sys

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
p = bench.make_problem(shape, tokens, "cuda")
x, ids, w, W13, W2, dy = p["x"], p["ids"], p["w"], p["gate_up_proj"], p["down_proj"], p["dy"]
E = W13.shape[0]


nvml = None
if os.environ.get("STAGE_ENERGY") == "1":
    from diag_energy import Nvml, run_for

    nvml = Nvml(torch.cuda.current_device())


def timed(name, fn, reps=10):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        out = fn()
    e.record()
    e.synchronize()
    energy = ""
    if nvml is not None:
        _, joules, watts, mhz = run_for(fn, 0.6, nvml)
        energy = f"  {joules * 1e3:8.1f} mJ {watts:4.0f} W {mhz:5.0f} MHz"
    print(f"{shape:<14} {name:<22} {s.elapsed_time(e) / reps:8.3f} ms{energy}", flush=True)
    return out


sched = timed("schedule", lambda: cb.make_schedule(ids, E))
xr = timed("gather x", lambda: cb.gather_rows(x, sched))
gu = timed("gemm gate_up", lambda: cb.grouped_gemm(xr, W13, sched, transpose_w=False))
timed("gemm gate_up gather", lambda: cb.grouped_gemm_gather(x, W13, sched, transpose_w=False))  # MOK_GEMM_GATHER
h = timed("act fwd", lambda: cb.act_forward(gu, sched, "swiglu", None))
o = timed("gemm down", lambda: cb.grouped_gemm(h, W2, sched, transpose_w=False))
timed("combine", lambda: cb.combine(o, sched.pos, w, ids, E, x.dtype))
dyr = timed("gather dy", lambda: cb.gather_rows(dy, sched))
dh = timed("gemm dgrad down f32", lambda: cb.grouped_gemm(dyr, W2, sched, transpose_w=True, out_dtype=torch.float32))
timed("gemm dgrad down gather",
      lambda: cb.grouped_gemm_gather(dy, W2, sched, transpose_w=True, out_dtype=torch.float32))
wr = cb.row_weights(sched, w)
dgu, wh, dwr = timed("act bwd", lambda: cb.act_backward(gu, dh, wr, sched, "swiglu", None))
dxr = timed("gemm dgrad gate_up", lambda: cb.grouped_gemm(dgu, W13, sched, transpose_w=True))
timed("combine dx", lambda: cb.combine(dxr, sched.pos, torch.ones_like(w), ids, E, x.dtype))
counts = cb.expert_row_counts(ids, E)
timed("torch wgrad down", lambda: torch._grouped_mm(dyr.t(), wh, offs=sched.seg_end))
timed("torch wgrad gate_up", lambda: torch._grouped_mm(dgu.t(), xr, offs=sched.seg_end))
timed("mok wgrad down", lambda: cb.weight_grad(dyr, wh, sched, counts))
timed("mok wgrad gate_up", lambda: cb.weight_grad(dgu, xr, sched, counts))
used = int(sched.seg_end[-1])
H, I = W2.shape[1], W2.shape[2]
print(f"rows used {used} of capacity {sched.capacity}; tokens*k {ids.numel()}")
for name, n, k in (("gate_up", 2 * I, H), ("down", H, I)):
    a = torch.randn(used, k, device="cuda", dtype=torch.bfloat16)
    Wt = torch.randn(E, n, k, device="cuda", dtype=torch.bfloat16)
    ref = timed(f"torch _grouped_mm {name}", lambda: torch._grouped_mm(a, Wt.transpose(1, 2), offs=sched.seg_end))
    flops = 2 * used * n * k
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a2 = torch.cat([a, a.new_zeros(sched.capacity - used, k)])
    cb.grouped_gemm(a2, Wt, sched, transpose_w=False)
    torch.cuda.synchronize()
    s.record()
    for _ in range(10):
        cb.grouped_gemm(a2, Wt, sched, transpose_w=False)
    e.record()
    e.synchronize()
    t = s.elapsed_time(e) / 10
    print(f"{shape:<14} mok gemm {name:<13} {t:8.3f} ms  {flops / t / 1e9:7.1f} TFLOP/s (padded rows)", flush=True)
