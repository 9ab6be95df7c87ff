"""Diagnostic (not a test): mok_nn's layer under several env settings, timed side by side in one
process (ABBA alternation, bench.measure) and checked bitwise against the first setting.

    python tests/gpu/bench_env_modes.py [--shapes ...] [--modes gather]           (EP=1, one GPU)
    torchrun --nproc_per_node 2 tests/gpu/bench_env_modes.py --modes gather        (EP=2)

Mode sets (the first entry of each is the default path, the reference for "bitwise"):
  gather: copy (index_select + TMA GEMM), gather (MOK_GEMM_GATHER=1),
          gather_dy (also MOK_GEMM_GATHER_DY=1; EP=1 only changes the backward)
          (records before the zero-chunk producer was removed call the last two gather_zf, gather_zf_dy)
  epcopy: v2, v1 (MOK_EP_COPY; EP only)
  epfwd:  seq, ov16 (MOK_EP_FWD; EP only)
  epovdyn: seq, ov_static, ov_dynamic, ov_dyn_dispatch (MOK_EP_FWD=overlap with MOK_EP_OV_TILES=static /
          dynamic / dispatch; EP only)
  epsched: graph, eager (MOK_EP_SCHED_GRAPH; EP only)
  eppull: needed, all, needed_again, all_again (MOK_EP_PULL: the forward's pull after or before the schedule; EP only)
  epschedout: torch, kernel, torch_again, kernel_again (MOK_EP_SCHED_OUTPUTS: the EP schedule's outputs by the
          torch ops or one kernel; EP only)
  eppush: all, push, all_again, push_again (MOK_EP_PULL: every token row pulled after the barrier, or pushed by
          the publish launch before it; EP only)
  epsavex: keep, pull (MOK_EP_SAVE_X_ROWS; EP only)
  epsums: rank, slot (MOK_EP_COMBINE_SUMS: combine / d x pre-reduced per rank or one row per slot; EP only)
  epsumsauto: auto, slot (MOK_EP_COMBINE_SUMS: the default choice against one row per slot everywhere; EP only)
  epdxpush: copy_engine, kernel (MOK_EP_DX_PUSH: the backward's d x sums sent beside the weight gradients
          by the copy engines, or stored by the summing kernel after them; EP only, per-rank sums)
  dact: fused, split (MOK_GEMM_DACT: the dgrad of down with the activation backward in its epilogue)
  epi: auto, split, each twice (MOK_GEMM_EPI: the cooperative GEMMs' whole-tile epilogue where K is short, or
          the split one everywhere)
  act: fused, split (MOK_GEMM_ACT: the gate/up GEMM with the activation in its epilogue)
  wgrad: c2, ppc, pp, c2_again (MOK_WGRAD_KERNEL; the default twice, to show the position bias)
  schedgather: fused, split, fused_again, split_again (MOK_SCHEDULE_GATHER: the EP = 1 forward's x gather
          launched by the schedule's host call, or on its own)
  wgradrule: rule, c2, rule_again, c2_again (the default choice per weight gradient, cuda_backend.wgrad_kernel,
          against mok_gemm_wgrad_defer_c2 everywhere)
  gatherrows: torch, kernel, torch_again, kernel_again (MOK_GATHER_ROWS: the x / d y row gathers by
          index_select or mok_gather_rows)
  scatter: gather, scatter, gather_again, scatter_again (MOK_GATHER_ROWS=kernel / scatter: mok_gather_rows or
          mok_scatter_rows)
  eppublish: kernel, torch (MOK_EP_PUBLISH: step 1 of the EP forward as one launch or torch ops; EP only)
  epdispatch: pull, rows (MOK_EP_DISPATCH; EP only)
  raster: auto, bands, expert, auto_again, bands_again (MOK_GEMM_RASTER: the grouped GEMMs' tile order)
  epscatter: auto, scatter, each twice (MOK_EP_PULL and MOK_EP_DY_ROWS: the default, or the peers' rows read from
          their own sections by the gather, mok_scatter_rows_peers; EP only)
  eprowsauto: auto, push, each three times (the default token / d y rows, scatter at qwen3 and deepseek-v3
          since the fifteenth session, against both pushed, the default before; EP only)
  epdyrows: pull, push, each twice (MOK_EP_DY_ROWS: the backward's d y rows pulled after its barrier or pushed
          before it; EP only)
  eprowsce: auto, push, copy_engine (MOK_EP_PULL: the forward's token rows by the publish kernel or by the copy
          engines issued first; EP only)
  epdownpush: kernel, gemm (MOK_EP_DOWN_PUSH: the down GEMM sending its rows itself; EP only)
  epdxpushgemm: copy_engine, gemm, each twice (MOK_EP_DX_PUSH: d x as per-rank sums by the copy engines, or rows
          sent by the dgrad GEMM itself; EP only)
  pingpong: auto, coop, ppc_fused (MOK_GEMM_PINGPONG with MOK_GEMM_ACT / MOK_GEMM_DACT)
  combine: auto, plain, each twice (MOK_COMBINE: the combine kernel chosen per top_k, or mok_combine everywhere)
  tiles: static, auto, dynamic, each twice (MOK_GEMM_TILES: the cooperative GEMMs with tiles claimed dynamically
          and all-padding warp groups skipping their MMA: none, the default's choice, every one with a _dyn twin)
  halftiles: on, off, each twice (MOK_GEMM_HALF_TILES: the ping-pong GEMMs run one 64-row MMA block where a
          tile's rows past the first 64 are all padding)
The env variables are read at every call, so one process can switch between them. A mode's settings
stay set after its call returns (the backward runs after it, reading them), until the next mode's call.
Prints one line per (shape, mode): fwd / bwd ms, TFLOP/s, the ratio to the baseline measured in
the same alternation, peak and activation GB, and whether y and every gradient equal the first
mode's bits. Writes bench_env_modes.json to $OUT. Exit status 1 if some mode's bits differ.
"""
import argparse
import json
import os
import sys

import torch

from layer_runs import torchrun_group
from mok_nn import bench

MODE_SETS = {
    "gather": {
        "copy": {"MOK_GEMM_GATHER": "0", "MOK_GEMM_GATHER_DY": "0"},
        "gather": {"MOK_GEMM_GATHER": "1", "MOK_GEMM_GATHER_DY": "0"},
        "gather_dy": {"MOK_GEMM_GATHER": "1", "MOK_GEMM_GATHER_DY": "1"},
    },
    # the backward's dgrad of down with dSwiGLU + d topk-weight in its epilogue, or the fp32 GEMM + act kernel
    "dact": {"fused": {"MOK_GEMM_DACT": "fused"}, "split": {"MOK_GEMM_DACT": "split"}},
    # the weight-gradient kernel in the layer; the default twice (first and last) to show the
    # measurement's position bias next to the difference
    # the default rule (the ping-pong kernel for deepseek-v3's d down, cuda_backend.wgrad_kernel) vs _defer_c2 everywhere
    # the EP = 1 forward's x gather launched by the schedule's host call, or by its own (MOK_SCHEDULE_GATHER=0)
    "schedgather": {
        "fused": {},
        "split": {"MOK_SCHEDULE_GATHER": "0"},
        "fused_again": {},
        "split_again": {"MOK_SCHEDULE_GATHER": "0"},
    },
    "wgradrule": {
        "rule": {},
        "c2": {"MOK_WGRAD_KERNEL": "mok_gemm_wgrad_defer_c2"},
        "rule_again": {},
        "c2_again": {"MOK_WGRAD_KERNEL": "mok_gemm_wgrad_defer_c2"},
    },
    "wgrad": {
        "c2": {"MOK_WGRAD_KERNEL": "mok_gemm_wgrad_defer_c2"},
        "ppc": {"MOK_WGRAD_KERNEL": "mok_gemm_wgrad_ppc"},
        "pp": {"MOK_WGRAD_KERNEL": "mok_gemm_wgrad_pp"},
        "c2_again": {"MOK_WGRAD_KERNEL": "mok_gemm_wgrad_defer_c2"},
    },
    # the schedule-order row gathers (x rows, d y rows): torch cat + index_select, or mok_gather_rows
    # (each twice: the spread of the measurement beside the difference)
    "gatherrows": {"torch": {"MOK_GATHER_ROWS": "torch"}, "kernel": {"MOK_GATHER_ROWS": "kernel"},
                   "torch_again": {"MOK_GATHER_ROWS": "torch"}, "kernel_again": {"MOK_GATHER_ROWS": "kernel"}},
    # the gather kernel against mok_scatter_rows (the same rows from the source side), each twice
    "scatter": {"gather": {"MOK_GATHER_ROWS": "kernel"}, "scatter": {"MOK_GATHER_ROWS": "scatter"},
                "gather_again": {"MOK_GATHER_ROWS": "kernel"}, "scatter_again": {"MOK_GATHER_ROWS": "scatter"}},
    # the forward's gate/up GEMM with the activation in its epilogue, or the GEMM + act kernel
    "act": {"fused": {"MOK_GEMM_ACT": "fused"}, "split": {"MOK_GEMM_ACT": "split"}},
    # the cooperative GEMMs' epilogue (the fused gate/up + SwiGLU's among them): auto (whole tile in smem where
    # K <= GEMM_FULL_EPI_MAX_K) or split everywhere; each twice
    "epi": {"auto": {"MOK_GEMM_EPI": "auto"}, "split": {"MOK_GEMM_EPI": "split"},
            "auto_again": {"MOK_GEMM_EPI": "auto"}, "split_again": {"MOK_GEMM_EPI": "split"}},
    # the GEMM forms (MOK_GEMM_PINGPONG) with the fused activation epilogues: the auto default, the cooperative
    # kernels with separate activation kernels (the default before the clustered ping-pong kernels), ppc everywhere
    "pingpong": {
        "auto": {"MOK_GEMM_PINGPONG": "auto", "MOK_GEMM_ACT": "auto", "MOK_GEMM_DACT": "auto"},  # the default
        "coop": {"MOK_GEMM_PINGPONG": "0", "MOK_GEMM_ACT": "split", "MOK_GEMM_DACT": "split"},
        "ppc_fused": {"MOK_GEMM_PINGPONG": "cluster", "MOK_GEMM_ACT": "fused", "MOK_GEMM_DACT": "fused"},
    },
    # the ping-pong GEMMs given the real rows (a tile with <= 64 of them: one MMA block) or the padded sizes
    "combine": {"auto": {"MOK_COMBINE": "auto"}, "plain": {"MOK_COMBINE": "plain"},
                "auto_again": {"MOK_COMBINE": "auto"}, "plain_again": {"MOK_COMBINE": "plain"}},
    "halftiles": {"on": {"MOK_GEMM_HALF_TILES": "1"}, "off": {"MOK_GEMM_HALF_TILES": "0"},
                  "on_again": {"MOK_GEMM_HALF_TILES": "1"}, "off_again": {"MOK_GEMM_HALF_TILES": "0"}},
    # the cooperative GEMMs' tiles: static (each CTA's by the persistent schedule, every warp group runs its MMA) or
    # dynamic (claimed by atomic add, all-padding warp groups skip their MMA); each twice for the spread
    "tiles": {"static": {"MOK_GEMM_TILES": "static"}, "auto": {"MOK_GEMM_TILES": "auto"},
              "dynamic": {"MOK_GEMM_TILES": "dynamic"}, "static_again": {"MOK_GEMM_TILES": "static"},
              "auto_again": {"MOK_GEMM_TILES": "auto"}, "dynamic_again": {"MOK_GEMM_TILES": "dynamic"}},
    # the grouped GEMMs' tile order: the default (expert bands where column tiles would run fastest), the
    # column-fastest / 8-row bands of cuda_backend.band_rule everywhere, one band per expert everywhere
    "raster": {"auto": {"MOK_GEMM_RASTER": "auto"}, "bands": {"MOK_GEMM_RASTER": "bands"},
               "expert": {"MOK_GEMM_RASTER": "expert"}, "auto_again": {"MOK_GEMM_RASTER": "auto"},
               "bands_again": {"MOK_GEMM_RASTER": "bands"}},
    # EP only: the forward's pull of the needed peer rows after the schedule, or of every peer row before it
    # (each twice: the spread beside the difference)
    "eppull": {"needed": {"MOK_EP_PULL": "needed"}, "all": {"MOK_EP_PULL": "all"},
               "needed_again": {"MOK_EP_PULL": "needed"}, "all_again": {"MOK_EP_PULL": "all"}},
    # the EP schedule's derived outputs by one mok_ep_schedule_outputs launch, or by the torch ops (in its graph)
    "epschedout": {"torch": {"MOK_EP_SCHED_OUTPUTS": "torch"}, "kernel": {"MOK_EP_SCHED_OUTPUTS": "kernel"},
                   "torch_again": {"MOK_EP_SCHED_OUTPUTS": "torch"}, "kernel_again": {"MOK_EP_SCHED_OUTPUTS": "kernel"}},
    # the forward's token rows pushed by the publish launch, or every row pulled after the barrier
    "eppush": {"all": {"MOK_EP_PULL": "all"}, "push": {"MOK_EP_PULL": "push"},
               "all_again": {"MOK_EP_PULL": "all"}, "push_again": {"MOK_EP_PULL": "push"}},
    # EP only: the token and d y rows moved before the barrier (auto: pushed for qwen3 / deepseek-v3, pulled
    # after the schedule for mixtral), or read from the peers' own sections by the gather (scatter)
    "epscatter": {"auto": {"MOK_EP_PULL": "auto", "MOK_EP_DY_ROWS": "auto"},
                  "scatter": {"MOK_EP_PULL": "scatter", "MOK_EP_DY_ROWS": "scatter"},
                  "auto_again": {"MOK_EP_PULL": "auto", "MOK_EP_DY_ROWS": "auto"},
                  "scatter_again": {"MOK_EP_PULL": "scatter", "MOK_EP_DY_ROWS": "scatter"}},
    "eprowsauto": {name + again: env for again in ("", "_2", "_3") for name, env in (
        ("auto", {"MOK_EP_PULL": "auto", "MOK_EP_DY_ROWS": "auto"}),
        ("push", {"MOK_EP_PULL": "push", "MOK_EP_DY_ROWS": "push"}))},
    # EP only: the row copies (v2: one launch for all peers, warp per row; v1: one CTA per row, per peer)
    "epcopy": {"v2": {"MOK_EP_COPY": "v2"}, "v1": {"MOK_EP_COPY": "v1"}},
    # EP only: the EP schedule replayed from a CUDA graph, or its torch ops issued one by one
    "epsched": {"graph": {"MOK_EP_SCHED_GRAPH": "1"}, "eager": {"MOK_EP_SCHED_GRAPH": "0"}},
    # EP only: step 1 of the forward (own rows, ids, weights, token count to every rank) as one
    # mok_ep_publish launch, or the torch ops it replaces
    "eppublish": {"kernel": {"MOK_EP_PUBLISH": "kernel"}, "torch": {"MOK_EP_PUBLISH": "torch"}},
    # EP only: the combine and d x crossing NVLink as one fp32 partial sum per token and rank, or one bf16 row per slot
    "epsums": {"rank": {"MOK_EP_COMBINE_SUMS": "rank"}, "slot": {"MOK_EP_COMBINE_SUMS": "slot"}},
    "epsumsauto": {"auto": {"MOK_EP_COMBINE_SUMS": "auto"}, "slot": {"MOK_EP_COMBINE_SUMS": "slot"}},
    # EP only: the backward's d x sums sent by the copy engines beside the weight gradients, or by the kernel after them
    "epdxpush": {"copy_engine": {"MOK_EP_DX_PUSH": "copy_engine"}, "kernel": {"MOK_EP_DX_PUSH": "kernel"}},
    # EP only: the dispatch as pull into the tokens / dy section + index_select, or one mok_ep_dispatch_rows
    # launch writing the GEMM's rows straight from the peers' sections
    "epdispatch": {"pull": {"MOK_EP_DISPATCH": "pull"}, "rows": {"MOK_EP_DISPATCH": "rows"}},
    "epdyrows": {"pull": {"MOK_EP_DY_ROWS": "pull"}, "push": {"MOK_EP_DY_ROWS": "push"},
                 "pull_again": {"MOK_EP_DY_ROWS": "pull"}, "push_again": {"MOK_EP_DY_ROWS": "push"}},
    "eprowsce": {"auto": {"MOK_EP_PULL": "auto"}, "push": {"MOK_EP_PULL": "push"},
                 "copy_engine": {"MOK_EP_PULL": "copy_engine"}},
    "epdownpush": {"kernel": {"MOK_EP_DOWN_PUSH": "kernel"}, "gemm": {"MOK_EP_DOWN_PUSH": "gemm"}},
    "epdxpushgemm": {"copy_engine": {"MOK_EP_DX_PUSH": "copy_engine"}, "gemm": {"MOK_EP_DX_PUSH": "gemm"},
                     "copy_engine_again": {"MOK_EP_DX_PUSH": "copy_engine"}, "gemm_again": {"MOK_EP_DX_PUSH": "gemm"}},
    # EP only: the forward's x rows kept for the backward, or pulled and gathered again there
    "epsavex": {"keep": {"MOK_EP_SAVE_X_ROWS": "1"}, "pull": {"MOK_EP_SAVE_X_ROWS": "0"}},
    # the overlapped forward (dispatch beside the gate/up GEMM, push beside the down GEMM)
    "epfwd": {
        "seq": {"MOK_EP_FWD": "sequential"},
        "ov16": {"MOK_EP_FWD": "overlap"},  # MoKConfig.fwd_num_comm_sms = 16 (the default)
    },
    # the overlapped forward's GEMMs: static tiles on the SMs the comm kernels leave free, or the _dyn
    # GEMMs on every SM claiming tiles by atomic add (both pairs, or the dispatch pair only)
    "epovdyn": {
        "seq": {"MOK_EP_FWD": "sequential"},
        "ov_static": {"MOK_EP_FWD": "overlap", "MOK_EP_OV_TILES": "static"},
        "ov_dynamic": {"MOK_EP_FWD": "overlap", "MOK_EP_OV_TILES": "dynamic"},
        "ov_dyn_dispatch": {"MOK_EP_FWD": "overlap", "MOK_EP_OV_TILES": "dispatch"},
    },
}


def with_env(fn, env, keys):
    """fn run with the mode's settings: env set, the other keys of its mode set unset. They stay so after
    fn returns, because bench.measure calls y.backward() outside fn and the backward reads its settings
    then; the next mode's call replaces them. (Before this, the settings were restored on return, so
    every mode's backward ran under the process environment: backward-only settings were not applied.)"""
    def run(*args):
        for k in keys:
            os.environ.pop(k, None)
        os.environ.update(env)
        return fn(*args)
    return run


def timing_record(m, name, flops, head, **tail):
    """One JSON record of bench.measure's result m for implementation `name`, against m["baseline"]."""
    (f, b, peak, act), (base_f, base_b) = m[name], m["baseline"][:2]
    return dict(head, fwd_ms=round(f, 4), bwd_ms=round(b, 4),
                fwd_tflops=round(flops / f / 1e9, 1), bwd_tflops=round(2 * flops / b / 1e9, 1),
                fwd_ratio=round(base_f / f, 3), bwd_ratio=round(base_b / b, 3),
                peak_gb=None if peak is None else round(peak, 3), act_gb=None if act is None else round(act, 3),
                **tail, commit=os.environ.get("MOK_COMMIT", "unknown"))


def timing_line(rec, label, check):
    return (f"{label} fwd {rec['fwd_ms']:7.3f} ms ({rec['fwd_ratio']:.2f}x)  bwd {rec['bwd_ms']:7.3f} ms "
            f"({rec['bwd_ratio']:.2f}x)  peak {rec['peak_gb']} GB  act {rec['act_gb']} GB  {check}")


def write_out(name, text):
    """text into $OUT/name (default /tmp)."""
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        f.write(text)


def outputs(fn, p):
    leaves = bench._leaves(p)
    y = fn(leaves[0], p["ids"], *leaves[1:])
    y.backward(p["dy"])
    return [y.detach()] + [t.grad for t in leaves]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--modes", default="gather", choices=sorted(MODE_SETS))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    group, rank, world = torchrun_group()
    mok = bench.mok_experts("cuda", group)
    modes = MODE_SETS[args.modes]
    keys = sorted({k for env in modes.values() for k in env})
    impls = {name: with_env(mok, env, keys) for name, env in modes.items()}
    impls["baseline"] = bench.baseline_experts if world == 1 else bench.baseline_experts_ep(group)
    records, ok = [], True
    for shape in args.shapes.split(","):
        hidden, inter, _, top_k = bench.SHAPES[shape]
        p = bench.make_problem(shape, args.tokens, "cuda", ep_size=world, ep_rank=rank)
        ref = None
        same = {}
        for name in modes:
            out = outputs(impls[name], p)
            if ref is None:
                ref = out
            same[name] = all(torch.equal(a, b) for a, b in zip(out, ref))
            ok &= same[name]
        del ref, out
        flops = 6 * args.tokens * top_k * hidden * inter
        m = bench.measure(impls, p, "cuda", args.iters, 3, group)
        base_f, base_b = m["baseline"][0], m["baseline"][1]
        for name in m:
            rec = timing_record(m, name, flops, dict(shape=shape, ep=world, mode=name),
                                bitwise_eq_first=same.get(name))
            records.append(rec)
            if rank == 0:
                print(timing_line(rec, f"{shape:<15} EP={world} {name:<13}", f"bits={same.get(name, '-')}"),
                      flush=True)
        del p
        torch.cuda.empty_cache()
    if rank == 0:
        write_out(f"bench_env_modes_ep{world}.json", json.dumps(records, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
