"""Diagnostic (not a test): the schedule-order row gather, torch (cat + index_select) vs mok_gather_rows.

    python tests/gpu/bench_gather_rows.py [--shapes a,b] [--ctas-per-sm 2,4,8]

Per benchmark shape at 8192 tokens (a random router's routing): the time of gathering x's rows into
the GEMM's row order (padding rows zero) both ways, median of --reps launches, and whether the bits
are equal. Writes bench_gather_rows.txt to $OUT (default /tmp). Exit status 1 if the bits differ.
"""

import argparse
import os
import pathlib
import sys

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from layer_runs import median_ms_queued as median_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--ctas-per-sm", default="2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    lines, failed = [], False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        hidden, inter, num_experts, top_k = bench.SHAPES[shape]
        p = bench.make_problem(shape, 8192, "cuda")
        sched = cb.make_schedule(p["ids"], num_experts)
        x = p["x"]
        want = cb.gather_rows(x, sched)
        gb = 2 * want.numel() * 2 / 1e9  # bytes read + written
        t = median_ms(lambda: cb.gather_rows(x, sched), args.reps)
        lines.append(f"{shape:14s} torch cat + index_select   {t:7.3f} ms  {gb / t:5.2f} TB/s  ({want.shape[0]} rows)")
        for per_sm in map(int, args.ctas_per_sm.split(",")):
            grid = cb.row_copy_grid(want.shape[0], sms, per_sm)
            out = torch.full_like(want, float("nan"))

            def run():
                cb._lib().launch("mok_gather_rows", x, sched.row_token, out, grid,
                                 stream=torch.cuda.current_stream().cuda_stream)

            run()
            same = torch.equal(out, want)
            failed |= not same
            t = median_ms(run, args.reps)
            lines.append(f"{shape:14s} mok_gather_rows {per_sm} CTAs/SM  {t:7.3f} ms  {gb / t:5.2f} TB/s  bitwise={same}")
        print("\n".join(lines[-1 - len(args.ctas_per_sm.split(",")):]), flush=True)
    out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_gather_rows.txt").write_text("\n".join(lines) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
