"""Diagnostic (not a test): the combine kernels side by side on the layer's rows in schedule order, call by call,
forward (top-k weights) and the backward's d x form (w = 1); the bits must equal mok_combine's.
mok_combine: one column chunk at a time (top_k <= 32); mok_combine_k2: top_k = 2 only, four chunks' loads in
flight per thread; mok_combine_cp: top_k <= 16, the loads staged in shared memory by cp.async.

    python tests/gpu/bench_combine_chunks.py
"""
import torch

from layer_runs import median_ms_queued
from mok_nn import bench
from mok_nn import cuda_backend as cb

for shape in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"):
    p = bench.make_problem(shape, 8192, "cuda")
    E = p["gate_up_proj"].shape[0]
    sched = cb.make_schedule(p["ids"], E)
    H = p["x"].shape[1]
    rows = torch.randn(sched.capacity, H, device="cuda").to(torch.bfloat16)
    ids = p["ids"].contiguous()
    pos = sched.pos.contiguous()
    epl = cb.experts_per_leaf(E)
    names = ["mok_combine", "mok_combine_cp"] + (["mok_combine_k2"] if ids.shape[1] == 2 else [])
    for form, w in (("fwd", p["w"].float().contiguous()), ("dx", torch.ones_like(p["w"], dtype=torch.float32))):
        outs = {}
        for name in names:
            out = torch.full((ids.shape[0], H), float("nan"), device="cuda", dtype=torch.bfloat16)

            def call(name=name, out=out):
                cb._lib().launch(name, rows, pos, w, ids, out, epl, stream=cb._stream())

            call()
            torch.cuda.synchronize()
            outs[name] = out.clone()
            ms = median_ms_queued(call, 30)
            gb = (ids.numel() * H * 2 + ids.shape[0] * H * 2) / 1e9
            same = torch.equal(outs["mok_combine"].view(torch.int16), out.view(torch.int16))
            print(f"{shape:14s} {form:3s} {name:16s} {ms:7.4f} ms  {gb / ms:6.2f} TB/s  same bits: {same}", flush=True)

