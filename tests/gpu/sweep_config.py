"""Sweep of MoKConfig's knobs at the benchmark shapes (not a test): which values are fastest, what each
costs in memory, and whether the defaults are the right ones.

    python tests/gpu/sweep_config.py [--shapes ...] [--tokens 8192] [--iters 15]          (EP=1)
    torchrun --nproc_per_node 2 tests/gpu/sweep_config.py                                  (EP=2)

The knobs the layer reads (MoKConfig's docstring):
  macrobatch_size               None (one pass), T/2, T/4: passes of that many tokens (every EP size);
  schedule_capacity_multiplier  2.0 (default), 1.25: each rank's expert buffers (EP only);
  fwd_num_comm_sms              8, 16, 32 with the overlapped forward (MOK_EP_FWD=overlap; EP only).
bwd_num_comm_sms and minibatch_size drive nothing yet (no overlapped backward, the overlapped forward's
readiness unit is a GEMM tile), so they are not swept. Settings that only env variables choose (row
modes, kernel variants) are compared by tests/gpu/bench_env_modes.py.

Every configuration is timed side by side with the others and the baseline in one process
(bench.measure: rotated order inside each iteration, medians, the slowest rank's times); before timing,
y of every configuration is checked bitwise against the default's (passes and the overlapped forward keep
y's bits; exit status 1 otherwise). Prints a table and, per shape, the fastest configuration (forward +
backward) and how far the default is from it; writes sweep_config_ep<P>.json to $OUT (default /tmp).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("MOK_EP_TIMEOUT_S", "20")  # an overlapped forward that stalls raises instead of hanging

import torch  # noqa: E402

from bench_env_modes import timing_line, timing_record, with_env, write_out  # noqa: E402
from layer_runs import torchrun_group  # noqa: E402
from mok_nn import MoKConfig, bench  # noqa: E402

ENV_KEYS = ["MOK_EP_FWD"]


def configurations(tokens: int, world: int) -> dict:
    """{name: (MoKConfig, env)}; the first is the default."""
    out = {"default": (MoKConfig(), {})}
    for parts in (2, 4):
        out[f"macrobatch_{tokens // parts}"] = (MoKConfig(macrobatch_size=tokens // parts), {})
    if world > 1:
        out["capacity_1.25"] = (MoKConfig(schedule_capacity_multiplier=1.25), {})
        for sms in (8, 16, 32):
            out[f"overlap_{sms}"] = (MoKConfig(fwd_num_comm_sms=sms), {"MOK_EP_FWD": "overlap"})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_config.py needs a CUDA GPU (the knobs drive the CUDA kernels)")
    group, rank, world = torchrun_group()
    configs = configurations(args.tokens, world)
    impls = {name: with_env(bench.mok_experts("cuda", group, cfg), env, ENV_KEYS)
             for name, (cfg, env) in configs.items()}
    impls["baseline"] = bench.baseline_experts if world == 1 else bench.baseline_experts_ep(group)
    records, ok, lines = [], True, []
    for shape in args.shapes.split(","):
        hidden, inter, _, top_k = bench.SHAPES[shape]
        p = bench.make_problem(shape, args.tokens, "cuda", ep_size=world, ep_rank=rank)
        y_default, same_y = None, {}
        for name in configs:
            with torch.no_grad():
                y = impls[name](p["x"], p["ids"], p["w"], p["gate_up_proj"], p["down_proj"])
            y_default = y if y_default is None else y_default
            same_y[name] = torch.equal(y, y_default)
            ok &= same_y[name]
        del y, y_default
        m = bench.measure(impls, p, "cuda", args.iters, 3, group)
        flops = 6 * args.tokens * top_k * hidden * inter
        for name in m:
            records.append(timing_record(m, name, flops, dict(shape=shape, ep=world, config=name),
                                         y_bitwise_eq_default=same_y.get(name)))
            label = f"{shape:<15} EP={world} {name:<16}"
            lines.append(timing_line(records[-1], label, f"y bits={same_y.get(name, '-')}"))
        total = {name: m[name][0] + m[name][1] for name in configs}
        best = min(total, key=total.get)
        lines.append(f"{shape}: fastest {best} ({total[best]:.3f} ms fwd+bwd); the default "
                     f"{total['default']:.3f} ms, {100 * (total['default'] / total[best] - 1):+.1f}%")
        if rank == 0:
            print("\n".join(lines[-len(m) - 1:]), flush=True)
        del p
        torch.cuda.empty_cache()
    if rank == 0:
        write_out(f"sweep_config_ep{world}.json", json.dumps(records, indent=1))
        write_out(f"sweep_config_ep{world}.txt", "\n".join(lines) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
