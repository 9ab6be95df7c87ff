"""What limits one grouped GEMM of a benchmark shape? Launches it three times (two to warm up, one to
profile) for Nsight Compute, e.g.

    ncu --launch-skip 2 --launch-count 1 -k regex:GroupedGemm --section SpeedOfLight \\
        python benchmarks/ncu_gemm.py --shape deepseek-v3 --gemm gate_up

gemm: gate_up (x rows @ W13^T), gate_up_act (the same with the activation in its epilogue), down (h @ W2^T),
dgrad_gu (d gate_up @ W13), dact (the dgrad of down with the activation backward, fused where the layer
fuses it). The kernel variant is the one the layer runs at this shape. --mx: the forward's GEMMs (gate_up,
gate_up_act, down) of MXFP8-only weights, by the _mx kernels (the weights quantised from the bf16 ones).
"""
import argparse

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb
from mok_nn import cuda_mx
from mok_nn.mxfp8 import quantize

GEMMS = ("gate_up", "gate_up_act", "down", "dgrad_gu", "dact")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="deepseek-v3", choices=[s for s in bench.SHAPES if s != "tiny"])
    ap.add_argument("--gemm", default="gate_up", choices=GEMMS)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--mx", action="store_true", help="MXFP8-only weights: the _mx kernels (forward GEMMs)")
    a = ap.parse_args()
    if a.mx and a.gemm not in ("gate_up", "gate_up_act", "down"):
        ap.error("--mx: the forward's GEMMs only (gate_up, gate_up_act, down)")
    p = bench.make_problem(a.shape, a.tokens, "cuda")
    W13, W2 = p["gate_up_proj"], p["down_proj"]
    sched = cb.make_schedule(p["ids"], W13.shape[0])
    rows = cb.gather_rows(p["x"], sched)
    m, two_i, hidden = rows.shape[0], W13.shape[1], W2.shape[1]

    def rand(cols):
        return torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)

    if a.mx:
        mx13, mx2 = (cuda_mx.MxWeight(q.data, q.scale) for q in (quantize(W13, axis=-1), quantize(W2, axis=-1)))
        h_rows = rand(two_i // 2) if a.gemm == "down" else None
        call = {"gate_up": lambda: cb.gemm_mx(rows, mx13, sched),
                "gate_up_act": lambda: cb.launch_gate_up_act(rows, mx13, sched, "swiglu", None),
                "down": lambda: cb.gemm_mx(h_rows, mx2, sched)}[a.gemm]
    elif a.gemm == "gate_up_act":
        call = lambda: cb.gate_up_act(rows, W13, sched, "swiglu", None)  # noqa: E731
    elif a.gemm == "dact":
        gu, dy, w_rows = rand(two_i), rand(hidden), torch.rand(m, device="cuda")
        call = lambda: cb.dgrad_down_act([dy], W2, gu, w_rows, sched, "swiglu", None)  # noqa: E731
    else:
        a_rows, w, transpose = {"gate_up": (rows, W13, False), "down": (rand(two_i // 2), W2, False),
                                "dgrad_gu": (rand(two_i), W13, True)}[a.gemm]
        call = lambda: cb.grouped_gemm(a_rows, w, sched, transpose_w=transpose)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(f"{a.shape} {a.gemm}: {m} rows (capacity), done")


if __name__ == "__main__":
    main()
