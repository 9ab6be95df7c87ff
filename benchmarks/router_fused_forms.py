"""The fused router (router.route_tokens: the logits GEMM and the routing in one Triton kernel) against the two
steps it replaces (router_logits' cuBLAS GEMM, then triton_ops.route), on the GPU:

  kernels  per shape at --tokens: GPU us per call (torch.profiler) and host us per call (the GPU busy) of the two
           steps and of route_tokens, then the fused kernel's forms (rows per program, warps, stages, K step),
           each form's ids compared with route_tokens'. The forms chosen in triton_ops (ROUTER_*) come from here.
  --layer  the whole qwen3 layer (or --shape) with the fused router and with the two steps, in one process, in
           alternating rounds, beside the routed experts alone: ms from an idle GPU (medians) and host ms per forward.

    python benchmarks/router_fused_forms.py [--tokens 8192]
    python benchmarks/router_fused_forms.py --layer [--shape qwen3-30b-a3b] [--rounds 3]
"""

import argparse

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from mok_nn import bench, router, triton_ops
from steps import bench_steps, host_ms_busy, layer_steps, median_ms  # benchmarks/ is on sys.path when run as a script

FORMS = [(64, 4, 3, 64), (64, 8, 3, 64), (128, 8, 3, 64), (32, 4, 3, 64), (64, 4, 4, 64), (64, 4, 3, 128),
         (64, 8, 4, 128), (128, 4, 3, 64)]  # (rows per program, warps, stages, K step)


def kernel_us(fn, n=20):
    """GPU us per call: the kernels' time over n calls (torch.profiler), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / n


def kernels(tokens):
    for shape in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"):
        hidden, _, e, k = bench.SHAPES[shape]
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        w = (torch.randn(e, hidden, device="cuda") / hidden**0.5).bfloat16()
        two = lambda: triton_ops.route(router.router_logits(x, w), k, "softmax", True, 1.0, None)  # noqa: E731
        fused = lambda: router.route_tokens(x, w, None, k)  # noqa: E731
        with torch.no_grad():
            print(f"{shape}: two steps {kernel_us(two):.1f} us GPU, {host_ms_busy(two, 20) * 1e3:.1f} us host | "
                  f"route_tokens {kernel_us(fused):.1f} us GPU, {host_ms_busy(fused, 20) * 1e3:.1f} us host", flush=True)
            want = router.route_tokens(x, w, None, k)[1]
            logits, scores = (torch.empty(tokens, e, device="cuda") for _ in range(2))
            ids = torch.empty(tokens, k, dtype=torch.int64, device="cuda")
            wts = torch.empty(tokens, k, device="cuda")
            for rows, warps, stages, step in FORMS:
                def call():
                    triton_ops.kernels.router_forward_kernel[(-(-tokens // rows),)](
                        x, w, x, logits, logits, ids, wts, scores, tokens, e, hidden, 1.0, K=k,
                        KP=triton.next_power_of_2(k), SOFTMAX=True, HAS_LBIAS=False, HAS_BIAS=False, NORM=True,
                        ROWS=rows, BLOCK=max(16, triton.next_power_of_2(e)), BLOCK_K=step, num_warps=warps,
                        num_stages=stages)
                form = f"rows {rows} warps {warps} stages {stages} K step {step}"
                try:
                    us = kernel_us(call)
                    print(f"   {form}: {us:.1f} us, ids same {torch.equal(ids, want)}", flush=True)
                except Exception as err:  # noqa: BLE001 - e.g. more shared memory than the GPU has
                    print(f"   {form}: failed {type(err).__name__}: {str(err)[:150]}", flush=True)


def layer(shape, tokens, rounds):
    fwd, fwd_bwd = (call for _, call in layer_steps(shape, tokens))
    e_fwd, e_fwd_bwd = (call for _, call in bench_steps(shape, tokens))
    runs_on = triton_ops.router_runs_on
    res = {}
    for _ in range(rounds):
        for name, fused in (("fused router", True), ("two steps", False)):
            triton_ops.router_runs_on = runs_on if fused else (lambda *a, **k: False)
            for _ in range(3):
                fwd()
                fwd_bwd()
            res.setdefault(name, []).append((median_ms(fwd, 30), median_ms(fwd_bwd, 20), host_ms_busy(fwd, 20)))
        res.setdefault("routed experts", []).append((median_ms(e_fwd, 30), median_ms(e_fwd_bwd, 20),
                                                     host_ms_busy(e_fwd, 20)))
    triton_ops.router_runs_on = runs_on
    for name, r in res.items():
        print(f"{shape} {name}: fwd ms {[round(a, 3) for a, _, _ in r]}, fwd+bwd ms {[round(b, 3) for _, b, _ in r]}, "
              f"host fwd ms {[round(c, 3) for _, _, c in r]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layer", action="store_true")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s in bench.SHAPES if s != "tiny"])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.layer:
        layer(a.shape, a.tokens, a.rounds)
    else:
        kernels(a.tokens)


if __name__ == "__main__":
    main()
