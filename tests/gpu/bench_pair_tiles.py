"""Diagnostic (not a test): the M-grouped GEMMs on pair-tile schedules (segments padded to 64 rows, a row
tile may hold two experts) against the default schedule (128 rows) and kernels, call by call.

    python tests/gpu/bench_pair_tiles.py [shape ...]

Same routing for both; each GEMM's output rows are compared bitwise slot by slot (row pos[t, j] of
either schedule), then timed (CUDA events, median of 20).
"""
import statistics
import sys

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb


def timed(fn, reps=20):
    fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def run(shape):
    p = bench.make_problem(shape, 8192, "cuda")
    x, ids, W13, W2, dy = p["x"], p["ids"], p["gate_up_proj"], p["down_proj"], p["dy"]
    E, H, I = W13.shape[0], W2.shape[1], W2.shape[2]
    s128 = cb.make_schedule(ids, E)
    s64 = cb.make_schedule_torch(ids, E, pad_rows=cb.PAIR_ROWS)
    used128, used64 = int(s128.seg_end[-1]), int(s64.seg_end[-1])
    te = s64.tile_expert
    pairs = int(((te >= 0) & ((te >> cb.PAIR_SHIFT) != 0)).sum())
    tiles64 = int((te >= 0).sum())
    print(f"{shape}: rows {used128} (128) vs {used64} (64), tiles {used128 // 128} vs {tiles64}, "
          f"pair tiles {pairs}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    slots = ids.numel()
    h_slots = torch.randn(slots, I, device="cuda", generator=g).to(torch.bfloat16)
    dgu_slots = torch.randn(slots, 2 * I, device="cuda", generator=g).to(torch.bfloat16)
    dy_slots = torch.randn(slots, H, device="cuda", generator=g).to(torch.bfloat16)
    gemms = (  # (name, a slot rows, weights, transpose_w, out dtype)
        ("gate_up", x.repeat_interleave(ids.shape[1], 0), W13, False, torch.bfloat16),
        ("down", h_slots, W2, False, torch.bfloat16),
        ("dgrad down f32", dy_slots, W2, True, torch.float32),
        ("dgrad gate_up", dgu_slots, W13, True, torch.bfloat16),
    )
    for name, a_slots, w, tw, odt in gemms:
        res = {}
        for label, s in (("128", s128), ("pair", s64)):
            a = torch.zeros(s.capacity, a_slots.shape[1], device="cuda", dtype=torch.bfloat16)
            a[s.pos.reshape(-1)] = a_slots
            n = w.shape[2] if tw else w.shape[1]
            out = torch.full((s.capacity, n), float("nan"), device="cuda", dtype=odt)
            b = w.permute(2, 1, 0) if tw else w.permute(1, 2, 0)
            kname = cb.gemm_kernel(tw, odt, k=a.shape[1])
            if label == "pair":
                kname = ("mok_gemm_bn" if tw else "mok_gemm_bk") + ("_f32" if odt == torch.float32 else "") + "_pair"
            ms = timed(lambda: cb.launch_gemm(kname, a, b, out, s))
            res[label] = (kname, ms, out[s.pos.reshape(-1)].clone())
        same = torch.equal(res["128"][2].view(torch.int8 if odt == torch.bfloat16 else torch.int32),
                           res["pair"][2].view(torch.int8 if odt == torch.bfloat16 else torch.int32))
        (k1, t1, _), (k2, t2, _) = res["128"], res["pair"]
        print(f"{shape:<14} {name:<15} {k1:<18} {t1:7.3f} ms   {k2:<22} {t2:7.3f} ms   "
              f"{t1 / t2:5.3f}x  bitwise={same}", flush=True)


for sh in sys.argv[1:] or ["deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"]:
    run(sh)
