"""Op-by-op CPU profile of the routed experts' forward + backward: mok_nn's portable backend (MoKFunction,
backend="torch") vs transformers' default experts implementation (grouped_mm), same weights and routing.

    PYTHONPATH=. python benchmarks/profile_cpu_experts.py [--shape small|mid] [--dtype bf16|fp32]
        [--precision bf16|mxfp8] [--iters 20] [--table] [--only mok|hf]

Prints the median fwd+bwd time of each (interleaved) and, with --table, torch.profiler's op table of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mok_nn import functional  # noqa: E402
from mok_nn.autograd import MoKFunction  # noqa: E402
from mok_nn.router import route  # noqa: E402

SHAPES = {"small": dict(T=1024, H=256, I=128, E=32, k=4), "mid": dict(T=4096, H=512, I=256, E=32, k=4)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _HFExperts(torch.nn.Module):
    def __init__(self, w13, w2):
        super().__init__()
        self.num_experts = w13.shape[0]
        self.gate_up_proj = torch.nn.Parameter(w13)
        self.down_proj = torch.nn.Parameter(w2)
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self._is_expert_parallel = False
        self.has_post_expert_norm = False
        self.act_fn = torch.nn.functional.silu

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="small")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--precision", choices=("bf16", "mxfp8"), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--only", choices=("mok", "hf"), default=None)
    ap.add_argument("--frozen", action="store_true", help="expert weights without gradients (mok only)")
    args = ap.parse_args(argv)
    s, dt = SHAPES[args.shape], DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s["T"], s["H"], generator=g).to(dt)
    w13 = (torch.randn(s["E"], 2 * s["I"], s["H"], generator=g) / s["H"] ** 0.5).to(dt)
    w2 = (torch.randn(s["E"], s["H"], s["I"], generator=g) / s["I"] ** 0.5).to(dt)
    logits = torch.randn(s["T"], s["E"], generator=g)
    ids, w, _ = route(logits, s["k"])
    dy = torch.randn(s["T"], s["H"], generator=g).to(dt)
    ws = functional.get_workspace(hidden_size=s["H"], intermediate_size=s["I"], num_experts=s["E"], top_k=s["k"],
                                  dtype=dt, backend="torch", precision=args.precision)
    p13 = w13.clone().requires_grad_(not args.frozen)
    p2 = w2.clone().requires_grad_(not args.frozen)

    def mok():
        xx, ww = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        y = MoKFunction.apply(xx, ww, p13, p2, None, None, ids, ws)
        y.backward(dy)

    from transformers.integrations.moe import grouped_mm_experts_forward

    hf_mod = _HFExperts(w13.clone(), w2.clone())

    def hf():
        xx, ww = x.detach().requires_grad_(True), w.to(dt).detach().requires_grad_(True)
        y = grouped_mm_experts_forward(hf_mod, xx, ids, ww)
        y.backward(dy)

    fns = {"mok": mok, "hf": hf}
    if args.only:
        fns = {args.only: fns[args.only]}
    for f in fns.values():
        for _ in range(3):
            f()
    times = {n: [] for n in fns}
    names = list(fns)
    for i in range(args.iters):
        for n in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    print(f"shape={args.shape} {s} dtype={args.dtype} precision={args.precision} threads={torch.get_num_threads()} "
          f"load={os.getloadavg()[0]:.2f}")
    for n, t in times.items():
        print(f"  {n:4s} fwd+bwd median {statistics.median(t):7.2f} ms  (min {min(t):.2f})")
    if args.table:
        from torch.profiler import ProfilerActivity, profile

        for n, f in fns.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    f()
            print(f"=== {n} (5 calls)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
