"""Is mok_nn's forward host-bound? Host time per call of the routed experts against their GPU time,
then cProfile of the host side.

    python benchmarks/profile_host.py [--shape qwen3-30b-a3b] [--tokens 8192] [--top 22] [--long] [--layer]

The GPU is kept busy (torch.cuda._sleep) while the host issues the calls, so the host's time per call is its
own issue time, not a wait for the GPU. A forward whose host time is above its GPU time leaves the GPU idle
(the benchmark times each call from an idle GPU). Then cProfile of 20 forward calls: the Python functions
with the most host time (--long: also by cumulative time, and the callers of the costly builtins).
"""
import argparse
import cProfile
import pstats

import torch

from mok_nn import bench
from steps import bench_steps, host_ms_busy, layer_steps, median_ms  # benchmarks/ is on sys.path when run as a script


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s in bench.SHAPES if s != "tiny"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=22, help="rows of each cProfile table")
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--layer", action="store_true", help="the whole layer (MoKMoELayer) instead of the routed experts")
    a = ap.parse_args()
    steps = layer_steps if a.layer else bench_steps
    fwd, fwd_bwd = (call for _, call in steps(a.shape, a.tokens))
    for call in (fwd, fwd_bwd):
        for _ in range(3):
            call()
    for name, call, reps in (("forward", fwd, 20), ("forward+backward", fwd_bwd, 8)):
        what = f"{a.shape}{' layer' if a.layer else ''} {name}"
        print(f"{what}: host {host_ms_busy(call, reps):.3f} ms per call (GPU busy), "
              f"call from an idle GPU {median_ms(call, 20):.3f} ms", flush=True)

    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        fwd()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of 20 forward calls ({a.shape}), by own time:")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(a.top)
    if a.long:
        stats.sort_stats("cumulative").print_stats(a.top)
        stats.sort_stats("tottime").print_callers("empty|get|launch|pack")


if __name__ == "__main__":
    main()
