"""Bytes held by a MoKMoELayer's routed expert weights: parameters in the layer dtype vs MXFP8-only buffers.

    PYTHONPATH=. python benchmarks/mxfp8_weight_memory.py            # qwen3-30b-a3b's experts, one layer
    PYTHONPATH=. python benchmarks/mxfp8_weight_memory.py --hidden 7168 --intermediate 2048 --experts 256

Builds the layer on the CPU (no GPU needed): once with bf16 parameters, then quantize_experts_(); and once
directly with mxfp8_experts=True (never holding the weights in the layer dtype). Counts the bytes of the
tensors layer.experts holds (biases excluded; there are none here). MXFP8 stores an E4M3 byte per value and an
E8M0 byte per 32 values: (1 + 1/32) / 2 = 0.515625 of bf16.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from mok_nn import MoKMoELayer


def expert_weight_bytes(layer) -> dict:
    """{name: bytes} of the expert weight tensors layer.experts holds (parameters and buffers, no biases)."""
    e = layer.experts
    held = list(e.named_parameters()) + list(e.named_buffers())
    return {n: t.numel() * t.element_size() for n, t in held if "bias" not in n}


def _peak_rss() -> int:
    """The process's peak resident set size in bytes (Linux: ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:,.1f} MiB)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args(argv)
    H, I, E = args.hidden, args.intermediate, args.experts
    k = min(args.top_k, E)
    print(f"expert weights of one MoKMoELayer: hidden_size={H}, intermediate_size={I}, num_experts={E}; "
          f"layer dtype bfloat16; torch {torch.__version__}, CPU")

    rss0 = _peak_rss()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    direct = MoKMoELayer(H, I, E, k, dtype=torch.bfloat16, mxfp8_experts=True)
    t_direct = time.perf_counter() - t0
    direct_total = sum(expert_weight_bytes(direct).values())
    params = [n for n, _ in direct.experts.named_parameters()]
    grew = _peak_rss() - rss0
    print(f"built with mxfp8_experts=True: {_mib(direct_total)} held, parameters in layer.experts: "
          f"{params or 'none'} ({t_direct:.2f} s, random init quantised one expert at a time); the process's "
          f"peak RSS grew by {_mib(grew)} while building it")
    del direct

    torch.manual_seed(0)
    layer = MoKMoELayer(H, I, E, k, dtype=torch.bfloat16)
    dense = expert_weight_bytes(layer)
    for n, b in dense.items():
        print(f"  bf16 parameter {n:<22} {_mib(b)}")
    dense_total = sum(dense.values())
    print(f"  bf16 parameters, total        {_mib(dense_total)}")

    t0 = time.perf_counter()
    layer.quantize_experts_()
    t_quant = time.perf_counter() - t0
    mx = expert_weight_bytes(layer)
    assert not list(layer.experts.parameters()), "quantize_experts_ left parameters behind"
    for n, b in mx.items():
        print(f"  MXFP8 buffer {n:<25} {_mib(b)}")
    data = sum(b for n, b in mx.items() if not n.endswith("_scale"))
    scales = sum(b for n, b in mx.items() if n.endswith("_scale"))
    mx_total = data + scales
    print(f"  MXFP8-only, total             {_mib(mx_total)} (E4M3 data {_mib(data)} + E8M0 scales {_mib(scales)})")
    ratio = mx_total / dense_total
    print(f"ratio {ratio:.4f} of bf16 (E4M3: 1 byte per value, E8M0 scale: 1/32 byte per value, vs 2 bytes: "
          f"(1 + 1/32) / 2 = 0.515625); saved {_mib(dense_total - mx_total)} per layer")
    print(f"quantize_experts_ took {t_quant:.2f} s (one expert at a time)")
    del layer

    ok = direct_total == mx_total and ratio <= 0.55 and not params
    print("PASS: at most 0.55x of bf16" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
