"""Diagnostic (not a test): does the benchmark's alternation with the torch baseline change mok_nn's times?

    python tests/gpu/diag_bench_alternation.py [shape]

mok_nn's forward timed as mok_nn.bench times it (idle GPU, one synchronised call): alone, and with the
baseline's forward between its calls (the benchmark's rotation); the caching allocator's device
allocations and frees during each timed loop (a cudaMalloc / cudaFree inside a call is host time the GPU
waits for)."""
import statistics
import sys

import torch

from mok_nn import bench

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
p = bench.make_problem(shape, 8192, "cuda")
x, w, gu, dn = bench._leaves(p)
ids = p["ids"]
mok = bench.mok_experts("cuda")
base = bench.baseline_experts
timer = bench._timer("cuda")


def fwd(fn):
    with torch.no_grad():
        fn(x, ids, w, gu, dn)


def stats():
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_device_free", 0), s.get("num_alloc_retries", 0)


for _ in range(3):
    fwd(mok), fwd(base)
for label, others in (("alone", []), ("after baseline", [base]), ("alone again", []),
                      ("after baseline again", [base])):
    times = []
    a0 = stats()
    for _ in range(20):
        for o in others:
            timer(lambda: fwd(o))
        times.append(timer(lambda: fwd(mok)))
    a1 = stats()
    print(f"{shape} mok_nn forward {label:22s} median {statistics.median(times):.3f} ms  min {min(times):.3f}  "
          f"max {max(times):.3f}  device allocs / frees / retries during the loop {[b - a for a, b in zip(a0, a1)]}",
          flush=True)
