"""Diagnostic (not a test): the varlen-M grouped GEMM variants, call by call, per benchmark shape.

    OUT=/tmp python tests/gpu/bench_gemm_variants.py [--shapes a,b] [--gemms gate_up,dgrad_down] [--reps 20]

For each shape at 8192 tokens (bench.make_problem: random router, real uneven
routing, make_schedule) it times the four grouped GEMMs of the forward and
backward with every variant, and torch._grouped_mm on the same operands
("speedup" = torch time / this time):

    gate_up      x_rows @ W13[e]^T        mok_gemm_bk, mok_gemm_bk_ef, mok_gemm_bk_pp(c), mok_gemm_bk_n128 / _n64
    down         h @ W2[e]^T              mok_gemm_bk, mok_gemm_bk_ef, mok_gemm_bk_pp(c), mok_gemm_bk_n128 / _n64
    dgrad_down   dy_rows @ W2[e] (fp32)   mok_gemm_bn_f32
    dgrad_gu     dgu @ W13[e]             mok_gemm_bn, mok_gemm_bn_ef, mok_gemm_bn_pp

CUDA events per call, 3 warm-up calls, median of --reps. TFLOP/s count routed
rows only. Checks: every variant's rows [0, seg_end[-1]) bitwise equal to the
default (split epilogue); routed rows within bf16 tolerance of
torch._grouped_mm. Prints a table, writes gemm_variants.json and .txt to $OUT.
Also (where I % 128 == 0) the forward's gate/up GEMM + SwiGLU as two kernels
vs the fused mok_gemm_gate_up_swiglu (_ef: whole tile in smem, and split) and its ping-pong twins ("speedup" there =
two-kernel time / this), and (I % 256 == 0) the backward's dgrad of down + activation
backward as two kernels vs mok_gemm_dact_swiglu and mok_gemm_dact_swiglu_pp.
Gather: gate_up (x) and dgrad_down (dy) as index_select (cb.gather_rows) + the TMA
kernel vs the kernel that gathers A rows itself (mok_gemm_*_gather); "speedup"
there = index_select+GEMM time / this, checked bitwise equal to the TMA kernel.
Exit status 1 if a check fails.
"""

import argparse
import json
import os

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

from layer_runs import median_ms_queued  # the script's folder is on sys.path

# the diagnostic narrow-tile twins of mok_gemm_bk (128 x 128, 128 x 64 tiles): what a narrow tile costs per FLOP
NARROW = ("mok_gemm_bk_n128", "mok_gemm_bk_n64")
TOL = 1e-2  # relative L2 against torch._grouped_mm (both round to bf16; fp32 accumulation orders differ)


def rel_err(got, want):
    d = (got.double() - want.double()).norm()
    return (d / want.double().norm().clamp_min(1e-30)).item()


def gemms(p, sched):
    """(name, a rows, weights, transpose_w, out dtype, variants) of the forward and backward."""
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    W13, W2 = p["gate_up_proj"], p["down_proj"]
    T, inter = p["x"].shape[0], W2.shape[2]
    x_rows = cb.gather_rows(p["x"], sched)
    h = cb.gather_rows(torch.randn(T, inter, device="cuda", generator=g).to(bf), sched)
    dy_rows = cb.gather_rows(p["dy"], sched)
    dgu = cb.gather_rows((torch.randn(T, 2 * inter, device="cuda", generator=g) * 0.1).to(bf), sched)
    return [
        ("gate_up", x_rows, W13, False, bf, ("mok_gemm_bk", "mok_gemm_bk_ef", "mok_gemm_bk_pp", "mok_gemm_bk_ppc")
         + NARROW),
        ("down", h, W2, False, bf, ("mok_gemm_bk", "mok_gemm_bk_ef", "mok_gemm_bk_pp", "mok_gemm_bk_ppc") + NARROW),
        ("dgrad_down", dy_rows, W2, True, torch.float32, ("mok_gemm_bn_f32",)),
        ("dgrad_gu", dgu, W13, True, bf, ("mok_gemm_bn", "mok_gemm_bn_ef", "mok_gemm_bn_pp", "mok_gemm_bn_ppc")),
    ]


def run_shape(shape, tokens, reps, say, only=None, gather_too=True):
    """Time and check every GEMM of one shape; returns (records, all checks passed)."""
    records, ok = [], True
    p = bench.make_problem(shape, tokens, "cuda")
    ids = p["ids"]
    E = p["gate_up_proj"].shape[0]
    sched = cb.make_schedule(ids, E)
    used = int(sched.seg_end[-1])
    pos = sched.pos.reshape(-1)
    routed = ids.numel()
    say(f"# {shape}: routed rows {routed}, padded rows {used} ({100 * (used - routed) / used:.1f}% padding)")
    for gname, a, W, transpose_w, out_dtype, variants in gemms(p, sched):
        if only and gname not in only:
            continue
        n = W.shape[2] if transpose_w else W.shape[1]
        flops = 2 * routed * n * a.shape[1]
        wt = W if transpose_w else W.transpose(1, 2)
        ref = torch._grouped_mm(a, wt, offs=sched.seg_end)
        t_ref = median_ms_queued(lambda: torch._grouped_mm(a, wt, offs=sched.seg_end), reps)
        say(f"{shape:<14} {gname:<11} {'torch._grouped_mm':<22} {t_ref:8.3f} {flops / t_ref / 1e9:7.1f} {1.0:8.2f}")
        records.append(dict(shape=shape, gemm=gname, variant="torch._grouped_mm", ms=t_ref, tflops=flops / t_ref / 1e9))
        b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
        default = None
        for name in variants:
            out = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=out_dtype)
            cb.launch_gemm(name, a, b, out, sched)
            torch.cuda.synchronize()
            if default is None:
                default = out  # the first variant: the default kernel
            bitwise = torch.equal(out[:used], default[:used])
            err = rel_err(out[pos], ref[pos])
            good = bitwise and err < TOL
            ok &= good
            t = median_ms_queued(lambda: cb.launch_gemm(name, a, b, out, sched), reps)
            check = f"{'bitwise=default' if bitwise else 'DIFFERS from default'} err {err:.1e}"
            say(f"{shape:<14} {gname:<11} {name:<22} {t:8.3f} {flops / t / 1e9:7.1f} {t_ref / t:8.2f}  "
                f"{check}{'' if good else '  FAIL'}")
            records.append(dict(shape=shape, gemm=gname, variant=name, ms=t, tflops=flops / t / 1e9,
                                speedup_vs_torch=t_ref / t, bitwise_equal_default=bitwise,
                                rel_err_vs_torch=err, routed_rows=routed, padded_rows=used))
        if gname == "gate_up" and cb.fused_act_supported(p["down_proj"].shape[2], "swiglu", False):
            ok &= fused_act(shape, a, W, sched, default, flops, reps, say, records)
        if gname == "dgrad_down" and cb.fused_dact_supported(n, "swiglu"):
            ok &= fused_dact(shape, p, a, W, sched, flops, reps, say, records)
        if gname in GATHER_SOURCES and gather_too:
            ok &= gather(shape, gname, p[GATHER_SOURCES[gname]], W, transpose_w, out_dtype, sched, flops, reps, say,
                         records)
    return records, ok


def _fused_row(shape, gemm, label, t, t_split, flops, check, say, records, **extra):
    """One line and one record of a fused kernel timed against its two-kernel path (t_split)."""
    say(f"{shape:<14} {gemm:<11} {label:<22} {t:8.3f} {flops / t / 1e9:7.1f} {t_split / t:8.2f}  {check}")
    records.append(dict(shape=shape, gemm=gemm, variant=label, ms=t, tflops=flops / t / 1e9, **extra))


def fused_act(shape, a, W13, sched, gate_up, flops, reps, say, records):
    """gate/up GEMM + SwiGLU: two kernels (mok_gemm_bk, mok_act_fwd_swiglu) vs mok_gemm_gate_up_swiglu."""
    used = int(sched.seg_end[-1])
    h = cb.act_forward(gate_up, sched, "swiglu", None)
    def split():
        return cb.act_forward(cb.grouped_gemm(a, W13, sched, transpose_w=False), sched, "swiglu", None)

    t_split = median_ms_queued(split, reps)
    _fused_row(shape, "gate_up+act", "gemm_bk+act_fwd", t_split, t_split, flops, "", say, records)
    ok = True
    for label, pingpong, epi in (("gate_up_swiglu_ef", "0", "full"), ("gate_up_swiglu split", "0", "split"),
                                 ("gate_up_swiglu_pp", "1", "auto"), ("gate_up_swiglu_ppc", "cluster", "auto")):
        os.environ["MOK_GEMM_PINGPONG"] = pingpong  # gate_up_act picks the kernel by them
        os.environ["MOK_GEMM_EPI"] = epi
        gu_f, h_f = cb.gate_up_act(a, W13, sched, "swiglu", None)
        torch.cuda.synchronize()
        bitwise = torch.equal(gu_f[:used], gate_up[:used]) and torch.equal(h_f[:used], h[:used])
        ok &= bitwise
        t = median_ms_queued(lambda: cb.gate_up_act(a, W13, sched, "swiglu", None), reps)
        _fused_row(shape, "gate_up+act", label, t, t_split, flops,
                   "bitwise=split" if bitwise else "DIFFERS from split  FAIL", say, records,
                   bitwise_equal_default=bitwise)
    os.environ["MOK_GEMM_PINGPONG"] = "0"
    os.environ.pop("MOK_GEMM_EPI")
    return ok


def fused_dact(shape, p, dy_rows, W2, sched, flops, reps, say, records):
    """dgrad of down + activation backward: two kernels (mok_gemm_bn_f32, mok_act_bwd_swiglu) vs
    mok_gemm_dact_swiglu (cb.dgrad_act); d gate_up and w*h must be the same bits."""
    used = int(sched.seg_end[-1])
    gate_up = cb.grouped_gemm(cb.gather_rows(p["x"], sched), p["gate_up_proj"], sched, transpose_w=False)
    w_rows = cb.row_weights(sched, p["w"])

    def split():
        dh = cb.grouped_gemm(dy_rows, W2, sched, transpose_w=True, out_dtype=torch.float32)
        return cb.act_backward(gate_up, dh, w_rows, sched, "swiglu", None)

    def fused():
        return cb.dgrad_act(dy_rows, W2, gate_up, w_rows, sched, "swiglu", None)

    dgu_s, wh_s, dw_s = split()
    t_split = median_ms_queued(split, reps)
    _fused_row(shape, "dgrad+dact", "gemm_bn_f32+act_bwd", t_split, t_split, flops, "", say, records)
    ok = True
    for label, pingpong in (("dact_swiglu fused", "0"), ("dact_swiglu_pp", "1"), ("dact_swiglu_ppc", "cluster")):
        os.environ["MOK_GEMM_PINGPONG"] = pingpong  # dgrad_act picks the kernel by it
        dgu_f, wh_f, dw_f = fused()
        torch.cuda.synchronize()
        bitwise = torch.equal(dgu_s[:used], dgu_f[:used]) and torch.equal(wh_s[:used], wh_f[:used])
        dw_err = rel_err(dw_f[:used], dw_s[:used])
        ok &= bitwise and dw_err < 1e-5
        t = median_ms_queued(fused, reps)
        _fused_row(shape, "dgrad+dact", label, t, t_split, flops,
                   f"{'bitwise=split' if bitwise else 'DIFFERS from split  FAIL'} dw err {dw_err:.1e}", say, records,
                   bitwise_equal_default=bitwise, dw_rel_err=dw_err)
    os.environ["MOK_GEMM_PINGPONG"] = "0"
    return ok


GATHER_SOURCES = {"gate_up": "x", "dgrad_down": "dy"}  # GEMMs whose A is gathered token rows
GATHER_PAIRS = {False: (("mok_gemm_bk", "mok_gemm_bk_gather"), ("mok_gemm_bk_ef", "mok_gemm_bk_ef_gather")),
                True: (("mok_gemm_bn_f32", "mok_gemm_bn_f32_gather"),)}


def gather(shape, gname, src, W, transpose_w, out_dtype, sched, flops, reps, say, records):
    """index_select + TMA kernel vs the kernel gathering A rows from src itself; same bits required."""
    used = int(sched.seg_end[-1])
    n = W.shape[2] if transpose_w else W.shape[1]
    b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
    ok = True
    t_sel = median_ms_queued(lambda: cb.gather_rows(src, sched), reps)
    say(f"{shape:<14} {gname:<11} {'index_select only':<22} {t_sel:8.3f}")
    records.append(dict(shape=shape, gemm=gname, variant="index_select", ms=t_sel))
    for twin, name in GATHER_PAIRS[transpose_w]:
        out_t = torch.full((sched.capacity, n), float("nan"), device="cuda", dtype=out_dtype)
        out_g = torch.full((sched.capacity, n), float("nan"), device="cuda", dtype=out_dtype)

        def two_step():
            cb.launch_gemm(twin, cb.gather_rows(src, sched), b, out_t, sched)

        def fused():
            cb._lib().launch(
                name, src.unsqueeze(-1), sched.row_token, b, out_g.unsqueeze(-1), sched.tile_expert,
                sched.seg_end, sched.gemm_seg_rows(), cb.gemm_group_m(n),
                stream=torch.cuda.current_stream().cuda_stream,
            )  # fmt: skip

        two_step()
        fused()
        torch.cuda.synchronize()
        bitwise = torch.equal(out_g[:used], out_t[:used])
        ok &= bitwise
        t_two = median_ms_queued(two_step, reps)
        t_g = median_ms_queued(fused, reps)
        for label, t in ((f"index_select+{twin}", t_two), (name, t_g)):
            say(f"{shape:<14} {gname:<11} {label:<22} {t:8.3f} {flops / t / 1e9:7.1f} {t_two / t:8.2f}  "
                f"{'bitwise=index_select+TMA' if bitwise else 'DIFFERS from index_select+TMA  FAIL'}")
            records.append(dict(shape=shape, gemm=gname, variant=label, ms=t, tflops=flops / t / 1e9,
                                speedup_vs_index_select=t_two / t, bitwise_equal_default=bitwise))
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemms", default="", help="only these GEMMs (gate_up,down,dgrad_down,dgrad_gu); default all")
    ap.add_argument("--no-gather", action="store_true", help="skip the gather comparisons")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    records, lines, ok = [], [], True

    def say(line):
        print(line, flush=True)
        lines.append(line)

    say(f"{'shape':<14} {'gemm':<11} {'variant':<22} {'ms':>8} {'TF/s':>7} {'speedup':>8}  check")
    for shape in args.shapes.split(","):
        recs, good = run_shape(shape, args.tokens, args.reps, say, set(filter(None, args.gemms.split(","))),
                               gather_too=not args.no_gather)
        records += recs
        ok &= good
        torch.cuda.empty_cache()
    say("all checks passed" if ok else "SOME CHECKS FAILED")
    with open(os.path.join(out_dir, "gemm_variants.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(out_dir, "gemm_variants.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
