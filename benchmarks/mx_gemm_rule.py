"""Where do the MX GEMMs beat dequantise + bf16 GEMM? The forward's two GEMMs of MXFP8-only weights, both ways,
over the mean routed rows per expert, at the benchmark shapes' H, I and E (one GPU, one process):

    PYTHONPATH=. MOK_KERNEL_CACHE=build/kernels python benchmarks/mx_gemm_rule.py [--out FILE.jsonl]

Per point: gate/up + SwiGLU (mok_gemm_gate_up_swiglu_mx against dequantize + the bf16 kernel the rules pick) and
down (mok_gemm_bk_mx against dequantize + grouped_gemm's bf16 kernel), and the bf16 kernels alone on resident
W_q for scale. The MX kernels read E4M3 bytes (about 1 byte per weight, read once per row tile); the other way
writes and reads a bf16 copy (about 5 bytes per weight, once per call), so it wins where many rows share each
expert. The crossover it finds per GEMM is what cuda_mx.MX_MAX_ROWS_PER_EXPERT (the forward's rule) should sit at.
"""

from __future__ import annotations

import argparse
import json

import torch
from steps import median_ms  # benchmarks/ is on sys.path when run as a script

from mok_nn import cuda_backend as cb
from mok_nn import cuda_mx
from mok_nn.bench import SHAPES


def _random_mx(E: int, N: int, K: int, g) -> cuda_mx.MxWeight:
    """Random E4M3 bytes (no NaN byte) and scale bytes near 2**0: the timing does not depend on the values."""
    data = torch.randint(0, 256, (E, N, K), dtype=torch.uint8, device="cuda", generator=g)
    data[(data & 0x7F) == 0x7F] = 0
    scale = torch.randint(118, 124, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g)
    return cuda_mx.MxWeight(data.view(torch.float8_e4m3fn), scale)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--rows-per-expert", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = open(args.out, "w") if args.out else None
    for shape in args.shapes.split(","):
        H, I, E, k = SHAPES[shape]
        w13, w2 = _random_mx(E, 2 * I, H, g), _random_mx(E, H, I, g)
        wq13, wq2 = w13.dequantized(), w2.dequantized()
        for rpe in (int(r) for r in args.rows_per_expert.split(",")):
            T = rpe * E // k
            ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]) if T <= 4096 \
                else torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices
            sched = cb.make_schedule(ids, E)
            a = torch.randn(sched.capacity, H, device="cuda", generator=g).bfloat16()
            h = torch.randn(sched.capacity, I, device="cuda", generator=g).bfloat16()
            times = {
                "gate_up_mx": lambda: cb.launch_gate_up_act(a, w13, sched, "swiglu", None),
                "gate_up_dequant": lambda: cb.launch_gate_up_act(a, w13.dequantized(), sched, "swiglu", None),
                "gate_up_bf16": lambda: cb.launch_gate_up_act(a, wq13, sched, "swiglu", None),
                "down_mx": lambda: cb.gemm_mx(h, w2, sched),
                "down_dequant": lambda: cb.grouped_gemm(h, w2.dequantized(), sched, transpose_w=False),
                "down_bf16": lambda: cb.grouped_gemm(h, wq2, sched, transpose_w=False),
            }
            row = {"shape": shape, "H": H, "I": I, "E": E, "k": k, "tokens": T, "rows_per_expert": rpe}
            for name, fn in times.items():
                row[f"{name}_ms"] = round(median_ms(fn, args.iters), 4)
            for gemm in ("gate_up", "down"):
                row[f"{gemm}_mx_speedup"] = round(row[f"{gemm}_dequant_ms"] / row[f"{gemm}_mx_ms"], 3)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
            del a, h, sched, ids
        del w13, w2, wq13, wq2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
