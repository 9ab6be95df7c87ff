"""Diagnostic (not a test): the schedule-order row gather, torch (cat + index_select) vs mok_gather_rows vs
mok_scatter_rows (the same rows walked from the source side, each source row read once).

    python tests/gpu/bench_gather_rows.py [--shapes a,b] [--ctas-per-sm 2,4,8]

Per benchmark shape at 8192 tokens (a random router's routing), two forms:
- EP=1: x [T, H] into the rows of the single-GPU schedule (make_schedule);
- EP=2: the tokens section of rank 0 [2T + 1, H] (two sources, a zero row last) into the rows of rank 0's
  local experts (cuda_ep.make_ep_schedule, the second source routed by a second random router), as the EP
  forward and backward gather them. This source does not fit in L2 at any shape.
The time of each way (median of --reps launches), the bytes moved as TB/s (the gather's reads and writes of
every row, for comparison), and whether the bits equal index_select's; each kernel writing every row, and
with the schedule's tile table (rows of the tiles past the last segment not written, as the layer runs it). Writes bench_gather_rows.txt to $OUT (default
/tmp). Exit status 1 if some bits differ.
"""

import argparse
import os
import pathlib
import sys

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from layer_runs import median_ms_queued as median_ms  # noqa: E402


def _problems(shape: str):
    """(label, src, row_src, slots, has_zero_row, tile_expert) of the EP=1 and the EP=2 form."""
    hidden, inter, num_experts, top_k = bench.SHAPES[shape]
    p, q = ({k: v for k, v in bench.make_problem(shape, 8192, "cuda", seed=s).items() if k in ("x", "ids")}
            for s in (0, 1))  # (the expert weights dropped at once)
    sched = cb.make_schedule(p["ids"], num_experts)
    yield "EP=1", p["x"], sched.row_token, sched.pos, False, sched.tile_expert
    tc = p["ids"].shape[0]
    ids_all = torch.stack([p["ids"], q["ids"]])  # [P=2, Tc, k]
    e_l = num_experts // 2
    cap = cuda_ep.schedule_capacity(tc, top_k, e_l, 2, 2.0)
    eps = cuda_ep.make_ep_schedule(ids_all, tc, 0, e_l, cap)
    tokens = torch.cat([p["x"], q["x"], p["x"].new_zeros(1, hidden)])
    yield "EP=2", tokens, eps.sched.row_token, eps.token_slots(), True, eps.sched.tile_expert


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--ctas-per-sm", default="2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    lines, failed = [], False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    for shape in args.shapes.split(","):
        for label, src, row_src, slots, zero_row, tile_expert in _problems(shape):
            first = len(lines)
            ref = src if zero_row else torch.cat([src, src.new_zeros(1, src.shape[1])])
            want = ref.index_select(0, row_src)
            live = (tile_expert >= 0).repeat_interleave(128)[:want.shape[0]]
            gb = 2 * want.numel() * 2 / 1e9  # bytes a gather of every row reads + writes
            t = median_ms(lambda: ref.index_select(0, row_src), args.reps)
            lines.append(f"{shape:14s} {label} index_select                        {t:7.3f} ms  {gb / t:5.2f} TB/s  "
                         f"({want.shape[0]} rows, {int(live.sum())} up to the last segment, from {src.shape[0]})")
            n_src = slots.shape[0]
            every_row = torch.zeros(1, dtype=torch.int32, device="cuda")
            for name, units in (("mok_gather_rows", want.shape[0]),
                                ("mok_scatter_rows", n_src + -(-want.shape[0] // 32))):
                for rows, tiles in (("all rows", every_row), ("skip tail", tile_expert)):
                    for per_sm in map(int, args.ctas_per_sm.split(",")):
                        grid = cb.row_copy_grid(units, sms, per_sm)
                        out = torch.full_like(want, float("nan"))
                        if name == "mok_gather_rows":
                            def run():
                                cb._lib().launch(name, src, row_src, tiles, out, grid, stream=stream)
                        else:
                            def run():
                                cb._lib().launch(name, src, slots, row_src, tiles, out, grid, stream=stream)
                        run()
                        same = torch.equal(out[live], want[live]) and (rows == "skip tail" or torch.equal(out, want))
                        failed |= not same
                        t = median_ms(run, args.reps)
                        lines.append(f"{shape:14s} {label} {name:16s} {rows:9s} {per_sm} CTAs/SM  {t:7.3f} ms  "
                                     f"{gb / t:5.2f} TB/s  bitwise={same}")
            print("\n".join(lines[first:]), flush=True)
    out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_gather_rows.txt").write_text("\n".join(lines) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
