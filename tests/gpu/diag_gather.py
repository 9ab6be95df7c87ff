"""Diagnostic (not a test): the cp.async gather GEMMs against their TMA twins. Same kernels, different row indices.

    OUT=/tmp timeout 600 python tests/gpu/diag_gather.py [--shapes deepseek-v3,qwen3-30b-a3b,mixtral-8x7b]
        [--kernels mok_gemm_bk_gather,mok_gemm_bn_f32_gather] [--cases real,contig] [--reps 10]

The gather kernel reads src rows through any row index, so costs are separated by what
src / row_idx hold (docs/kernels.md, "Gather variant: why it was slow"). Per case: the
gather kernel on (src, row_idx) and its TMA twin on index_select(src, row_idx), checked
bitwise equal; "x twin" = gather time / twin time.

    real        src = x, row_idx = Schedule.row_token (padding rows zero-filled): the benchmark case
    real_zrows  as real, but each padding row reads its own zero row of src (no zero fill)
    contig      src = the gathered rows A (padding rows are zero rows of A), row_idx = arange:
                the TMA twin's exact address stream, issued by cp.async
    contig_zpad as contig, padding rows zero-filled
    win<W>      src = x, each row tile's rows a sorted random sample of 128 of W consecutive
                tokens (padding rows real too): W = 128 is a contiguous block; W = T is
                random rows over all of x; the span of a tile's rows grows with W

Reading: contig ~ twin -> the cp.async machinery is fine and the address stream is the cost
(then win<W> says whether span (TLB / DRAM pages) matters); contig >> twin -> the producer /
consumer machinery itself (issue, barriers, proxy fence).
Prints a table; writes gather_diag.json and .txt to $OUT. Exit status 1 if a bitwise check fails.
"""

import argparse
import json
import os

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

from layer_runs import median_ms_queued  # the script's folder is on sys.path

TWIN = {"mok_gemm_bk_gather": "mok_gemm_bk", "mok_gemm_bk_ef_gather": "mok_gemm_bk_ef",
        "mok_gemm_bn_f32_gather": "mok_gemm_bn_f32"}  # fmt: skip


def cases(src, sched, windows, gen):
    """(name, src [S, K], row_idx [cap] int64 in [0, S]; S: a zero-filled padding row)."""
    T = src.shape[0]
    rt = sched.row_token
    used = int(sched.seg_end[-1])
    pad = rt == T
    out = [("real", src, rt)]
    zr = rt.clone()
    zr[pad] = T + torch.arange(int(pad.sum()), device=rt.device)
    out.append(("real_zrows", torch.cat([src, src.new_zeros(int(pad.sum()), src.shape[1])]), zr))
    a = cb.gather_rows(src, sched)  # [cap, K], padding rows zero
    ar = torch.arange(a.shape[0], device=rt.device)
    out.append(("contig", a, ar))
    out.append(("contig_zpad", a, torch.where(pad, a.shape[0], ar)))
    tiles = used // 128
    for w in windows:
        w = min(w, T)
        start = torch.randint(0, T - w + 1, (tiles, 1), device=rt.device, generator=gen)
        pick = torch.rand(tiles, w, device=rt.device, generator=gen).argsort(dim=1)[:, :128].sort(dim=1).values
        idx = rt.clone()
        idx[:used] = (start + pick).reshape(-1)
        out.append((f"win{w}", src, idx))
    return out


def run(shape, kernel, reps, windows, say, only):
    p = bench.make_problem(shape, 8192, "cuda")
    W13, W2 = p["gate_up_proj"], p["down_proj"]
    sched = cb.make_schedule(p["ids"], W13.shape[0])
    transpose_w = kernel.startswith("mok_gemm_bn_f32_gather")
    W = W2 if transpose_w else W13
    b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
    n = W.shape[2] if transpose_w else W.shape[1]
    out_dtype = torch.float32 if transpose_w else torch.bfloat16
    group_m = cb.gemm_group_m(n)
    seg_rows = sched.gemm_seg_rows()
    used = int(sched.seg_end[-1])
    gen = torch.Generator(device="cuda").manual_seed(7)
    out_g = torch.full((sched.capacity, n), float("nan"), device="cuda", dtype=out_dtype)
    out_t = torch.full_like(out_g, float("nan"))
    recs, ok = [], True
    for name, src, idx in cases(p["dy" if transpose_w else "x"], sched, windows, gen):
        if only and name not in only:
            continue
        a = torch.cat([src, src.new_zeros(1, src.shape[1])]).index_select(0, idx)

        def gather():
            cb._lib().launch(
                kernel, src.unsqueeze(-1), idx, b, out_g.unsqueeze(-1), sched.tile_expert, sched.seg_end,
                seg_rows, group_m, stream=torch.cuda.current_stream().cuda_stream,
            )  # fmt: skip

        def twin():
            cb._lib().launch(
                TWIN[kernel], a.unsqueeze(-1), b, out_t.unsqueeze(-1), sched.tile_expert, sched.seg_end, seg_rows,
                group_m, stream=torch.cuda.current_stream().cuda_stream,
            )  # fmt: skip

        gather()
        twin()
        torch.cuda.synchronize()
        same = torch.equal(out_g[:used], out_t[:used])
        ok &= same
        tg, tt = median_ms_queued(gather, reps), median_ms_queued(twin, reps)
        # Span of a row tile's rows in bytes (median over real tiles), a TLB-reach proxy.
        rows = idx[:used].reshape(-1, 128).clamp_max(src.shape[0] - 1)
        span_mb = float((rows.max(1).values - rows.min(1).values).float().median()) * src.stride(0) * 2 / 2**20
        line = (f"{shape:<14} {kernel:<23} {name:<12} {tg:8.3f} {tt:8.3f} {tg / tt:6.2f} {span_mb:9.1f}  "
                f"{'bitwise' if same else 'DIFFERS  FAIL'}")
        say(line)
        recs.append(dict(shape=shape, kernel=kernel, case=name, gather_ms=tg, twin_ms=tt, ratio=tg / tt,
                         tile_span_mb=span_mb, bitwise=same))
    return recs, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--kernels", default="mok_gemm_bk_gather,mok_gemm_bn_f32_gather")
    ap.add_argument("--windows", default="128,1024,4096,8192")
    ap.add_argument("--cases", default="", help="only these cases (e.g. real,real_zrows); default all")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    lines, recs, ok = [], [], True

    def say(s):
        print(s, flush=True)
        lines.append(s)

    say(f"{'shape':<14} {'kernel':<23} {'case':<12} {'gather':>8} {'twin':>8} {'x twin':>6} {'span MB':>9}  check")
    windows = [int(w) for w in args.windows.split(",") if w]
    for shape in args.shapes.split(","):
        for kernel in args.kernels.split(","):
            r, good = run(shape, kernel, args.reps, windows, say, set(filter(None, args.cases.split(","))))
            recs += r
            ok &= good
            torch.cuda.empty_cache()
    say("all checks passed" if ok else "SOME CHECKS FAILED")
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gather_diag.json"), "w") as f:
        json.dump(recs, f, indent=1)
    with open(os.path.join(out, "gather_diag.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
