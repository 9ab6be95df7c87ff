"""Diagnostic (not a test): host microseconds per real kernel launch, the GPU kept busy so launches only queue.

    python tests/gpu/bench_launch_real.py

For a few kernels of the qwen3-30b-a3b forward (loader.launch: packing + the exported wrapper, which also
builds TMA descriptors for the GEMMs) and, for scale, a torch op and a bare torch.empty.
"""
import torch

import layer_runs  # the script's folder is on sys.path
from mok_nn import bench
from mok_nn import cuda_backend as cb

p = bench.make_problem("qwen3-30b-a3b", 8192, "cuda")
x, ids, w, W13, W2 = p["x"], p["ids"], p["w"], p["gate_up_proj"], p["down_proj"]
E = W13.shape[0]
sched = cb.make_schedule(ids, E)
x_rows = cb.gather_rows(x, sched, skip_tail=True)
gate_up, h = cb.gate_up_act(x_rows, W13, sched, "swiglu", None)
out_rows = cb.grouped_gemm(h, W2, sched, transpose_w=False)
buf = torch.empty_like(x)

calls = {
    "torch.empty (1 MB)": lambda: torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
    "torch.add out=": lambda: torch.add(x, x, out=buf),
    "make_schedule (3 kernels)": lambda: cb.make_schedule(ids, E),
    "gather_rows (scatter)": lambda: cb.gather_rows(x, sched, skip_tail=True),
    "gate_up_act (GEMM, TMA)": lambda: cb.gate_up_act(x_rows, W13, sched, "swiglu", None),
    "grouped_gemm down (TMA)": lambda: cb.grouped_gemm(h, W2, sched, transpose_w=False),
    "combine": lambda: cb.combine(out_rows, sched.pos, w, ids, E, x.dtype),
}
for name, fn in calls.items():
    fn()
    print(f"{name:<28} {layer_runs.host_ms_busy(fn, 200) * 1e3:7.1f} us host per call", flush=True)
