"""Benchmark of the routed experts: mok_nn vs a torchtitan-style torch baseline (BENCHMARKS.md).

    python -m mok_nn.bench [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3] [--tokens 8192]
                           [--device cuda|cpu] [--iters 20] [--out docs/benchmarks/NAME.json]
                           [--backend torch [--dtype bf16|fp32] [--mxfp8] [--layer]]
    torchrun --nproc_per_node 2 -m mok_nn.bench ...     expert parallelism over the ranks (EP = world size)

--backend torch adds the portable backend ("mok_nn_torch") beside the fused path (on CUDA) and the
baseline, and, where transformers is installed, transformers' own experts module with its default
experts implementation ("hf_default", grouped_mm) on the same weights and the same routing (the
routing is passed in: its forward takes the top-k ids and weights). --dtype fp32 runs the problem in
fp32 ("precision" records the dtype); --mxfp8 adds the portable backend with precision="mxfp8";
--layer adds the whole block (router, top-k, experts) of mok_nn's portable backend and of
transformers' Qwen3MoeSparseMoeBlock with the same weights ("*_layer" records).

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


def mok_experts(backend: str, group=None, config=None, precision="bf16"):
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
            precision=precision,
        )  # fmt: skip
        return MoKFunction.apply(x, topk_weights, gate_up_proj, down_proj, None, None, topk_ids, ws)

    return run


# --------------------------------------------------------------------------
# transformers' own MoE experts / block, default experts implementation


def _hf_config(shape: str, dtype):
    """A Qwen3-MoE config of this shape (every benchmark shape is SwiGLU experts over [E, 2I, H] / [E, H, I]
    weights with a softmax top-k router; Qwen3's block is the closest transformers block to each), with
    transformers' default experts implementation, grouped_mm."""
    import transformers

    hidden, inter, num_experts, top_k = SHAPES[shape]
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                                         num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    config._experts_implementation = "grouped_mm"  # what from_pretrained / from_config pick by default
    return config


def hf_experts(shape: str, device, dtype):
    """transformers' Qwen3MoeExperts on the benchmark's weights and routing: the weights enter through
    functional_call (the leaves every implementation shares), the routing as the forward's top-k arguments."""
    from torch.func import functional_call
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    with torch.device("meta"):
        module = Qwen3MoeExperts(_hf_config(shape, dtype))

    def run(x, topk_ids, topk_weights, gate_up_proj, down_proj):
        return functional_call(module, {"gate_up_proj": gate_up_proj, "down_proj": down_proj},
                               (x, topk_ids, topk_weights.to(x.dtype)))

    return run


def _hf_available() -> bool:
    try:
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
    except Exception:
        return False
    return True


def layer_problem(shape, tokens, device, dtype, seed=0):
    """mok_nn's layer (portable backend) and transformers' Qwen3MoeSparseMoeBlock holding the same weights."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from .layer import MoKMoELayer

    hidden, inter, num_experts, top_k = SHAPES[shape]
    torch.manual_seed(seed)
    mok = MoKMoELayer(hidden, inter, num_experts, top_k, norm_topk_prob=True, backend="torch", device=device,
                      dtype=dtype)
    hf = Qwen3MoeSparseMoeBlock(_hf_config(shape, dtype)).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf.gate.weight.copy_(mok.router.weight)
        hf.experts.gate_up_proj.copy_(mok.experts.gate_up_proj)
        hf.experts.down_proj.copy_(mok.experts.down_proj)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(1, tokens, hidden, device=device, generator=g).to(dtype)
    dy = torch.randn(1, tokens, hidden, device=device, generator=g).to(dtype)
    return {"mok_nn_torch_layer": mok, "hf_default_layer": hf}, x, dy


def measure_layers(modules, x, dy, device, iters, warmup):
    """{name: (fwd ms, bwd ms)} of whole blocks, rotated as measure() does."""
    timer = _timer(device)
    xs = x.detach().clone().requires_grad_(True)

    def fwd(m):
        with torch.no_grad():
            m(xs)

    def fwd_bwd(m):
        xs.grad = None
        m.zero_grad(set_to_none=True)
        m(xs).backward(dy)

    for m in modules.values():
        for _ in range(warmup):
            fwd_bwd(m)
    order = list(modules.items())
    f = {n: [] for n in modules}
    fb = {n: [] for n in modules}
    for step, times in ((fwd, f), (fwd_bwd, fb)):
        for i in range(iters):
            k = i % len(order)
            for name, m in order[k:] + order[:k]:
                times[name].append(timer(lambda: step(m)))
    return {n: (statistics.median(f[n]), statistics.median(fb[n]) - statistics.median(f[n])) for n in modules}


# --------------------------------------------------------------------------
# harness


def make_problem(shape: str, tokens: int, device: str, seed: int = 0, ep_size: int = 1, ep_rank: int = 0,
                 dtype=torch.bfloat16):
    """With ep_size > 1: this rank's tokens and its E/ep_size experts; the router is shared."""
    if ep_size > 1:
        return _make_problem_ep(shape, tokens, device, seed, ep_size, ep_rank)
    hidden, inter, num_experts, top_k = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    dt = dtype
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


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _impls(device, backend, group, ep, shape, dtype, mxfp8):
    """{impl: fn}: mok_nn's fused path (CUDA) or reference path, or with backend "torch" the portable backend
    beside the fused path (on CUDA, bf16), the baseline and transformers' default experts."""
    baseline = baseline_experts if ep == 1 else baseline_experts_ep(group)
    if backend != "torch":
        return {"mok_nn": mok_experts(backend, group), "torch_baseline": baseline}
    impls = {}
    if device == "cuda" and dtype == torch.bfloat16:
        impls["mok_nn"] = mok_experts("cuda", group)
    impls["mok_nn_torch"] = mok_experts("torch", group)
    if mxfp8:
        impls["mok_nn_torch_mxfp8"] = mok_experts("torch", group, precision="mxfp8")
    impls["torch_baseline"] = baseline
    if ep == 1 and _hf_available():
        impls["hf_default"] = hf_experts(shape, device, dtype)
    return impls


def run(shapes, tokens, device, iters, warmup, check=True, group=None, commit=None, backend=None, dtype="bf16",
        mxfp8=False, layer=False):
    from .distributed import group_size_and_rank

    ep, rank = group_size_and_rank(group)
    if backend is None:
        backend = "cuda" if device == "cuda" else "reference"
    dt = DTYPES[dtype]
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = commit or _commit()
    records = []
    for shape in shapes:
        hidden, inter, _, top_k = SHAPES[shape]
        impls = _impls(device, backend, group, ep, shape, dt, mxfp8)
        p = make_problem(shape, tokens, device, ep_size=ep, ep_rank=rank, dtype=dt)
        if check:
            first = next(iter(impls))
            for other in impls:
                if other == first:
                    continue
                errs = check_agreement(impls[other], impls[first], p)
                print(f"{shape} (rank {rank}): {other} vs {first} rel L2 "
                      + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
                limit = 0.1 if other.endswith("mxfp8") else 2e-2  # MXFP8: ~3 mantissa bits per operand
                bad = {k: v for k, v in errs.items() if not v < limit}
                if bad:
                    raise RuntimeError(f"{shape}: implementations disagree: {other} vs {first}: {bad}")
        flops = 6 * tokens * top_k * hidden * inter
        measured = measure(impls, p, device, iters, warmup, group)
        for impl, (fwd_ms, bwd_ms, peak, act) in measured.items():
            if act is not None and rank == 0:
                print(f"{shape} {impl}: activation memory kept for backward {act:.3f} GB (rank 0)", flush=True)
            precision = "mxfp8" if impl.endswith("mxfp8") else dtype
            rec = dict(
                shape=shape, ep=ep, tokens_per_rank=tokens, impl=impl, precision=precision,
                fwd_ms=round(fwd_ms, 4), bwd_ms=round(bwd_ms, 4),
                fwd_tflops=round(flops / fwd_ms / 1e9, 2), bwd_tflops=round(2 * flops / bwd_ms / 1e9, 2),
                peak_mem_gb=None if peak is None else round(peak, 3), gpu=gpu, torch=torch.__version__, commit=commit, date=date,
            )  # fmt: skip
            records.append(rec)
            if rank == 0:
                print(json.dumps(rec), flush=True)
        del p
        if layer and ep == 1 and _hf_available():
            records += _layer_records(shape, tokens, device, dt, dtype, iters, warmup, flops, gpu, commit, date)
        if device == "cuda":
            torch.cuda.empty_cache()
    return records


def _layer_records(shape, tokens, device, dt, dtype, iters, warmup, flops, gpu, commit, date):
    """The whole block (router, top-k, experts): mok_nn's portable backend vs transformers' Qwen3MoeSparseMoeBlock,
    same weights; their routings agree up to near-ties of the top-k (the outputs are checked first)."""
    modules, x, dy = layer_problem(shape, tokens, device, dt)
    with torch.no_grad():
        y_m, y_h = (m(x) for m in modules.values())
    err = rel_l2(y_m.reshape(tokens, -1), y_h.reshape(tokens, -1))
    print(f"{shape}: whole layer, mok_nn_torch vs transformers rel L2 y {err:.1e}", flush=True)
    if not err < 5e-2:
        raise RuntimeError(f"{shape}: whole layers disagree: rel L2 {err:.2e}")
    out = []
    for impl, (fwd_ms, bwd_ms) in measure_layers(modules, x, dy, device, iters, warmup).items():
        rec = dict(shape=shape, ep=1, tokens_per_rank=tokens, impl=impl, precision=dtype, fwd_ms=round(fwd_ms, 4),
                   bwd_ms=round(bwd_ms, 4), fwd_tflops=round(flops / fwd_ms / 1e9, 2),
                   bwd_tflops=round(2 * flops / bwd_ms / 1e9, 2), peak_mem_gb=None, gpu=gpu, torch=torch.__version__,
                   commit=commit, date=date)
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


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
        for mine, theirs in (("mok_nn", "torch_baseline"), ("mok_nn_torch", "torch_baseline"),
                             ("mok_nn_torch", "hf_default"), ("mok_nn_torch_layer", "hf_default_layer")):
            if mine in d and theirs in d:
                m, b = d[mine], d[theirs]
                lines.append(f"{shape}: {mine} vs {theirs}: ratio fwd {b['fwd_ms'] / m['fwd_ms']:.2f}x, "
                             f"bwd {b['bwd_ms'] / m['bwd_ms']:.2f}x")
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
    ap.add_argument("--backend", choices=("cuda", "reference", "torch"), default=None,
                    help="mok_nn's path: default the fused kernels on CUDA, the reference on CPU; 'torch' records "
                         "the portable backend beside the fused path, the baseline and transformers' default")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of the problem")
    ap.add_argument("--mxfp8", action="store_true", help="with --backend torch: also precision='mxfp8'")
    ap.add_argument("--layer", action="store_true", help="with --backend torch: also the whole block")
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
                  commit=args.commit, backend=args.backend, dtype=args.dtype, mxfp8=args.mxfp8, layer=args.layer)
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
