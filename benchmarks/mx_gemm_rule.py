"""Where do the MX GEMMs beat making the weights' values in bf16 + the bf16 GEMM? The GEMMs of MXFP8-only weights,
both ways, over the mean routed rows per expert, at the benchmark shapes' H, I and E (one GPU, one process):

    PYTHONPATH=. MOK_KERNEL_CACHE=build/kernels python benchmarks/mx_gemm_rule.py [--gemms ...] [--out FILE.jsonl]

Per point: the forward's gate/up + SwiGLU (mok_gemm_gate_up_swiglu_mx against dequantize + the bf16 kernel the
rules pick) and down (mok_gemm_bk_mx against dequantize + grouped_gemm's bf16 kernel); precision="mxfp8"'s
backward dgrad GEMMs, d x (mok_gemm_bn_mxq) and d h (mok_gemm_bn_mxq_f32), against the values along K made by
triton_ops.requantize_rows + the bf16 kernel; and the bf16 kernels alone on resident values for scale. The MX
kernels read E4M3 bytes (about 1 byte per weight) and convert them once per row tile; the other way writes and
reads a bf16 copy (about 5 bytes per weight, once per call), so it wins where many rows share each expert. The
crossover it finds per GEMM is what cuda_mx.MX_MAX_ROWS_PER_EXPERT should sit at. The weights are Gaussian,
quantised (requantize_rows' time depends on how many of its tiles need rounding). Memory: the resident bf16 copies
for scale take 23 GB per direction at deepseek-v3; on an 80 GB GPU time the forward's GEMMs and the backward's in
separate runs there (--gemms gate_up,down, then --gemms dx,dh, as the records were made).
"""

from __future__ import annotations

import argparse
import json

import torch
from steps import median_ms  # benchmarks/ is on sys.path when run as a script

from mok_nn import cuda_backend as cb
from mok_nn import cuda_mx
from mok_nn.bench import SHAPES
from mok_nn.mxfp8 import quantize


def _gaussian_mx(E: int, N: int, K: int, g) -> cuda_mx.MxWeight:
    """Gaussian weights [E, N, K] (std K**-0.5) quantised along K, one expert at a time."""
    data = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(E, N, K // 32, dtype=torch.uint8, device="cuda")
    for e in range(E):
        q = quantize((torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16(), axis=-1)
        data[e], scale[e] = q.data, q.scale
    return cuda_mx.MxWeight(data, scale)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--rows-per-expert", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--gemms", default="gate_up,down,dx,dh", help="which GEMMs: gate_up, down (the forward's), "
                    "dx, dh (the backward's dgrad, precision='mxfp8')")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = open(args.out, "w") if args.out else None
    for shape in args.shapes.split(","):
        H, I, E, k = SHAPES[shape]
        gemms = args.gemms.split(",")
        w13, w2 = _gaussian_mx(E, 2 * I, H, g), _gaussian_mx(E, H, I, g)
        forward, backward = {"gate_up", "down"} & set(gemms), {"dx", "dh"} & set(gemms)
        wq13, wq2 = (w13.dequantized(), w2.dequantized()) if forward else (None, None)  # (memory: 23 GB at deepseek-v3)
        c13, c2 = (cuda_mx.MxColumnWeight(w.data, w.scale) for w in (w13, w2))
        v13, v2 = (c13.values(), c2.values()) if backward else (None, None)
        for rpe in (int(r) for r in args.rows_per_expert.split(",")):
            T = rpe * E // k
            ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]) if T <= 4096 \
                else torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices
            sched = cb.make_schedule(ids, E)
            a = torch.randn(sched.capacity, H, device="cuda", generator=g).bfloat16()
            h = torch.randn(sched.capacity, I, device="cuda", generator=g).bfloat16()
            dgu = torch.randn(sched.capacity, 2 * I, device="cuda", generator=g).bfloat16()
            f32 = torch.float32
            times = {
                "gate_up_mx": lambda: cb.launch_gate_up_act(a, w13, sched, "swiglu", None),
                "gate_up_dequant": lambda: cb.launch_gate_up_act(a, w13.dequantized(), sched, "swiglu", None),
                "gate_up_bf16": lambda: cb.launch_gate_up_act(a, wq13, sched, "swiglu", None),
                "down_mx": lambda: cb.gemm_mx(h, w2, sched),
                "down_dequant": lambda: cb.grouped_gemm(h, w2.dequantized(), sched, transpose_w=False),
                "down_bf16": lambda: cb.grouped_gemm(h, wq2, sched, transpose_w=False),
                "dx_mx": lambda: cb.gemm_mx_cols(dgu, c13, sched, "mok_gemm_bn_mxq", torch.bfloat16),
                "dx_dequant": lambda: cb.grouped_gemm(dgu, c13.values(), sched, transpose_w=True),
                "dx_bf16": lambda: cb.grouped_gemm(dgu, v13, sched, transpose_w=True),
                "dh_mx": lambda: cb.gemm_mx_cols(a, c2, sched, "mok_gemm_bn_mxq_f32", f32),
                "dh_dequant": lambda: cb.grouped_gemm(a, c2.values(), sched, transpose_w=True, out_dtype=f32),
                "dh_bf16": lambda: cb.grouped_gemm(a, v2, sched, transpose_w=True, out_dtype=f32),
            }
            row = {"shape": shape, "H": H, "I": I, "E": E, "k": k, "tokens": T, "rows_per_expert": rpe}
            for name, fn in times.items():
                if name.rsplit("_", 1)[0] in gemms:
                    row[f"{name}_ms"] = round(median_ms(fn, args.iters), 4)
            for gemm in gemms:
                row[f"{gemm}_mx_speedup"] = round(row[f"{gemm}_dequant_ms"] / row[f"{gemm}_mx_ms"], 3)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
            del a, h, dgu, sched, ids
        del w13, w2, wq13, wq2, c13, c2, v13, v2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
