"""What do MoKConfig.macrobatch_size passes cost against one pass, in time and memory, per benchmark shape?

    python benchmarks/macrobatch.py [--shapes a,b] [--sizes 4096,2048] [--tokens 8192] [--commit SHA]
    torchrun --nproc_per_node 2 benchmarks/macrobatch.py ...     (EP = world size)

Times forward and backward (bench.measure: rotated order, medians, the slowest rank's) of the routed
experts in one pass and in passes of each size, with the peak memory above inputs and parameters and
the workspace's bytes (the EP symmetric buffer, sized by a pass). Checks first that y, d x and d
topk-weights equal the one-pass bits and the expert gradients are close. Writes
macrobatch_ep<P>.json to $OUT (default /tmp). Exit status 1 if a check fails.
"""

import argparse
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

from mok_nn import MoKConfig, bench, functional
from steps import torchrun_group  # benchmarks/ is on sys.path when run as a script


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--sizes", default="4096,2048")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--commit", default="unknown", help="recorded in the JSON")
    args = ap.parse_args()
    group, rank, world = torchrun_group()
    out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
    records, failed = [], False
    for shape in args.shapes.split(","):
        hidden, inter, num_experts, top_k = bench.SHAPES[shape]
        p = bench.make_problem(shape, args.tokens, "cuda", ep_size=world, ep_rank=rank)
        configs = {"one pass": None}
        configs.update({f"passes of {s}": MoKConfig(minibatch_size=min(1024, s), macrobatch_size=s)
                        for s in map(int, args.sizes.split(","))})
        impls = {name: bench.mok_experts("cuda", group, cfg) for name, cfg in configs.items()}
        one = None
        for name, fn in impls.items():
            x, w, gu, dn = bench._leaves(p)
            y = fn(x, p["ids"], w, gu, dn)
            y.backward(p["dy"])
            got = (y.detach(), x.grad, w.grad, gu.grad, dn.grad)
            if one is None:
                one = got
                continue
            same = all(torch.equal(a, b) for a, b in zip(got[:3], one[:3]))
            errs = [bench.rel_l2(a, b) for a, b in zip(got[3:], one[3:])]
            ok = same and max(errs) < 1e-2
            failed |= not ok
            if rank == 0:
                print(f"{shape} {name}: y, d x, d topk-weights one-pass bits: {same}; expert gradients vs one "
                      f"pass rel L2 {errs[0]:.1e} / {errs[1]:.1e}: {'ok' if ok else 'FAILED'}", flush=True)
            del x, w, gu, dn, y, got
        res = bench.measure(impls, p, "cuda", args.iters, 3, group)
        flops = 6 * args.tokens * top_k * hidden * inter
        for name, cfg in configs.items():
            f_ms, b_ms, peak, _ = res[name]
            ws = functional.get_workspace(hidden_size=hidden, intermediate_size=inter, num_experts=num_experts,
                                          top_k=top_k, device=torch.device("cuda", torch.cuda.current_device()),
                                          dtype=torch.bfloat16, backend="cuda", ep_group=group, config=cfg)
            rec = {"shape": shape, "ep": world, "tokens_per_rank": args.tokens, "mode": name,
                   "fwd_ms": round(f_ms, 4), "bwd_ms": round(b_ms, 4), "fwd_tflops": round(flops / f_ms / 1e9, 1),
                   "bwd_tflops": round(2 * flops / b_ms / 1e9, 1), "peak_mem_gb": round(peak, 3),
                   "workspace_mb": round(ws.nbytes / 2**20, 1), "commit": args.commit}
            records.append(rec)
            if rank == 0:
                print(f"{shape:14s} EP={world} {name:16s} fwd {f_ms:8.3f} ms  bwd {b_ms:8.3f} ms  "
                      f"peak {peak:6.2f} GB  workspace {rec['workspace_mb']:8.1f} MB", flush=True)
        del p, impls
        torch.cuda.empty_cache()
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"macrobatch_ep{world}.json").write_text(json.dumps(records, indent=1))
    if group is not None:
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
