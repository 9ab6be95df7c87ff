"""Which CUDA kernels make up one forward+backward of mok_nn's routed experts (or with --layer its whole layer:
router, top-k and weights included; --forward: the forward alone), and how long does each take?

    python benchmarks/profile_layer.py [--shape deepseek-v3] [--tokens 8192] [--layer] [--forward]
                                       [--backend cuda|torch] [--precision bf16|mxfp8]
                                       [--weights trained|frozen|mxfp8_only]

Runs the benchmark's mok_nn step under torch.profiler and prints the kernels sorted by total CUDA time;
wall time above kernel time is the GPU waiting for the host.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mok_nn import bench
from steps import bench_steps, layer_steps  # benchmarks/ is on sys.path when run as a script


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="deepseek-v3", choices=[s for s in bench.SHAPES if s != "tiny"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="kernels listed")
    ap.add_argument("--layer", action="store_true", help="the whole layer, not the routed experts alone")
    ap.add_argument("--forward", action="store_true", help="the forward alone")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "torch"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "mxfp8"])
    ap.add_argument("--weights", default="trained", choices=bench.WEIGHT_MODES,
                    help="the routed experts' weights (bench.mok_experts); not with --layer")
    a = ap.parse_args()
    if a.layer and a.weights != "trained":
        ap.error("--weights applies to the routed experts (not --layer)")
    what = "forward" if a.forward else "forward+backward"
    steps = layer_steps if a.layer else bench_steps
    kw = {} if a.layer else {"weights": a.weights}
    step = dict(steps(a.shape, a.tokens, backend=a.backend, precision=a.precision, **kw))[what]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.reps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / a.reps * 1e3  # outside the profiler: its hooks slow the host
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.reps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / a.reps / 1e3
    region = f"{a.shape} {'layer' if a.layer else 'routed experts'} ({a.backend}, {a.precision}, {a.weights} weights)"
    print(f"{region}: {total:.3f} ms of kernel time per {what}, {wall:.3f} ms wall ({a.reps} reps)")
    for e in events[:a.top]:
        print(f"{e.device_time_total / a.reps / 1e3:9.3f} ms  x{e.count // a.reps:<3} {e.key[:110]}")


if __name__ == "__main__":
    main()
