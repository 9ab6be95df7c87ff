"""Diagnostic (not a test): does skipping the MMA of all-padding warp-group halves pay once tiles are
claimed dynamically?

    OUT=/tmp python tests/gpu/diag_tail_skip.py [--shapes deepseek-v3,qwen3-30b-a3b] [--reps 20]

Tail skip (a consumer warp group whose 64 rows are all padding issues no wgmma; the kernels' branch
is taken when seg_rows are the routed rows instead of the padded sizes) was slower with the static
persistent schedule: CTAs drift apart, L2 hit rate fell from 49% to 27% (docs/kernels.md). The
_done_dyn GEMMs claim tiles by atomic add, so CTAs stay on a contiguous window of tiles. For the
forward's gate/up and down GEMMs at 8192 tokens this times, call by call (CUDA events, median):

    static       mok_gemm_bk[_ef], padded seg_rows   (the default)
    static_skip  mok_gemm_bk[_ef], routed seg_rows
    dyn          mok_gemm_bk[_ef]_done_dyn on every SM, padded seg_rows
    dyn_skip     mok_gemm_bk[_ef]_done_dyn on every SM, routed seg_rows

and checks the used rows of all four bitwise equal (all-padding halves store exact zeros either way).
The tile order is cuda_backend.gemm_group_m's (MOK_GEMM_RASTER: expert bands by default since v170).
Prints a table, writes tail_skip.json to $OUT. Exit status 1 if bits differ.
"""

import argparse
import json
import os

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

from layer_runs import median_ms_queued


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    lib = cb._lib()
    stream = torch.cuda.current_stream().cuda_stream
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records, ok = [], True
    for shape in args.shapes.split(","):
        p = bench.make_problem(shape, 8192, "cuda")
        E = p["gate_up_proj"].shape[0]
        sched = cb.make_schedule(p["ids"], E)
        used = int(sched.seg_end[-1])
        x_rows = cb.gather_rows(p["x"], sched)
        h = cb.gather_rows(torch.randn(8192, p["down_proj"].shape[2], device="cuda").to(torch.bfloat16), sched)
        for gname, a, W in (("gate_up", x_rows, p["gate_up_proj"]), ("down", h, p["down_proj"])):
            name = cb.gemm_kernel(False, torch.bfloat16, k=a.shape[1], pingpong=False)
            n = W.shape[1]
            b = W.permute(1, 2, 0)
            group_m = cb.gemm_group_m(n)
            done = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
            ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
            rows = {"padded": sched.gemm_seg_rows(), "routed": sched.seg_rows}
            outs = {}

            def run(mode, out):
                seg_rows = rows["routed" if mode.endswith("skip") else "padded"]
                if mode.startswith("dyn"):
                    done.zero_()
                    ctr.zero_()
                    lib.launch(name + "_done_dyn", a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert,
                               sched.seg_end, seg_rows, group_m, done, sms, ctr, stream=stream)
                else:
                    lib.launch(name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end,
                               seg_rows, group_m, stream=stream)

            times = {}
            for mode in ("static", "static_skip", "dyn", "dyn_skip"):
                out = torch.full((sched.capacity, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                run(mode, out)
                torch.cuda.synchronize()
                outs[mode] = out[:used].clone()
                times[mode] = median_ms_queued(lambda m=mode, o=out: run(m, o), args.reps)
            base = outs["static"]
            for mode, t in times.items():
                same = bool(torch.equal(outs[mode].view(torch.int16), base.view(torch.int16)))
                ok &= same
                print(f"{shape:<14} {gname:<8} {name:<16} {mode:<12} {t:8.3f} ms  {times['static'] / t:5.2f}x  "
                      f"bits={'=static' if same else 'DIFFER'}", flush=True)
                records.append(dict(shape=shape, gemm=gname, kernel=name, mode=mode, ms=t, bitwise_eq_static=same,
                                    commit=os.environ.get("MOK_COMMIT", "unknown")))
        del p, x_rows, h
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "tail_skip.json"), "w") as f:
        json.dump(records, f, indent=1)
    print("all bits equal" if ok else "BITS DIFFER")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
