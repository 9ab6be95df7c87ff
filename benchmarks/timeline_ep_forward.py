"""Where does an EP forward, timed as the benchmark times it (idle GPU, one synchronised call), wait, on
every rank?

    torchrun --nproc_per_node 2 benchmarks/timeline_ep_forward.py [--shape S] [--tokens N]
    torchrun --nproc_per_node 1 benchmarks/timeline_ep_forward.py ...   (EP = 1: cuda_backend)

Each stage of cuda_ep.forward (publish, barrier, schedule + pull, gather, gate/up GEMM, ...) is wrapped:
after it returns, the host time since the call began is noted and a CUDA event is recorded on the
current stream (the GPU time at which the stage's work was done); rows marked ">" are host times at
the entry of a function (the layers above the first launch, and every kernel launch). Per stage it prints the median over
the repetitions of: host us (issue done), GPU us (work done), both from the call's start. Where a
stage's GPU time is close to its host time, the GPU waited for the host; a long GPU time behind a
barrier is a wait for the peer. The events themselves cost a few us of host time each.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from mok_nn import bench
from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep
from steps import torchrun_group  # benchmarks/ is on sys.path when run as a script

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--shape", default="qwen3-30b-a3b")
parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
args = parser.parse_args()
shape = args.shape
group, rank, world = torchrun_group()
if group is None:
    raise SystemExit("run under torchrun (an NCCL process group over the EP ranks)")
problem = bench.make_problem(shape, args.tokens, "cuda", ep_size=world, ep_rank=rank)
experts = bench.mok_experts("cuda", group)
x, w, gu, dn = bench._leaves(problem)


def fwd():
    """mok_nn's routed experts on this rank's part of mok_nn.bench's problem, as the benchmark times them."""
    with torch.no_grad():
        experts(x, problem["ids"], w, gu, dn)

marks = []  # (stage, host s, event) of the running call


def _wrap(owner, name, stage):
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((stage, time.perf_counter(), ev))
        return out

    setattr(owner, name, wrapped)


def _enter(owner, name, stage):
    """Host time at the call of owner.name (no event): where the host is before the first launch."""
    real = owner.__dict__[name]
    fn = real.__func__ if isinstance(real, staticmethod) else real

    def wrapped(*args, **kwargs):
        marks.append((stage, time.perf_counter(), None))
        return fn(*args, **kwargs)

    setattr(owner, name, staticmethod(wrapped) if isinstance(real, staticmethod) else wrapped)


from mok_nn import autograd, functional  # noqa: E402
from mok_nn.kernels import loader  # noqa: E402

for owner, name, stage in [
    (functional, "get_workspace", "> get_workspace"),
    (autograd.MoKFunction, "forward", "> MoKFunction.forward"),
    (functional, "forward", "> functional.forward"),
    (cuda_ep, "forward", "> cuda_ep.forward"),
    (cuda_ep, "check_errors", "> check_errors"),
    (cb, "check_supported", "> check_supported"),
    (cb, "experts_forward", "> experts_forward"),  # EP = 1 (torchrun --nproc_per_node 1)
    (cb, "make_schedule", "> make_schedule"),
    (cuda_ep, "_buffers", "> _buffers"),
    (cuda_ep, "schedule_capacity", "> schedule_capacity"),
    (cb, "use_fused_act", "> use_fused_act"),
    (cuda_ep.SymmBuffers, "publish", "> publish"),
    (loader.KernelLibrary, "launch", "> a kernel launch"),
]:
    _enter(owner, name, stage)

for owner, name, stage in [
    (cuda_ep.SymmBuffers, "publish", "publish"),
    (cuda_ep.SymmBuffers, "barrier", "barrier"),
    (cuda_ep, "ep_schedule", "schedule (+ pull)"),
    (cb, "make_schedule", "schedule"),
    (cb, "take_rows", "gather rows"),
    (cb, "gate_up_act", "gate/up GEMM + act"),
    (cb, "grouped_gemm", "grouped GEMM"),
    (cb, "grouped_gemm_push", "down GEMM + row push"),
    (cb, "act_forward", "activation"),
    (cuda_ep.SymmBuffers, "push_partials", "push partial sums"),
    (cuda_ep.SymmBuffers, "push_rows", "push rows"),
    (cuda_ep.SymmBuffers, "final_combine", "final combine"),
    (cb, "combine", "combine"),
]:
    if hasattr(owner, name):
        _wrap(owner, name, stage)

for _ in range(5):
    fwd()
torch.cuda.synchronize()
reps = 30
rows = {}  # (index, stage) -> ([host us], [gpu us])
ends = []
for _ in range(reps):
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    marks.clear()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fwd()
    end.record()
    t_end = time.perf_counter()
    end.synchronize()
    ends.append((start.elapsed_time(end) * 1e3, (t_end - t0) * 1e6))
    for i, (stage, t, ev) in enumerate(marks):
        h, g = rows.setdefault((i, stage), ([], []))
        h.append((t - t0) * 1e6)
        g.append(start.elapsed_time(ev) * 1e3 if ev is not None else float("nan"))

lines = [f"rank {rank}: {shape} EP={world} forward, {reps} synchronised calls, medians "
         f"(us from the call's start; GPU time of an event = its stage's work done)"]
for (i, stage), (h, g) in sorted(rows.items()):
    gpu = f"GPU {statistics.median(g):8.1f}" if g[0] == g[0] else ""
    lines.append(f"  {stage:24s} host {statistics.median(h):8.1f}   {gpu}")
lines.append(f"  {'call (end event)':24s} host {statistics.median(e[1] for e in ends):8.1f}   "
             f"GPU {statistics.median(e[0] for e in ends):8.1f}")
out = [None] * world
dist.all_gather_object(out, "\n".join(lines))
if rank == 0:
    print("\n".join(out), flush=True)
dist.destroy_process_group()
