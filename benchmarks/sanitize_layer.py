"""Small forward+backward passes of the CUDA path for compute-sanitizer (device_session.sh step `sanitize`).

Each case runs experts_forward / experts_backward once per setting: the defaults (ping-pong GEMMs where I <= 1024,
the fused activation epilogues, dynamic tiles), every GEMM cooperative (MOK_GEMM_PINGPONG=0: the `_dyn` GEMMs
everywhere) and static tiles. The cases reach the kernels the benchmark shapes use at a few hundred tokens: a
qwen3-like layer (H = 2048), one with H > 4096 (the unfused dgrad of down, deepseek-v3's path), one with K > 8192
(the split epilogues, mixtral's path), an expert with no tokens and a T that is not a multiple of the tile.

Run it under the sanitizer, e.g.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 tests/gpu/sanitize_layer.py
(without the caching allocator every tensor is its own allocation, so an access past a tensor's end is caught).
--plant-oob instead launches the combine kernel (a library kernel with plain global loads) with one slot index far
past its rows: memcheck must report an invalid global read in mok_combine_k2, which shows that the sanitizer
sees into the library's kernels (device_session.sh checks it).
Outside the sanitizer it checks what it can: every output finite, the settings within bf16 rounding of the
defaults. Exit status 1 on a failed check.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env_modes import with_env  # noqa: E402
from layer_runs import rel_err  # noqa: E402

from mok_nn import cuda_backend as cb  # noqa: E402

# (name, T, H, I, E, k)
CASES = [
    ("qwen3-like", 200, 2048, 768, 16, 8),
    ("h-over-4096", 150, 4608, 1280, 6, 2),
    ("k-over-8192", 70, 1024, 9216, 4, 2),
    ("small", 1, 256, 512, 8, 2),
]
SETTINGS = [("default", {}), ("cooperative", {"MOK_GEMM_PINGPONG": "0"}), ("static tiles", {"MOK_GEMM_TILES": "static"})]
SETTING_VARS = {v for _, env in SETTINGS for v in env}  # each setting unsets the others' variables
TOL = 2e-2  # the settings differ only in the fp32 summation order of d topk-weights where the epilogues differ


def problem(T, H, I, E, k, seed):
    """Routing with the last expert empty, bf16 inputs and weights scaled by 1/sqrt(fan-in)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(T, E, device="cuda", generator=g)
    scores[:, -1] = float("-inf")
    w, ids = scores.softmax(-1).topk(k, dim=-1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    W13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(torch.bfloat16)
    return ids, w, x, dy, W13, W2


def run(ids, w, x, dy, W13, W2):
    y, saved = cb.experts_forward(x, ids, w, W13, W2)
    dx, dtk, grads = cb.experts_backward(dy, saved, x, ids, w, W13, W2)
    torch.cuda.synchronize()
    return {"y": y, "dx": dx, "d_topk": dtk, "d_gate_up": grads.gate_up_proj, "d_down": grads.down_proj}


def plant_oob():
    """The combine kernel reading row 2**20 of a 64-row tensor (no bounds check there: the schedule's positions are
    in range by construction)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(64, device="cuda").view(32, 2)
    pos[5, 1] = 2**20
    w = torch.rand(32, 2, device="cuda", generator=g)
    ids = torch.zeros(32, 2, dtype=torch.int64, device="cuda")
    cb.combine(rows, pos, w, ids, 8, torch.bfloat16)
    torch.cuda.synchronize()
    print("planted out-of-bounds read launched")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma-separated case names")
    ap.add_argument("--plant-oob", action="store_true", help="only the planted out-of-bounds read (see above)")
    args = ap.parse_args()
    if args.plant_oob:
        plant_oob()
        return 0
    wanted = args.cases.split(",")
    unknown = set(wanted) - {c[0] for c in CASES}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {[c[0] for c in CASES]}")
    failed = 0
    for name, T, H, I, E, k in (c for c in CASES if c[0] in wanted):
        inputs = problem(T, H, I, E, k, seed=T + H)
        want = None
        for label, env in SETTINGS:
            got = with_env(run, env, SETTING_VARS)(*inputs)
            bad = [n for n, t in got.items() if not torch.isfinite(t).all()]
            errs = {n: rel_err(t, want[n]) for n, t in got.items()} if want is not None else {}
            bad += [n for n, e in errs.items() if e > TOL]
            want = want or got
            failed += bool(bad)
            worst = max(errs.values(), default=0.0)
            print(f"{name:12s} {label:13s} {'FAIL ' + str(bad) if bad else 'ok'} (max rel err vs default {worst:.1e})",
                  flush=True)
    print("all ok" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
