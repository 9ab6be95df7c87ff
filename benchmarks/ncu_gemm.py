"""Diagnostic (not a test): launch one grouped GEMM of a benchmark shape a few times, for ncu.

    ncu --launch-skip 2 --launch-count 1 -k regex:VarlenMGroupedGemm --section SpeedOfLight \\
        python tests/gpu/ncu_gemm.py deepseek-v3 gate_up

gemm: gate_up (x_rows @ W13^T), gate_up_act (the same with the activation in its epilogue, cb.gate_up_act),
down (h @ W2^T), dgrad_gu (dgu @ W13), dact (the dgrad of down with the activation
backward, cb.dgrad_down_act). MOK_GEMM_EPI / MOK_GEMM_PINGPONG pick the variant as in the layer.
Three launches: two to warm up, one to profile.
"""
import sys

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

shape = sys.argv[1] if len(sys.argv) > 1 else "deepseek-v3"
gemm = sys.argv[2] if len(sys.argv) > 2 else "gate_up"
p = bench.make_problem(shape, 8192, "cuda")
W13, W2 = p["gate_up_proj"], p["down_proj"]
sched = cb.make_schedule(p["ids"], W13.shape[0])
rows = cb.gather_rows(p["x"], sched)
if gemm == "gate_up_act":
    for _ in range(3):
        cb.gate_up_act(rows, W13, sched, "swiglu", None)
    torch.cuda.synchronize()
    raise SystemExit(print(f"{shape} gate_up_act: rows {rows.shape[0]}, done"))
if gemm == "dact":  # the dgrad of down with the activation backward (fused where the layer fuses it)
    gu = torch.randn(rows.shape[0], W13.shape[1], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows.shape[0], W2.shape[1], device="cuda", dtype=torch.bfloat16)
    w_rows = torch.rand(rows.shape[0], device="cuda")
    for _ in range(3):
        cb.dgrad_down_act(dy, W2, gu, w_rows, sched, "swiglu", None)
    torch.cuda.synchronize()
    raise SystemExit(print(f"{shape} dact: rows {rows.shape[0]}, done"))
if gemm == "gate_up":
    a, w, transpose = rows, W13, False
elif gemm == "down":
    a, w, transpose = torch.randn(rows.shape[0], W2.shape[2], device="cuda", dtype=torch.bfloat16), W2, False
elif gemm == "dgrad_gu":
    a, w, transpose = torch.randn(rows.shape[0], W13.shape[1], device="cuda", dtype=torch.bfloat16), W13, True
else:
    raise SystemExit(f"unknown gemm {gemm}")
for _ in range(3):
    cb.grouped_gemm(a, w, sched, transpose_w=transpose)
torch.cuda.synchronize()
print(f"{shape} {gemm}: kernel {cb.gemm_kernel(transpose, k=a.shape[1])}, rows {a.shape[0]}, done")
