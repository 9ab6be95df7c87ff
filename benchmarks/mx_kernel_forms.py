"""Which tile form of the MXFP8 weight kernels is fastest, and what does it buy the frozen MXFP8-only layer?

Part 1, per shape: triton_ops.requantize_rows (the backward's column-wise values of MXFP8-only weights with
precision="mxfp8") and triton_ops.dequantize (MXFP8-only weights read as values elsewhere) in every tile form
(triton_ops.REQUANTIZE_FORM, DEQUANTIZE_FORM), on the shape's W13 and W2 (at most 32 experts: a program's work does
not depend on E) quantised from normal values and as random E4M3 bytes (requantize_rows' rounding path), each
form's bytes moved per second beside a copy of its output, its bits checked against the shipped form's. Part 2,
per shape: the routed experts with frozen MXFP8-only weights and precision="mxfp8" (the benchmark's
"mok_nn_mxfp8_frozen") under the shipped and the fastest requantize form, beside frozen bf16 weights, in one
process on one GPU:

    PYTHONPATH=. MOK_KERNEL_CACHE=build/kernels python benchmarks/mx_kernel_forms.py [--shapes qwen3-30b-a3b,...]
                                                                                    [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from steps import median_ms  # benchmarks/ is on sys.path when run as a script

from mok_nn import bench, triton_ops
from mok_nn.mxfp8 import quantize_experts

REQUANTIZE_FORMS = [(cols, warps) for cols in (32, 64, 128, 256) for warps in (2, 4, 8)]
DEQUANTIZE_FORMS = [(blocks, warps) for blocks in (64, 128, 256) for warps in (4, 8)]
MAX_EXPERTS = 32


@contextlib.contextmanager
def tile_form(attr, form):
    """triton_ops.<attr> (REQUANTIZE_FORM, DEQUANTIZE_FORM) set to form inside the block, the shipped one after."""
    shipped = getattr(triton_ops, attr)
    setattr(triton_ops, attr, form)
    try:
        yield
    finally:
        setattr(triton_ops, attr, shipped)


def mxfp8_weights(shape, kind, g):
    """E4M3 bytes and E8M0 scales (blocks of 32 along the last dim): "gaussian", quantised from normal values as
    real weights are (requantize_rows keeps most tiles' values unrounded), or "random_bytes" (no NaN byte) under
    scales of real weights' range (most tiles take its rounding)."""
    if kind == "gaussian":
        q = quantize_experts(torch.randn(shape, device="cuda", generator=g).bfloat16())
        return q.data, q.scale
    data = torch.randint(0, 256, shape, device="cuda", generator=g, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0x7E
    scale = torch.randint(112, 132, (*shape[:-1], shape[-1] // 32), device="cuda", generator=g, dtype=torch.uint8)
    return data.view(torch.float8_e4m3fn), scale


def kernel_forms(shape_name, g, reps, kernels):
    """One record per (weight, data, kernel, form): ms, GB/s (E4M3 bytes + scales read, bf16 written), copy's GB/s."""
    h, i, e, _k = bench.SHAPES[shape_name]
    e = min(e, MAX_EXPERTS)
    records = []
    for weight, shape in (("W13", (e, 2 * i, h)), ("W2", (e, h, i))):
        for kind in ("gaussian", "random_bytes"):
            data, scale = mxfp8_weights(shape, kind, g)
            for kernel, forms, attr, fn in (
                ("requantize_rows", REQUANTIZE_FORMS, "REQUANTIZE_FORM",
                 lambda: triton_ops.requantize_rows(data, scale, torch.bfloat16)),
                ("dequantize", DEQUANTIZE_FORMS, "DEQUANTIZE_FORM",
                 lambda: triton_ops.dequantize(data, scale, torch.bfloat16)),
            ):
                if kernel not in kernels:
                    continue
                shipped = getattr(triton_ops, attr)
                want = fn()
                moved = data.numel() + scale.numel() + want.numel() * 2
                copy_ms = median_ms(lambda: want.clone(), reps)
                for form in forms:
                    with tile_form(attr, form):
                        same = torch.equal(fn().view(torch.int16), want.view(torch.int16))
                        ms = median_ms(fn, reps)
                    rec = dict(shape=shape_name, weight=weight, experts=e, data=kind, kernel=kernel, form=list(form),
                               shipped=form == shipped, same_bits=same, ms=round(ms, 4),
                               gbps=round(moved / ms / 1e6, 1), copy_gbps=round(2 * want.numel() * 2 / copy_ms / 1e6, 1))
                    print(json.dumps(rec), flush=True)
                    records.append(rec)
    return records


def fastest(records, kernel):
    """The form with the least summed time over the weights quantised from normal values (real weights' case), among
    those giving the shipped form's bits on every input."""
    total = {}
    for r in records:
        if r["kernel"] == kernel and (r["data"] == "gaussian" or not r["same_bits"]):
            key = tuple(r["form"])
            total[key] = total.get(key, 0.0) + (r["ms"] if r["same_bits"] else float("inf"))
    return min(total, key=total.get)


def layer_rows(shape_name, tokens, form, iters, warmup):
    """Frozen bf16 weights, then frozen MXFP8-only ones with precision="mxfp8" under the shipped and the given
    requantize form: fwd / bwd ms and peak GB as the benchmark measures them."""
    p = bench.make_problem(shape_name, tokens, "cuda")
    shipped = triton_ops.REQUANTIZE_FORM
    frozen = bench.mok_experts("cuda", weights="frozen")
    mxfp8_only = bench.mok_experts("cuda", precision="mxfp8", weights="mxfp8_only")
    rows = []
    for name, impl, use in (("mok_nn_frozen", frozen, shipped), ("mok_nn_mxfp8_frozen", mxfp8_only, shipped),
                            ("mok_nn_mxfp8_frozen", mxfp8_only, form)):
        with tile_form("REQUANTIZE_FORM", use):
            (fwd, bwd, peak, _act), = bench.measure({name: impl}, p, "cuda", iters, warmup).values()
        rec = dict(shape=shape_name, tokens=tokens, impl=name, requantize_form=list(use), fwd_ms=round(fwd, 4),
                   bwd_ms=round(bwd, 4), peak_gb=round(peak, 3) if peak is not None else None)
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kernels", default="requantize_rows,dequantize", help="which kernels' forms to time")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=None, help="JSON lines file")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    head = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit,
                shipped_requantize=list(triton_ops.REQUANTIZE_FORM),
                shipped_dequantize=list(triton_ops.DEQUANTIZE_FORM))
    print(json.dumps(head), flush=True)
    records = [head]
    shapes = args.shapes.split(",")
    kernel_records = []
    for s in shapes:
        kernel_records += kernel_forms(s, g, args.reps, args.kernels.split(","))
    records += kernel_records
    best = {k: fastest(kernel_records, k) for k in args.kernels.split(",")}
    print(json.dumps({"fastest": {k: list(v) for k, v in best.items()}}), flush=True)
    records.append({"fastest": {k: list(v) for k, v in best.items()}})
    for s in shapes:
        records += layer_rows(s, args.tokens, best.get("requantize_rows", triton_ops.REQUANTIZE_FORM), args.iters,
                              args.warmup)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
