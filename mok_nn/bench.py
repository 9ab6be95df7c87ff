"""Benchmark of the routed experts: mok_nn vs a torchtitan-style torch baseline (BENCHMARKS.md).

    python -m mok_nn.bench [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3] [--tokens 8192]
                           [--device cuda|cpu] [--iters 20] [--out docs/benchmarks/NAME.json]

Both implementations run in this process, on the same inputs and the same
routing (from a random router, so expert loads are uneven). Correctness
against each other is checked before timing. Forward time and forward+backward
time are medians over CUDA-event-timed iterations; bwd = (fwd+bwd) - fwd.
FLOPs: forward 6*T*k*H*I, backward twice that. On CPU (`--device cpu`, tiny
shapes) the same harness runs with host timers and mok_nn's reference path,
so CI covers it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

SHAPES = {  # H, I, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3": (7168, 2048, 256, 8),
    "tiny": (64, 32, 8, 2),
}


# --------------------------------------------------------------------------
# the baseline: what a PyTorch user runs today (EP = 1)


def baseline_experts(x, topk_ids, topk_weights, gate_up_proj, down_proj):
    """argsort -> gather -> grouped_mm -> SwiGLU -> grouped_mm -> unpermute -> weighted sum."""
    num_tokens, top_k = topk_ids.shape
    num_experts = gate_up_proj.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    rows = x[order // top_k]
    gate_up = torch._grouped_mm(rows, gate_up_proj.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    out = torch._grouped_mm(h, down_proj.transpose(1, 2), offs=offs)
    slots = torch.empty_like(out)
    slots[order] = out
    slots = slots.view(num_tokens, top_k, -1)
    return (slots.float() * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


# --------------------------------------------------------------------------
# mok_nn, as one autograd function over the experts


def mok_experts(backend: str):
    """mok_nn's routed experts through its functional layer and MoKFunction (what the layer runs)."""
    from . import functional
    from .autograd import MoKFunction

    def run(x, topk_ids, topk_weights, gate_up_proj, down_proj):
        ws = functional.get_workspace(
            hidden_size=x.shape[1], intermediate_size=down_proj.shape[2], num_experts=gate_up_proj.shape[0],
            top_k=topk_ids.shape[1], device=x.device, dtype=x.dtype, backend=backend,
        )  # fmt: skip
        return MoKFunction.apply(x, topk_weights, gate_up_proj, down_proj, None, None, topk_ids, ws)

    return run


# --------------------------------------------------------------------------
# harness


def make_problem(shape: str, tokens: int, device: str, seed: int = 0):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16
    x = torch.randn(tokens, hidden, device=device, generator=g).to(dt)
    router = torch.randn(num_experts, hidden, device=device, generator=g) / hidden**0.5
    scores = torch.softmax(x.float() @ router.T, dim=-1)
    w, ids = torch.topk(scores, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    gate_up_proj = (torch.randn(num_experts, 2 * inter, hidden, device=device, generator=g) / hidden**0.5).to(dt)
    down_proj = (torch.randn(num_experts, hidden, inter, device=device, generator=g) / inter**0.5).to(dt)
    dy = torch.randn(tokens, hidden, device=device, generator=g).to(dt)
    return dict(x=x, ids=ids, w=w, gate_up_proj=gate_up_proj, down_proj=down_proj, dy=dy)


def _leaves(p):
    return [t.detach().clone().requires_grad_(True) for t in (p["x"], p["w"], p["gate_up_proj"], p["down_proj"])]


def _timer(device):
    if device == "cuda":

        def t(fn):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)

    else:

        def t(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

    return t


def measure(fn, p, device, iters, warmup):
    x, w, gu, dn = _leaves(p)
    ids, dy = p["ids"], p["dy"]

    def fwd():
        with torch.no_grad():
            fn(x, ids, w, gu, dn)

    def fwd_bwd():
        y = fn(x, ids, w, gu, dn)
        y.backward(dy)

    for _ in range(warmup):
        fwd_bwd()
    timer = _timer(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    f = [timer(fwd) for _ in range(iters)]
    fb = [timer(fwd_bwd) for _ in range(iters)]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else None
    return statistics.median(f), statistics.median(fb) - statistics.median(f), peak


def check_agreement(a, b, p):
    """Forward output and input gradient of two implementations on the same problem."""
    outs = []
    for fn in (a, b):
        x, w, gu, dn = _leaves(p)
        y = fn(x, p["ids"], w, gu, dn)
        y.backward(p["dy"])
        outs.append((y.detach(), x.grad, w.grad, gu.grad, dn.grad))
        del x, w, gu, dn, y
    errs = {}
    for name, u, v in zip(("y", "dx", "dw", "d_gate_up", "d_down"), *outs):
        errs[name] = rel_l2(u, v)
    return errs


def rel_l2(u, v):
    """||u - v|| / ||v||, fp32, in chunks (weight gradients are large)."""
    num = den = 0.0
    for a, b in zip(u.reshape(u.shape[0], -1).split(8), v.reshape(v.shape[0], -1).split(8)):
        a, b = a.float(), b.float()
        num += (a - b).pow(2).sum().item()
        den += b.pow(2).sum().item()
    return (num / max(den, 1e-30)) ** 0.5


def _commit():
    c = os.environ.get("MOK_COMMIT")
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def run(shapes, tokens, device, iters, warmup, check=True):
    backend = "cuda" if device == "cuda" else "reference"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    impls = {"mok_nn": mok_experts(backend), "torch_baseline": baseline_experts}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = _commit()
    records = []
    for shape in shapes:
        hidden, inter, _, top_k = SHAPES[shape]
        p = make_problem(shape, tokens, device)
        if check:
            errs = check_agreement(impls["mok_nn"], impls["torch_baseline"], p)
            print(f"{shape}: mok_nn vs baseline rel L2 " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
            bad = {k: v for k, v in errs.items() if not v < 2e-2}
            if bad:
                raise RuntimeError(f"{shape}: implementations disagree: {bad}")
        flops = 6 * tokens * top_k * hidden * inter
        for impl, fn in impls.items():
            fwd_ms, bwd_ms, peak = measure(fn, p, device, iters, warmup)
            rec = dict(
                shape=shape, ep=1, tokens_per_rank=tokens, impl=impl, precision="bf16",
                fwd_ms=round(fwd_ms, 4), bwd_ms=round(bwd_ms, 4),
                fwd_tflops=round(flops / fwd_ms / 1e9, 2), bwd_tflops=round(2 * flops / bwd_ms / 1e9, 2),
                peak_mem_gb=None if peak is None else round(peak, 3), gpu=gpu, torch=torch.__version__, commit=commit, date=date,
            )  # fmt: skip
            records.append(rec)
            print(json.dumps(rec), flush=True)
        del p
        if device == "cuda":
            torch.cuda.empty_cache()
    return records


def summary(records):
    lines = [f"{'shape':<16} {'impl':<15} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9} {'peak GB':>8}"]
    by = {}
    for r in records:
        by.setdefault(r["shape"], {})[r["impl"]] = r
        lines.append(
            f"{r['shape']:<16} {r['impl']:<15} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} "
            f"{r['fwd_tflops']:9.1f} {r['bwd_tflops']:9.1f} {r['peak_mem_gb'] or float('nan'):8.2f}"
        )
    for shape, d in by.items():
        if "mok_nn" in d and "torch_baseline" in d:
            m, b = d["mok_nn"], d["torch_baseline"]
            lines.append(f"{shape}: ratio fwd {b['fwd_ms'] / m['fwd_ms']:.2f}x, bwd {b['bwd_ms'] / m['bwd_ms']:.2f}x")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="mok_nn vs torch baseline, routed experts, EP=1")
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=None, help="JSON file (default docs/benchmarks/<date>_<device>.json)")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s}; known: {', '.join(SHAPES)}")
    records = run(shapes, args.tokens, args.device, args.iters, args.warmup, check=not args.no_check)
    out = pathlib.Path(args.out or f"docs/benchmarks/{datetime.date.today()}_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(summary(records))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
