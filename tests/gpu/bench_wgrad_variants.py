"""Diagnostic (not a test): the weight-gradient GEMM variants vs torch._grouped_mm, per benchmark shape.

    python tests/gpu/bench_wgrad_variants.py [--kernels a,b] [--shapes s,t] [--group-m 0,8] [--best FILE]

Times d down_proj (dy_rows^T @ wh) and d gate_up_proj (dgu^T @ x_rows) on a
random router's routing at 8192 tokens (median of --reps launches); TFLOP/s
count routed rows only. Each variant's output (written into a NaN-poisoned
buffer) is checked bitwise against the default variant (cuda_backend.WGRAD_KERNEL)
and by relative L2 error against torch._grouped_mm. Also times the diagnostic
kernels (registry.WGRAD_DIAG_KERNELS: the _defer kernel without its stores /
without its MMA; their outputs are meaningless) and a plain fill of the largest
output (write-bandwidth reference). Writes bench_wgrad_variants.json and
bench_wgrad_variants.txt to $OUT (default /tmp). Exit status 1 if a check fails.
"""

import argparse
import json
import os
import pathlib
import sys

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb
from mok_nn.kernels import registry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from layer_runs import median_ms, rel_err  # noqa: E402

TOL = 1e-2  # relative L2 vs torch: two bf16 roundings of fp32 sums taken in different orders


def launch_into(kernel, a, b, sched, counts, out):
    """The variant's output written into `out` (poisoned by the caller), group_m as weight_grad picks it."""
    cb._lib().launch(kernel, a.t().unsqueeze(-1), b.t().unsqueeze(-1), out.permute(1, 2, 0),
                     sched.seg_end, counts, cb.wgrad_group_m(kernel, b.shape[1]),
                     stream=torch.cuda.current_stream().cuda_stream)  # fmt: skip
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--best", default=None)
    ap.add_argument("--shapes", default="deepseek-v3,mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--kernels", default=",".join(registry.WGRAD_KERNELS), help="variants to time")
    ap.add_argument("--group-m", default="0", help="MOK_WGRAD_GROUP_M values to time (0: weight_grad's choice)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--diag", type=int, default=1, help="1: also time the diagnostic kernels (no stores / no MMA)")
    args = ap.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    kernels.sort(key=lambda k: k != cb.WGRAD_KERNEL)  # the default first: the others are compared with it
    out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    lines, records, totals, failures = [], [], {}, []

    def say(line):
        print(line, flush=True)
        lines.append(line)

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
        dy_rows = cb.gather_rows(torch.randn(8192, hidden, device="cuda", dtype=bf, generator=g), sched)
        x_rows = cb.gather_rows(torch.randn(8192, hidden, device="cuda", dtype=bf, generator=g), sched)
        wh = cb.gather_rows(torch.randn(8192, inter, device="cuda", dtype=bf, generator=g), sched)
        dgu = cb.gather_rows(torch.randn(8192, 2 * inter, device="cuda", dtype=bf, generator=g), sched)
        del x, router
        for gemm, a, b in (("down", dy_rows, wh), ("gate_up", dgu, x_rows)):
            flops = 2 * rows * a.shape[1] * b.shape[1]
            out_gb = num_experts * a.shape[1] * b.shape[1] * 2 / 1e9
            want = torch._grouped_mm(a.t(), b, offs=sched.seg_end)
            t = median_ms(lambda: torch._grouped_mm(a.t(), b, offs=sched.seg_end), args.reps)
            say(f"{shape:<14} {gemm:<8} {'torch._grouped_mm':<26}    {t:8.3f} ms {flops / t / 1e9:6.1f} TF/s")
            records.append(dict(shape=shape, gemm=gemm, impl="torch._grouped_mm", group_m=None, ms=t,
                                tflops=flops / t / 1e9, out_tbps=out_gb / t))  # fmt: skip
            totals["torch"] = totals.get("torch", 0.0) + t
            base = None
            for kernel in kernels:
                got = torch.full_like(want, float("nan"))
                launch_into(kernel, a, b, sched, counts, got)
                torch.cuda.synchronize()
                if kernel == cb.WGRAD_KERNEL:
                    base, bitwise = got, True
                else:
                    bitwise = None if base is None else bool(torch.equal(got, base))
                err = rel_err(got, want)
                ok = bitwise is not False and err < TOL and not torch.isnan(got).any()
                if not ok:
                    failures.append(f"{shape} {gemm} {kernel}: bitwise={bitwise} rel_err={err:.2e}")
                if got is not base:
                    del got
                os.environ["MOK_WGRAD_KERNEL"] = kernel
                for gm in args.group_m.split(","):
                    os.environ["MOK_WGRAD_GROUP_M"] = gm
                    t = median_ms(lambda: cb.weight_grad(a, b, sched, counts), args.reps)
                    say(f"{shape:<14} {gemm:<8} {kernel:<26} g{gm} {t:8.3f} ms {flops / t / 1e9:6.1f} TF/s "
                        f"{out_gb / t:6.2f} TB/s out  bitwise={bitwise} err={err:.1e}{'' if ok else '  FAIL'}")
                    records.append(dict(shape=shape, gemm=gemm, impl=kernel, group_m=int(gm), ms=t,
                                        tflops=flops / t / 1e9, out_tbps=out_gb / t,
                                        bitwise_vs_default=bitwise, rel_err_vs_torch=err))  # fmt: skip
                    if gm == args.group_m.split(",")[0]:
                        totals[kernel] = totals.get(kernel, 0.0) + t
                os.environ.pop("MOK_WGRAD_KERNEL")
                os.environ.pop("MOK_WGRAD_GROUP_M")
            for kernel in registry.WGRAD_DIAG_KERNELS if args.diag else ():  # the two sides of the bound
                scratch = torch.empty_like(want)
                t = median_ms(lambda k=kernel, o=scratch: launch_into(k, a, b, sched, counts, o), args.reps)
                say(f"{shape:<14} {gemm:<8} {kernel:<26}    {t:8.3f} ms {flops / t / 1e9:6.1f} TF/s "
                    f"{out_gb / t:6.2f} TB/s out  (diagnostic)")
                records.append(dict(shape=shape, gemm=gemm, impl=kernel, group_m=0, ms=t, tflops=flops / t / 1e9,
                                    out_tbps=out_gb / t, diagnostic=True))  # fmt: skip
                del scratch
            del base, want
            torch.cuda.empty_cache()
        out = torch.empty(num_experts, 2 * inter, hidden, device="cuda", dtype=bf)
        t = median_ms(lambda o=out: o.fill_(1.0), args.reps)
        gb = out.numel() * 2 / 1e9
        say(f"{shape:<14} fill of {gb:.1f} GB: {t:.3f} ms, {gb / t:.2f} TB/s")
        records.append(dict(shape=shape, gemm="fill", impl="fill_", ms=t, out_tbps=gb / t))
        del out, dy_rows, x_rows, wh, dgu
        torch.cuda.empty_cache()
    for k, v in sorted(totals.items(), key=lambda kv: kv[1]):
        say(f"total {k:<26} {v:8.3f} ms")
    best = min((k for k in totals if k != "torch"), key=totals.get)
    say(f"best variant: {best}")
    for f in failures:
        say(f"FAIL {f}")
    say("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    (out_dir / "bench_wgrad_variants.json").write_text(json.dumps(records, indent=1))
    (out_dir / "bench_wgrad_variants.txt").write_text("\n".join(lines) + "\n")
    if args.best:
        with open(args.best, "w") as f:
            f.write(best)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
