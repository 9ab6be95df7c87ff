"""Diagnostic (not a test): mok_combine_k2 (top_k = 2 only: four column chunks' loads in flight per thread)
against mok_combine (one chunk at a time), on mixtral's rows in schedule order, call by call, forward
(top-k weights) and the backward's d x form (w = 1); the bits must be equal.

    python tests/gpu/bench_combine_chunks.py
"""
import torch

from layer_runs import median_ms_queued
from mok_nn import bench
from mok_nn import cuda_backend as cb

for shape in ("mixtral-8x7b",):  # the one benchmark shape with top_k = 2
    p = bench.make_problem(shape, 8192, "cuda")
    E = p["gate_up_proj"].shape[0]
    sched = cb.make_schedule(p["ids"], E)
    H = p["x"].shape[1]
    rows = torch.randn(sched.capacity, H, device="cuda").to(torch.bfloat16)
    ids = p["ids"].contiguous()
    pos = sched.pos.contiguous()
    epl = cb.experts_per_leaf(E)
    for form, w in (("fwd", p["w"].float().contiguous()), ("dx", torch.ones_like(p["w"], dtype=torch.float32))):
        outs = {}
        for name in ("mok_combine", "mok_combine_k2"):
            out = torch.full((ids.shape[0], H), float("nan"), device="cuda", dtype=torch.bfloat16)

            def call(name=name, out=out):
                cb._lib().launch(name, rows, pos, w, ids, out, epl, stream=cb._stream())

            call()
            torch.cuda.synchronize()
            outs[name] = out.clone()
            ms = median_ms_queued(call, 30)
            gb = (ids.numel() * H * 2 + ids.shape[0] * H * 2) / 1e9
            print(f"{shape:14s} {form:3s} {name:20s} {ms:7.4f} ms  {gb / ms:6.2f} TB/s", flush=True)
        same = torch.equal(outs["mok_combine"].view(torch.int16), outs["mok_combine_k2"].view(torch.int16))
        print(f"{shape:14s} {form:3s} bitwise equal: {same}, NaN: {bool(torch.isnan(outs['mok_combine_k2']).any())}",
              flush=True)
