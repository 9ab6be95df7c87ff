"""Diagnostic (not a test): host time of mok_nn's routed experts at EP = 1, against their GPU time.

    python tests/gpu/profile_host.py [shape] [tokens] [top]   (top: rows of each table; given, also
                                                              by cumulative time and the callers of the builtins)

The GPU is kept busy (torch.cuda._sleep) while the host issues N calls, so the host's time per call
is its own issue time, not a wait for the GPU. A forward whose host time is above its GPU time
leaves the GPU idle (the benchmark times each call from an idle GPU). Then cProfile of the same
calls: the Python functions with the most host time.
"""
import cProfile
import pstats
import sys

import torch

import layer_runs  # the script's folder is on sys.path

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
fwd, fwd_bwd = (call for _, call in layer_runs.bench_steps(shape, tokens))
for call in (fwd, fwd_bwd):
    for _ in range(3):
        call()
for name, call, reps in (("forward", fwd, 20), ("forward+backward", fwd_bwd, 8)):
    print(f"{shape} {name}: host {layer_runs.host_ms_busy(call, reps):.3f} ms per call (GPU busy), "
          f"call from an idle GPU {layer_runs.median_ms(call, 20):.3f} ms", flush=True)

torch.cuda.synchronize()
torch.cuda._sleep(1_000_000_000)
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    fwd()
prof.disable()
torch.cuda.synchronize()
top = int(sys.argv[3]) if len(sys.argv) > 3 else 22
print(f"\ncProfile of 20 forward calls ({shape}), by own time:")
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(top)
if len(sys.argv) > 3:  # the long form: also by cumulative time, and who calls the costly builtins
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_callers("empty|get|launch|pack")
