"""Quantise a safetensors checkpoint's expert weights to MXFP8 and report size and error.

    python examples/quantize_checkpoint.py                       # demo on a small random checkpoint
    python examples/quantize_checkpoint.py IN OUT.safetensors [--scale-mode floor]

IN is a .safetensors file or a directory of shards (with config.json /
hf_quant_config.json); any format mok_nn.checkpoint reads is accepted. Expert
weights stored in floating point are quantised row-wise (along K); FP8
checkpoints are converted. Everything else is copied unchanged. OUT is written
in the mok_nn.mxfp8 format (mok_nn.checkpoint.save_mxfp8); it may not be the
input file or lie inside the input directory (it would be read as a shard).
"""

import argparse
import os
import sys
import tempfile

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mok_nn import checkpoint  # noqa: E402
from mok_nn.mxfp8 import MXFP8Tensor  # noqa: E402


def _nbytes(t) -> int:
    return t.nbytes if isinstance(t, MXFP8Tensor) else t.numel() * t.element_size()


def _file_size(path) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return os.path.getsize(path)


def make_demo_checkpoint(path, layers=2, experts=8, hidden=256, inter=128, seed=0):
    """A small random BF16 MoE checkpoint with fused expert weights (mok_nn / transformers 5.x names)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp."
        tensors[p + "gate.weight"] = (torch.randn(experts, hidden, generator=g) * 0.02).bfloat16()
        tensors[p + "experts.gate_up_proj"] = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).bfloat16()
        tensors[p + "experts.down_proj"] = (torch.randn(experts, hidden, inter, generator=g) * 0.02).bfloat16()
        tensors[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, path)


def _check_paths(ap, inp, out):
    """argparse errors naming the path: a missing input, an output inside the input directory (the next
    run would read it as one more shard) or replacing the input, an output that cannot be written."""
    if not os.path.exists(inp):
        ap.error(f"input {inp!r} does not exist")
    if not os.path.isdir(inp) and not os.path.isfile(inp):
        ap.error(f"input {inp!r} is neither a file nor a directory")
    real_in, real_out = os.path.realpath(inp), os.path.realpath(out)
    if os.path.isdir(inp) and os.path.commonpath([real_in, real_out]) == real_in:
        ap.error(f"output {out!r} is inside the input directory {inp!r}: a later run would read it as a shard; "
                 "write it elsewhere")
    if real_in == real_out:
        ap.error(f"output {out!r} is the input file: write it elsewhere")
    if os.path.isdir(out):
        ap.error(f"output {out!r} is a directory, expected a .safetensors file path")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        ap.error(f"the directory of output {out!r} does not exist")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", nargs="?", help="checkpoint file or directory (default: a random demo checkpoint)")
    ap.add_argument("output", nargs="?", help="output .safetensors file (default: next to the input)")
    ap.add_argument("--scale-mode", default="rceil", choices=["rceil", "floor"])
    args = ap.parse_args(argv)

    tmp = None
    if args.input is None:
        tmp = tempfile.TemporaryDirectory()
        args.input = os.path.join(tmp.name, "demo.safetensors")
        make_demo_checkpoint(args.input)
        print(f"built a random demo checkpoint: {args.input}")
    if args.output is None:
        base = args.input.rstrip("/").removesuffix(".safetensors")
        args.output = base + ".mxfp8.safetensors"
    _check_paths(ap, args.input, args.output)

    try:
        fmt = checkpoint.detect_format(args.input)
        source, _, config = checkpoint.read_safetensors(args.input)
        block = (checkpoint.quantization_config(config) or {}).get("weight_block_size")
        loaded = checkpoint.load_mxfp8_tensors(args.input, scale_mode=args.scale_mode)
    except (OSError, checkpoint.CheckpointFormatError) as err:
        ap.error(f"cannot read input {args.input!r}: {err}")
    quantized = checkpoint.quantize_expert_weights(loaded, scale_mode=args.scale_mode)
    checkpoint.save_mxfp8(args.output, quantized, metadata={"source_format": fmt, "scale_mode": args.scale_mode})

    print(f"input format: {fmt}")
    print(f"{'tensor':60s} {'shape':>18s} {'bytes in':>10s} {'bytes out':>10s} {'max rel err':>12s} {'rms rel err':>12s}")
    worst = 0.0
    for name, q in quantized.items():
        if not isinstance(q, MXFP8Tensor):
            continue
        src = source[name]
        ref = None
        if src.is_floating_point() and src.dtype != torch.float8_e4m3fn:
            ref = src.float()
        elif name + "_scale_inv" in source and source[name + "_scale_inv"].is_floating_point():
            s_inv = source[name + "_scale_inv"]  # block FP8: error of the requantisation
            ref = checkpoint.dequantize_block_fp8(src, s_inv, checkpoint.block_fp8_block_size(name, src.shape, s_inv.shape, block))
        if ref is not None:
            dq = q.dequantize(torch.float32)
            diff = (dq - ref).abs()
            max_rel = (diff.max() / ref.abs().max()).item()
            rms_rel = (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
            worst = max(worst, max_rel)
            errs = f"{max_rel:12.3e} {rms_rel:12.3e}"
        else:
            errs = f"{'(MX copy, exact)':>25s}"
        src_bytes = _nbytes(src) + sum(_nbytes(source[name + s]) for s in ("_scale", "_scale_inv") if name + s in source)
        print(f"{name:60s} {str(tuple(q.shape)):>18s} {src_bytes:10d} {q.nbytes:10d} {errs}")
    before, after = _file_size(args.input), _file_size(args.output)
    kept = " (demo: deleted on exit)" if tmp is not None else ""
    print(f"file size: {before} -> {after} bytes ({after / before:.3f}x); output: {args.output}{kept}")
    print(f"worst max |error| / max |weight| of a quantised tensor: {worst:.3e}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
