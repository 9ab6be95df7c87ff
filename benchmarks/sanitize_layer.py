"""Do the CUDA kernels stay in bounds and race-free? Small forward+backward passes of the CUDA experts path,
to run under compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \\
        python benchmarks/sanitize_layer.py [--cases small,h-over-4096]

(without the caching allocator every tensor is its own allocation, so an access past a tensor's end is
caught). The cases reach the kernels of the benchmark shapes at a few hundred tokens: a qwen3-like layer
(H = 2048), H > 4096 (the unfused dgrad of down, deepseek-v3's path), K > 8192 (the split epilogues,
mixtral's path), and a single token; each has an expert with no tokens and a T that is not a multiple of
the tile. --plant-oob instead launches the combine kernel with one slot index far past its rows: memcheck
must report an invalid global read in a mok_combine kernel, which shows that the sanitizer sees into the
library's kernels. Outside the sanitizer it checks that every output is finite (exit status 1 otherwise).
"""
import argparse
import sys

import torch

from mok_nn import cuda_backend as cb

# (name, T, H, I, E, k)
CASES = [
    ("qwen3-like", 200, 2048, 768, 16, 8),
    ("h-over-4096", 150, 4608, 1280, 6, 2),
    ("k-over-8192", 70, 1024, 9216, 4, 2),
    ("small", 1, 256, 512, 8, 2),
]


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
    # as the layer's backward runs where autograd keeps no graph: d gate_up written over the saved gate_up
    dx, dtk, grads = cb.experts_backward(dy, saved, x, ids, w, W13, W2, consume_saved=True)
    torch.cuda.synchronize()
    return {"y": y, "dx": dx, "d_topk": dtk, "d_gate_up": grads.gate_up_proj, "d_down": grads.down_proj}


def plant_oob():
    """The combine kernel reading row 2**20 of a 64-row tensor (it has no bounds check: the schedule's
    positions are in range by construction)."""
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
    ap.add_argument("--plant-oob", action="store_true", help="only the planted out-of-bounds read")
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
        got = run(*problem(T, H, I, E, k, seed=T + H))
        bad = [n for n, t in got.items() if not torch.isfinite(t).all()]
        failed += bool(bad)
        print(f"{name:12s} {'FAIL: not finite ' + str(bad) if bad else 'ok'}", flush=True)
    print("all ok" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
