"""How long does each stage of the CUDA experts path take? CUDA-event times per stage, forward and backward,
on a benchmark shape, with torch's grouped GEMM on the same rows for scale.

    python benchmarks/profile_stages.py [--shape deepseek-v3] [--tokens 8192] [--reps 10]
"""
import argparse

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb


def timed(label, name, fn, reps):
    """fn's result; prints its mean ms over reps back-to-back calls after one warm-up."""
    out = fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        out = fn()
    e.record()
    e.synchronize()
    print(f"{label:<14} {name:<26} {s.elapsed_time(e) / reps:8.3f} ms", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s in bench.SHAPES if s != "tiny"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    p = bench.make_problem(a.shape, a.tokens, "cuda")
    x, ids, w, W13, W2, dy = p["x"], p["ids"], p["w"], p["gate_up_proj"], p["down_proj"], p["dy"]
    E, I, H = W13.shape[0], W2.shape[2], W2.shape[1]

    def t(name, fn):
        return timed(a.shape, name, fn, a.reps)

    sched = t("schedule", lambda: cb.make_schedule(ids, E))
    xr = t("gather x", lambda: cb.gather_rows(x, sched))
    if cb.use_fused_act(I, "swiglu", False, H):
        gu, h = t("gemm gate_up + act", lambda: cb.gate_up_act(xr, W13, sched, "swiglu", None))
    else:
        gu = t("gemm gate_up", lambda: cb.grouped_gemm(xr, W13, sched, transpose_w=False))
        h = t("act fwd", lambda: cb.act_forward(gu, sched, "swiglu", None))
    o = t("gemm down", lambda: cb.grouped_gemm(h, W2, sched, transpose_w=False))
    t("combine", lambda: cb.combine(o, sched.pos, w, ids, E, x.dtype))
    dyr = t("gather dy", lambda: cb.gather_rows(dy, sched))
    wr = cb.row_weights(sched, w)
    dgu, wh, _ = t("dgrad down + act bwd", lambda: cb.dgrad_down_act([dyr], W2, gu, wr, sched, "swiglu", None))
    dxr = t("gemm dgrad gate_up", lambda: cb.grouped_gemm(dgu, W13, sched, transpose_w=True))
    t("combine dx", lambda: cb.combine(dxr, sched.pos, torch.ones_like(w), ids, E, x.dtype))
    counts = cb.expert_row_counts(ids, E)
    t("wgrad down", lambda: cb.weight_grad(dyr, wh, sched, counts))
    t("wgrad gate_up", lambda: cb.weight_grad(dgu, xr, sched, counts))

    used = int(sched.seg_end[-1])
    print(f"rows used {used} of capacity {sched.capacity}; tokens*k {ids.numel()}")
    for name, rows, weight in (("gate_up", xr, W13), ("down", h, W2)):
        flops = 2 * used * weight.shape[1] * weight.shape[2]
        for impl, fn in (("mok", lambda: cb.grouped_gemm(rows, weight, sched, transpose_w=False)),
                         ("torch _grouped_mm", lambda: torch._grouped_mm(rows[:used], weight.transpose(1, 2),
                                                                         offs=sched.seg_end))):
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()
            s.record()
            for _ in range(a.reps):
                fn()
            e.record()
            e.synchronize()
            ms = s.elapsed_time(e) / a.reps
            print(f"{a.shape:<14} {impl + ' ' + name:<26} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
