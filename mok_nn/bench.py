"""Benchmark of the routed experts: mok_nn vs a torchtitan-style torch baseline (BENCHMARKS.md).

    python -m mok_nn.bench [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3] [--tokens 8192]
                           [--device cuda|cpu] [--iters 20] [--out docs/benchmarks/NAME.json]
    torchrun --nproc_per_node 2 -m mok_nn.bench ...     expert parallelism over the ranks (EP = world size)

Both implementations run in this process, on the same inputs and the same
routing (from a random router, so expert loads are uneven). Correctness
against each other is checked before timing. Forward time and forward+backward
time are medians over CUDA-event-timed iterations; bwd = (fwd+bwd) - fwd.
FLOPs: forward 6*T*k*H*I, backward twice that. Under torchrun (EP = P) each
rank has its own tokens and E/P experts, the baseline exchanges rows with
all_to_all_single (host copy of the split sizes), and a time is the slowest
rank's median. On CPU (`--device cpu`, tiny
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


def baseline_experts_ep(group):
    """torchtitan-style EP: argsort -> counts all-to-all (host split sizes) -> rows all-to-all ->
    regroup by local expert -> grouped_mm / SwiGLU / grouped_mm -> reverse all-to-all -> weighted sum."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnf

    world = dist.get_world_size(group)

    def run(x, topk_ids, topk_weights, gate_up_proj, down_proj):
        num_tokens, top_k = topk_ids.shape
        e_l = gate_up_proj.shape[0]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        dest = sorted_ids // e_l
        send_counts = torch.bincount(dest, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = torch.stack([send_counts, recv_counts]).tolist()  # the host sync every EP baseline has
        rows = x[order // top_k]
        got = dnf.all_to_all_single(rows.new_empty(sum(recv), x.shape[1]), rows, recv, send, group=group)
        local_ids = torch.empty(sum(recv), dtype=sorted_ids.dtype, device=x.device)
        dist.all_to_all_single(local_ids, (sorted_ids - dest * e_l).contiguous(), recv, send, group=group)
        order2 = torch.argsort(local_ids, stable=True)
        offs = torch.cumsum(torch.bincount(local_ids, minlength=e_l), 0).to(torch.int32)
        gate_up = torch._grouped_mm(got[order2], gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offs)
        out = out[torch.argsort(order2)]
        back = dnf.all_to_all_single(out.new_empty(sum(send), x.shape[1]), out, send, recv, group=group)
        slots = back[torch.argsort(order)].view(num_tokens, top_k, -1)
        return (slots.float() * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    return run


# --------------------------------------------------------------------------
# mok_nn, as one autograd function over the experts


def mok_experts(backend: str, group=None, config=None):
    """mok_nn's routed experts through its functional layer and MoKFunction (what the layer runs);
    config: a MoKConfig (None: the default)."""
    from . import functional
    from .autograd import MoKFunction
    from .distributed import group_size_and_rank

    world = group_size_and_rank(group)[0]

    def run(x, topk_ids, topk_weights, gate_up_proj, down_proj):
        ws = functional.get_workspace(
            hidden_size=x.shape[1], intermediate_size=down_proj.shape[2], num_experts=gate_up_proj.shape[0] * world,
            top_k=topk_ids.shape[1], device=x.device, dtype=x.dtype, backend=backend, ep_group=group, config=config,
        )  # fmt: skip
        return MoKFunction.apply(x, topk_weights, gate_up_proj, down_proj, None, None, topk_ids, ws)

    return run


# --------------------------------------------------------------------------
# harness


def make_problem(shape: str, tokens: int, device: str, seed: int = 0, ep_size: int = 1, ep_rank: int = 0):
    """With ep_size > 1: this rank's tokens and its E/ep_size experts; the router is shared."""
    if ep_size > 1:
        return _make_problem_ep(shape, tokens, device, seed, ep_size, ep_rank)
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


def _make_problem_ep(shape, tokens, device, seed, ep_size, ep_rank):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    e_l = num_experts // ep_size
    g = torch.Generator(device=device).manual_seed(seed)  # shared: the router
    gx = torch.Generator(device=device).manual_seed(seed + 1 + ep_rank)  # this rank's tokens
    gw = torch.Generator(device=device).manual_seed(seed + 101 + ep_rank)  # this rank's experts
    dt = torch.bfloat16
    router = torch.randn(num_experts, hidden, device=device, generator=g) / hidden**0.5
    x = torch.randn(tokens, hidden, device=device, generator=gx).to(dt)
    dy = torch.randn(tokens, hidden, device=device, generator=gx).to(dt)
    scores = torch.softmax(x.float() @ router.T, dim=-1)
    w, ids = torch.topk(scores, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    gate_up_proj = (torch.randn(e_l, 2 * inter, hidden, device=device, generator=gw) / hidden**0.5).to(dt)
    down_proj = (torch.randn(e_l, hidden, inter, device=device, generator=gw) / inter**0.5).to(dt)
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


def measure(impls, p, device, iters, warmup, group=None):
    """{impl: (median fwd ms, bwd ms (= fwd+bwd minus fwd), peak GB above inputs+params,
    activation GB kept for bwd)} for every implementation in impls {name: fn}.

    The implementations share the same leaf tensors, and their timed iterations
    rotate (A B, B A, ... for two; A B C, B C A, C A B, ... for three), so clock and
    temperature drift over the run affects all alike instead of favouring whichever
    runs first or second. Gradients are
    reset to None before every iteration, as optimizer.zero_grad() does in
    training, so no implementation pays for accumulating into old grads. With a
    process group, times and peak are the slowest rank's.
    """
    leaves = _leaves(p)
    x, w, gu, dn = leaves
    ids, dy = p["ids"], p["dy"]

    def fwd(fn):
        with torch.no_grad():
            fn(x, ids, w, gu, dn)

    def fwd_bwd(fn):
        for t in leaves:
            t.grad = None
        y = fn(x, ids, w, gu, dn)
        y.backward(dy)

    timer = _timer(device)
    mem = {}
    for name, fn in impls.items():
        for _ in range(warmup):
            fwd_bwd(fn)
        for t in leaves:
            t.grad = None
        act = peak = None
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            y = fn(x, ids, w, gu, dn)  # what the forward keeps alive for backward (+ y itself)
            act = (torch.cuda.memory_allocated() - base) / 2**30
            del y
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fwd_bwd(fn)  # every iteration allocates alike: one shows the peak
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            for t in leaves:
                t.grad = None
        mem[name] = (peak, act)
    f = {name: [] for name in impls}
    fb = {name: [] for name in impls}
    order = list(impls.items())
    for step, times in ((fwd, f), (fwd_bwd, fb)):
        for i in range(iters):
            # Rotated order: A B C, B C A, C A B, ... (two: A B, B A, ...): every implementation takes
            # every position equally often (the mirrored A B C, C B A ran the first and the last twice
            # in a row). Even so, one configuration listed twice differs by up to ~4% in the backward
            # at deepseek-v3 and mixtral (v30, v31): compare layer variants with that in mind.
            k = i % len(order)
            for name, fn in order[k:] + order[:k]:
                times[name].append(timer(lambda: step(fn)))
    for t in leaves:
        t.grad = None
    out = {}
    for name in impls:
        f_ms, fb_ms = statistics.median(f[name]), statistics.median(fb[name])
        peak, act = mem[name]
        if group is not None:  # an iteration takes as long as its slowest rank
            import torch.distributed as dist

            t = torch.tensor([f_ms, fb_ms, peak or 0.0], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            f_ms, fb_ms, peak = t.tolist()
        out[name] = (f_ms, fb_ms - f_ms, peak, act)
    return out


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
    """The checkout's HEAD (the --commit flag overrides it, e.g. where the tree travels without .git)."""
    try:
        here = pathlib.Path(__file__).resolve().parent  # mok_nn's checkout, not the working directory's
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def run(shapes, tokens, device, iters, warmup, check=True, group=None, commit=None):
    from .distributed import group_size_and_rank

    ep, rank = group_size_and_rank(group)
    backend = "cuda" if device == "cuda" else "reference"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    baseline = baseline_experts if ep == 1 else baseline_experts_ep(group)
    impls = {"mok_nn": mok_experts(backend, group), "torch_baseline": baseline}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = commit or _commit()
    records = []
    for shape in shapes:
        hidden, inter, _, top_k = SHAPES[shape]
        p = make_problem(shape, tokens, device, ep_size=ep, ep_rank=rank)
        if check:
            errs = check_agreement(impls["mok_nn"], impls["torch_baseline"], p)
            print(f"{shape} (rank {rank}): mok_nn vs baseline rel L2 "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
            bad = {k: v for k, v in errs.items() if not v < 2e-2}
            if bad:
                raise RuntimeError(f"{shape}: implementations disagree: {bad}")
        flops = 6 * tokens * top_k * hidden * inter
        measured = measure(impls, p, device, iters, warmup, group)
        for impl, (fwd_ms, bwd_ms, peak, act) in measured.items():
            if act is not None and rank == 0:
                print(f"{shape} {impl}: activation memory kept for backward {act:.3f} GB (rank 0)", flush=True)
            rec = dict(
                shape=shape, ep=ep, tokens_per_rank=tokens, impl=impl, precision="bf16",
                fwd_ms=round(fwd_ms, 4), bwd_ms=round(bwd_ms, 4),
                fwd_tflops=round(flops / fwd_ms / 1e9, 2), bwd_tflops=round(2 * flops / bwd_ms / 1e9, 2),
                peak_mem_gb=None if peak is None else round(peak, 3), gpu=gpu, torch=torch.__version__, commit=commit, date=date,
            )  # fmt: skip
            records.append(rec)
            if rank == 0:
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
    ap = argparse.ArgumentParser(description="mok_nn vs torch baseline, routed experts (EP = torchrun world size)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated; default: the three benchmark shapes on CUDA, 'tiny' on CPU")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank; default 8192 on CUDA, 64 on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=None, help="JSON file (default docs/benchmarks/<date>_<device>.json)")
    ap.add_argument("--commit", default=None, help="the records' commit field (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    on_cuda = args.device == "cuda"
    if args.shapes is None:  # the full shapes take hours on a CPU: there, only the harness is exercised
        args.shapes = "qwen3-30b-a3b,mixtral-8x7b,deepseek-v3" if on_cuda else "tiny"
    if args.tokens is None:
        args.tokens = 8192 if on_cuda else 64
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s}; known: {', '.join(SHAPES)}")
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: EP over all ranks
        import torch.distributed as dist

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        group = dist.group.WORLD
    records = run(shapes, args.tokens, args.device, args.iters, args.warmup, check=not args.no_check, group=group,
                  commit=args.commit)
    if group is None or dist.get_rank() == 0:
        out = pathlib.Path(args.out or f"docs/benchmarks/{datetime.date.today()}_{args.device}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(summary(records))
        print(f"wrote {out}")
    if group is not None:
        # every rank waits for the others before tearing down: a rank leaving first made gloo abort others
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
