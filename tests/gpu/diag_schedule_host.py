"""Diagnostic (not a test): where the host time of the EP = 1 forward's first launch goes (make_schedule with
the x gather), GPU kept busy so that only host time is measured. Prints us per call of: make_schedule whole,
its allocations, the argument packing of mok_schedule_gather, and the launch.

    python tests/gpu/diag_schedule_host.py [shape]
"""
import sys

import torch

from layer_runs import host_us_per_call  # the script's folder is on sys.path

from mok_nn import bench
from mok_nn import cuda_backend as cb

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
p = bench.make_problem(shape, 8192, "cuda")
x, ids = p["x"], p["ids"]
E = p["gate_up_proj"].shape[0]
lib = cb._lib()


T, k = ids.shape
dev = ids.device
cap = cb.schedule_capacity(T, k, E)
chunk, chunks = cb.schedule_chunk(T * k)


def allocs():
    outs = [torch.empty(T * k, dtype=torch.int64, device=dev), torch.empty(cap, dtype=torch.int64, device=dev),
            torch.empty(cap // cb.TILE_M, dtype=torch.int32, device=dev)]
    outs += [torch.empty(E, dtype=torch.int32, device=dev) for _ in range(3)]
    outs.append(torch.empty(chunks * E, dtype=torch.int32, device=dev))
    outs.append(torch.empty(cap, x.shape[1], dtype=x.dtype, device=dev))
    return outs


o = allocs()
flat = ids.reshape(-1).contiguous()
pos2 = o[0].view(T, k)
args = (flat, o[0], o[1], o[2], o[3], o[4], o[5], o[6], k, chunk, x, pos2, o[7], cb._scatter_rows_grid(T, cap, cb.num_sms(dev)))
plan = lib._plans["mok_schedule_gather"]
plan.pack(args, cb._stream())
torch.cuda.synchronize()
torch.cuda._sleep(3_000_000_000)
rows = {
    "make_schedule(gather_x=x) whole": lambda: cb.make_schedule(ids, E, gather_x=x),
    "the 8 allocations": allocs,
    "pack of mok_schedule_gather": lambda: plan.pack(args, 0),
    "launch of mok_schedule_gather": lambda: lib.launch("mok_schedule_gather", *args, stream=cb._stream()),
    "ids.reshape(-1).contiguous()": lambda: ids.reshape(-1).contiguous(),
    "_gathers_with_schedule": lambda: cb._gathers_with_schedule(x, pos2),
    "_scatter_rows_grid": lambda: cb._scatter_rows_grid(T, cap, cb.num_sms(dev)),
    "_stream()": cb._stream,
}
for name, fn in rows.items():
    print(f"{name:36s} {host_us_per_call(fn, calls=50):7.2f} us", flush=True)
torch.cuda.synchronize()
