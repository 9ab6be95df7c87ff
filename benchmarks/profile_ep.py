"""Where does the time of the EP path go, on rank 0?

    torchrun --nproc_per_node 2 benchmarks/profile_ep.py [--shape qwen3-30b-a3b] [--tokens 8192]

Prints, for mok_nn's forward (no grad) and forward+backward at EP = world size: the wall
time per step, the CUDA kernel time per step, and the kernels by total time, so host
overhead (GPU waiting for launches) and the slow kernels show separately.
"""

import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from steps import ep_steps_from_args  # benchmarks/ is on sys.path when run as a script

shape, tokens, rank, world, steps = ep_steps_from_args(__doc__.split("\n\n")[0])


for name, step in steps:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    reps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.barrier()  # both ranks inside the profiler before the first step: no start-up skew
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps * 1e3
    if rank == 0:
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        events.sort(key=lambda e: -e.device_time_total)
        busy = sum(e.device_time_total for e in events) / reps / 1e3
        print(f"{shape} EP={world} {name}: wall {wall:.3f} ms per step, kernels {busy:.3f} ms", flush=True)
        for e in events[:25]:
            print(f"{e.device_time_total / reps / 1e3:9.3f} ms  x{e.count // reps:<3} {e.key[:100]}", flush=True)
        cpu = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
        cpu.sort(key=lambda e: -e.self_cpu_time_total)
        print("host ops by self CPU time:", flush=True)
        for e in cpu[:15]:
            print(f"{e.self_cpu_time_total / reps / 1e3:9.3f} ms  x{e.count // reps:<4} {e.key[:80]}", flush=True)
    dist.barrier()
dist.destroy_process_group()
