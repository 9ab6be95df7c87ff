"""Diagnostic (not a test): mok_combine with 128 vs 256 threads per token, on the layer's rows (the down GEMM's
output in schedule order), call by call; the bits must be equal.

    python tests/gpu/bench_combine_threads.py
"""
import torch

from layer_runs import median_ms_queued
from mok_nn import bench
from mok_nn import cuda_backend as cb

for shape in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"):
    p = bench.make_problem(shape, 8192, "cuda")
    E = p["gate_up_proj"].shape[0]
    sched = cb.make_schedule(p["ids"], E)
    H = p["x"].shape[1]
    rows = torch.randn(sched.capacity, H, device="cuda").to(torch.bfloat16)
    w = p["w"].float().contiguous()
    ids = p["ids"].contiguous()
    pos = sched.pos.contiguous()
    epl = cb.experts_per_leaf(E)
    outs = {}
    for name in ("mok_combine", "mok_combine_t256"):
        out = torch.empty(ids.shape[0], H, device="cuda", dtype=torch.bfloat16)

        def call(name=name, out=out):
            cb._lib().launch(name, rows, pos, w, ids, out, epl, stream=cb._stream())

        call()
        torch.cuda.synchronize()
        outs[name] = out.clone()
        ms = median_ms_queued(call, 30)
        gb = (ids.numel() * H * 2 + ids.shape[0] * H * 2) / 1e9
        print(f"{shape:14s} {name:18s} {ms:7.4f} ms  {gb / ms:6.2f} TB/s", flush=True)
    same = torch.equal(outs["mok_combine"].view(torch.int16), outs["mok_combine_t256"].view(torch.int16))
    print(f"{shape:14s} bitwise equal: {same}", flush=True)
