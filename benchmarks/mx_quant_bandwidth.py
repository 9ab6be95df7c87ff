"""How close is mok_mx_quant to a plain copy? Effective bandwidth (bytes read + written per second) of each of its
modes on qwen3-30b-a3b's operands, beside torch's copy of the same tensor and fake_quantize_fast (the torch ops it
replaces); and of mxfp8.dequantize (MXFP8-only weights, every call) on its expert weights beside a copy of the
bf16 result; in one process on one GPU:

    PYTHONPATH=. MOK_KERNEL_CACHE=build/kernels python benchmarks/mx_quant_bandwidth.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from steps import median_ms  # benchmarks/ is on sys.path when run as a script

from mok_nn import cuda_backend as cb
from mok_nn.mxfp8 import dequantize, fake_quantize_fast, quantize


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, I, E, K = 8192, 2048, 768, 128, 8
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
    sched = cb.make_schedule(ids, E)
    cases = {
        "x [T, H] along H (mode 0)": (torch.randn(T, H, device="cuda", generator=g).bfloat16(), cb.MX_ALONG_COLS, None),
        "W13 [E 2I, H] along 2I (mode 1)": (torch.randn(E * 2 * I, H, device="cuda", generator=g).bfloat16(),
                                            cb.MX_ALONG_ROWS, None),
        "d gate_up rows [M_cap, 2I] per expert (mode 2)": (
            torch.randn(sched.capacity, 2 * I, device="cuda", generator=g).bfloat16(), cb.MX_SEGMENTS, sched),
    }
    records = []
    for name, (t, mode, s) in cases.items():
        nbytes = 2 * t.numel() * t.element_size()  # read once, written once
        row = {"operand": name, "mb": round(nbytes / 2**20, 1)}
        for impl, fn in (("mok_mx_quant", lambda: cb.mx_values(t, mode, s)), ("copy", lambda: t.clone()),
                         ("fake_quantize_fast", lambda: fake_quantize_fast(t, -1 if mode == cb.MX_ALONG_COLS else 0))):
            ms = median_ms(fn, 20)
            row[f"{impl}_ms"] = round(ms, 4)
            row[f"{impl}_gbps"] = round(nbytes / ms / 1e6, 1)
        print(json.dumps(row), flush=True)
        records.append(row)
    for name, shape in (("W13 [E, 2I, H] dequantised", (E, 2 * I, H)), ("W2 [E, H, I] dequantised", (E, H, I))):
        q = quantize(torch.randn(*shape, device="cuda", generator=g).bfloat16(), axis=-1)
        out = dequantize(q, torch.bfloat16)
        nbytes = q.data.numel() + q.scale.numel() + out.numel() * out.element_size()  # E4M3 + scales read, bf16 written
        row = {"operand": name, "mb": round(nbytes / 2**20, 1)}
        for impl, fn in (("dequantize", lambda: dequantize(q, torch.bfloat16)), ("copy", lambda: out.clone())):
            ms = median_ms(fn, 20)
            moved = nbytes if impl == "dequantize" else 2 * out.numel() * out.element_size()
            row[f"{impl}_ms"] = round(ms, 4)
            row[f"{impl}_gbps"] = round(moved / ms / 1e6, 1)
        print(json.dumps(row), flush=True)
        records.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
