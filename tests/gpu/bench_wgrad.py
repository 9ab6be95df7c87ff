"""Diagnostic (not a test): the weight-gradient GEMM variants vs torch._grouped_mm, per benchmark shape.

    python tests/gpu/bench_wgrad.py [--kernels a,b] [--best FILE]

Times d down_proj (dy_rows^T @ wh) and d gate_up_proj (dgu^T @ x_rows) on the
bench's routing at 8192 tokens; TFLOP/s count routed rows only. Also times a
plain fill of the largest output (write-bandwidth reference). With --best, the
variant with the lowest total time over all shapes is written to FILE.
"""

import argparse
import os

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb
from mok_nn.kernels import registry


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--best", default=None)
    ap.add_argument("--shapes", default="deepseek-v3,mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--kernels", default=",".join(registry.WGRAD_KERNELS), help="variants to time")
    args = ap.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    totals = {}
    for shape in args.shapes.split(","):
        hidden, inter, num_experts, top_k = bench.SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(8192, hidden, device="cuda", generator=g)
        router = torch.randn(num_experts, hidden, device="cuda", generator=g) / hidden**0.5
        ids = torch.topk(x @ router.T, top_k, dim=-1).indices
        sched = cb.make_schedule(ids, num_experts)
        counts = cb.expert_row_counts(ids, num_experts)
        rows = ids.numel()
        bf = torch.bfloat16
        dy_rows = cb.gather_rows(torch.randn(8192, hidden, device="cuda", dtype=bf), sched)
        x_rows = cb.gather_rows(torch.randn(8192, hidden, device="cuda", dtype=bf), sched)
        wh = cb.gather_rows(torch.randn(8192, inter, device="cuda", dtype=bf), sched)
        dgu = cb.gather_rows(torch.randn(8192, 2 * inter, device="cuda", dtype=bf), sched)
        del x, router
        for name, a, b in (("down", dy_rows, wh), ("gate_up", dgu, x_rows)):
            flops = 2 * rows * a.shape[1] * b.shape[1]
            out_gb = num_experts * a.shape[1] * b.shape[1] * 2 / 1e9
            t = timed(lambda: torch._grouped_mm(a.t(), b, offs=sched.seg_end))
            print(f"{shape:<14} {name:<8} torch._grouped_mm          {t:8.3f} ms {flops / t / 1e9:6.1f} TF/s", flush=True)
            totals.setdefault("torch", 0.0)
            totals["torch"] += t
            for kernel in kernels:
                os.environ["MOK_WGRAD_KERNEL"] = kernel
                for gm in ("0", "8"):
                    os.environ["MOK_WGRAD_GROUP_M"] = gm
                    t = timed(lambda: cb.weight_grad(a, b, sched, counts))
                    print(f"{shape:<14} {name:<8} {kernel:<24} g{gm} {t:8.3f} ms {flops / t / 1e9:6.1f} TF/s "
                          f"{out_gb / t:6.2f} TB/s out", flush=True)
                    if gm == "0":
                        totals[kernel] = totals.get(kernel, 0.0) + t
            os.environ.pop("MOK_WGRAD_KERNEL")
            os.environ.pop("MOK_WGRAD_GROUP_M")
        out = torch.empty(num_experts, 2 * inter, hidden, device="cuda", dtype=bf)
        t = timed(lambda: out.fill_(1.0))
        print(f"{shape:<14} fill of {out.numel() * 2 / 1e9:.1f} GB: {t:.3f} ms, {out.numel() * 2 / 1e9 / t:.2f} TB/s", flush=True)
        del out, dy_rows, x_rows, wh, dgu
        torch.cuda.empty_cache()
    for k, v in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"total {k:<24} {v:8.3f} ms")
    best = min((k for k in totals if k != "torch"), key=totals.get)
    print(f"best variant: {best}")
    if args.best:
        with open(args.best, "w") as f:
            f.write(best)


if __name__ == "__main__":
    main()
