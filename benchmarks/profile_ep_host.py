"""The host side of the EP path on rank 0: is it host bound, and where?

    torchrun --nproc_per_node 2 benchmarks/profile_ep_host.py [--shape qwen3-30b-a3b] [--tokens 8192]

For mok_nn's forward (no grad) and forward+backward at EP = world size it prints: the wall
time per step with the GPU in the loop, the time to *issue* one step (host only, the GPU
kept busy beforehand by a long sleep kernel so no launch waits), and a cProfile table of
the issuing by own (tottime) time: the Python functions that cost host time. Then the forward's
host time up to the gate/up GEMM's launch (where the GPU waits for the host), with its cProfile
table by cumulative time.
"""

import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

from steps import ep_steps_from_args  # benchmarks/ is on sys.path when run as a script

shape, tokens, rank, world, steps = ep_steps_from_args(__doc__.split("\n\n")[0])


for name, step in steps:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e3
    dist.barrier()
    # host issue time: the GPU sleeps long enough to take every launch of `few` steps queued behind it
    # (a few steps only: a full launch queue would make the host wait again)
    few = 5
    issue = {}
    for mode in ("plain", "cprofile"):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU cycles on both ranks
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        if mode == "cprofile":
            prof.enable()
        for _ in range(few):
            step()
        prof.disable()
        issue[mode] = (time.perf_counter() - t0) / few * 1e3
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print(f"{shape} EP={world} {name}: wall {wall:.3f} ms per step; host issue {issue['plain']:.3f} ms "
              f"per step ({issue['cprofile']:.3f} under cProfile)", flush=True)
        raw = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, own s, cum s, callers)}
        rows = sorted(raw.items(), key=lambda kv: -kv[1][2])
        print(f"  {'own us/step':>11} {'cum us/step':>11} {'calls/step':>10}  function", flush=True)
        for (file, line, fname), (_, calls, own, cum, _) in rows[:45]:
            print(f"  {own / few * 1e6:11.1f} {cum / few * 1e6:11.1f} {calls / few:10.1f}  "
                  f"{fname} ({os.path.basename(file)}:{line})", flush=True)


class _FirstGemm(Exception):
    pass


# The forward's host time up to its first GEMM launch (whichever kernel: plain or fused gate/up +
# activation): on an idle GPU (as the benchmark times it) the GPU waits for the host until
# then. KernelLibrary.launch raises for the first mok_gemm_* kernel, so the forward stops there (on
# every rank alike; nothing runs after this, the half-done steps' data are not used).
from mok_nn.kernels import loader  # noqa: E402

fwd = dict(steps)["forward"]
real_launch = loader.KernelLibrary.launch


def _stop_at_gemm(self, name, *args, **kwargs):
    if name.startswith("mok_gemm"):
        raise _FirstGemm
    return real_launch(self, name, *args, **kwargs)


loader.KernelLibrary.launch = _stop_at_gemm
pre = {}
for mode in ("plain", "cprofile"):
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(int(1e9))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    for _ in range(few):
        if mode == "cprofile":
            prof.enable()
        try:
            fwd()
        except _FirstGemm:
            pass
        prof.disable()
    pre[mode] = (time.perf_counter() - t0) / few * 1e3
loader.KernelLibrary.launch = real_launch
torch.cuda.synchronize()
if rank == 0:
    print(f"{shape} EP={world} forward up to its first GEMM launch: host {pre['plain']:.3f} ms "
          f"({pre['cprofile']:.3f} under cProfile)", flush=True)
    raw = pstats.Stats(prof).stats
    rows = sorted(raw.items(), key=lambda kv: -kv[1][3])
    print(f"  {'own us/step':>11} {'cum us/step':>11} {'calls/step':>10}  function (by cumulative time)", flush=True)
    for (file, line, fname), (_, calls, own, cum, _) in rows[:45]:
        print(f"  {own / few * 1e6:11.1f} {cum / few * 1e6:11.1f} {calls / few:10.1f}  "
              f"{fname} ({os.path.basename(file)}:{line})", flush=True)
    # where the time of the big ones goes (cumulative us per step of each callee)
    for pattern in ("forward", "ep_schedule", "__call__", "publish", "pull_rows", "take_rows", "barrier"):
        st = pstats.Stats(prof)
        for (file, line, fname), (_, calls, own, cum, callers) in st.stats.items():
            if fname != pattern or "mok_nn" not in file:
                continue
            print(f"  callees of {fname} ({os.path.basename(file)}:{line}), {cum / few * 1e6:.1f} us/step:", flush=True)
            for (f2, l2, n2), v in st.stats.items():
                c = v[4].get((file, line, fname))
                if c:  # (prim calls, calls, own s, cum s) of this caller -> callee edge
                    print(f"      {c[3] / few * 1e6:9.1f} us  x{c[1] / few:.0f}  {n2} ({os.path.basename(f2)}:{l2})",
                          flush=True)
dist.destroy_process_group()
