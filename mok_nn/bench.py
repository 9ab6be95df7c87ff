"""Benchmark of the routed experts: mok_nn vs a torchtitan-style torch baseline (BENCHMARKS.md).

    python -m mok_nn.bench [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3] [--tokens 8192]
                           [--device cuda|cpu] [--iters 20] [--out docs/benchmarks/NAME.json]
                           [--backend torch [--dtype bf16|fp32]] [--precision mxfp8] [--layer]
                           [--peers sonicmoe,liger,hf [--peers-only] [--peer-site DIR] [--peer-timeout S]]
    torchrun --nproc_per_node 2 -m mok_nn.bench ...     expert parallelism over the ranks (EP = world size)

--backend torch adds the portable backend ("mok_nn_torch") beside the fused path (on CUDA) and the
baseline, and, where transformers is installed, transformers' own experts module with its default
experts implementation ("hf_default", grouped_mm) on the same weights and the same routing (the
routing is passed in: its forward takes the top-k ids and weights). --dtype fp32 runs the problem in
fp32 ("precision" records the dtype); --precision mxfp8 adds mok_nn with precision="mxfp8" on its path
(fused on CUDA, portable with --backend torch; "precision": "mxfp8" in the record): trained weights
("*_mxfp8": their MXFP8 values computed anew every call, as in training), and frozen weights side by side,
MXFP8-only ("*_mxfp8_frozen") and bf16 ("*_frozen"), whose backward is d x and d topk-weights only;
--layer adds the whole block (router, top-k, experts), each implementation with its own router, on
make_problem's weights and router ("*_layer" records): mok_nn's MoKMoELayer (the fused path on CUDA; with
--backend torch also the portable backend's, and transformers' Qwen3MoeSparseMoeBlock), and each peer's; the
summary then states the share of mok_nn's layer forward that lies outside its routed experts (the protocol's
whole-layer target).
--peers runs each peer (SonicMoE, Liger, transformers' default experts "hf") in its own process
(mok_nn/bench_peers.py: their CuTe DSL versions differ from mok_nn's) on the same problem, checked
against a float32 reference (output and every gradient) before timing; a peer that is not importable,
fails the check or crashes gets a record with "skipped" and null times. Records also hold act_mem_gb (the
memory the forward keeps for the backward, CUDA) and, at EP=1, "check": each implementation's errors
against the float32 reference.

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


WEIGHT_MODES = ("trained", "frozen", "mxfp8_only")


def mok_experts(backend: str, group=None, config=None, precision="bf16", weights="trained"):
    """mok_nn's routed experts through its functional layer and MoKFunction (what the layer runs);
    config: a MoKConfig (None: the default). weights: "trained" (they get gradients; with precision="mxfp8"
    their MXFP8 values are computed anew every call, as after an optimizer step, so the time includes that),
    "frozen" (no weight gradients: those GEMMs do not run), "mxfp8_only" (frozen and held as MXFP8 data and
    scales, quantised once per weight tensor outside the timing: MoKMoELayer(mxfp8_experts=True))."""
    from . import functional, mxfp8
    from .autograd import MoKFunction
    from .distributed import group_size_and_rank

    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    world = group_size_and_rank(group)[0]
    held = {}  # mxfp8_only: (weight tensors, their MXFP8 tensors) of the last call

    def run(x, topk_ids, topk_weights, gate_up_proj, down_proj):
        ws = functional.get_workspace(
            hidden_size=x.shape[1], intermediate_size=down_proj.shape[2], num_experts=gate_up_proj.shape[0] * world,
            top_k=topk_ids.shape[1], device=x.device, dtype=x.dtype, backend=backend, ep_group=group, config=config,
            precision=precision,
        )  # fmt: skip
        scales = ()
        if weights == "mxfp8_only":
            if held.get("of", (None, None))[0] is not gate_up_proj or held["of"][1] is not down_proj:
                held.clear()  # the old copies go first
                held.update(of=(gate_up_proj, down_proj),
                            q=[mxfp8.quantize_experts(t.detach()) for t in (gate_up_proj, down_proj)])
            q13, q2 = held["q"]
            gate_up_proj, down_proj, scales = q13.data, q2.data, (q13.scale, q2.scale)
        elif weights == "frozen":
            gate_up_proj, down_proj = gate_up_proj.detach(), down_proj.detach()
        elif precision == "mxfp8":
            mxfp8.clear_weight_cache()
        return MoKFunction.apply(x, topk_weights, gate_up_proj, down_proj, None, None, topk_ids, ws, *scales)

    return run


# --------------------------------------------------------------------------
# transformers' default experts / block (the "hf" peer, bench_peers.HfPeer) and mok_nn's whole layer


def hf_experts(shape: str, device, dtype):
    """transformers' Qwen3MoeExperts (default experts implementation, grouped_mm) on the benchmark's weights and
    routing: bench_peers.HfPeer, the same code `--peers hf` runs in its own process."""
    from .bench_peers import HfPeer

    return HfPeer(shape, device, dtype).experts


def _hf_available() -> bool:
    try:
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
    except Exception:
        return False
    return True


def bind_params(module, params: dict):
    """module with each tensor of params {dotted name: tensor} in place of that parameter, uncopied: what
    torch.func.functional_call does for one call, without its per-call bookkeeping (host time inside the timed
    region that a layer whose parameters are in place does not spend; the peers' own layers take theirs as
    arguments)."""
    for name, t in params.items():
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner)._parameters[attr] = t
    return module


def mok_layer(shape: str, backend: str, dtype, precision: str = "bf16"):
    """mok_nn's whole block, MoKMoELayer (router, top-k(softmax) renormalised, routed experts), built on the meta
    device: the benchmark's leaves (x, router weight, gate_up, down) are put in place of its parameters
    (bind_params) on every call."""
    from .layer import MoKMoELayer

    hidden, inter, num_experts, top_k = SHAPES[shape]
    with torch.device("meta"):
        module = MoKMoELayer(hidden, inter, num_experts, top_k, norm_topk_prob=True, backend=backend, dtype=dtype,
                             precision=precision)

    def run(x, router_w, gate_up_proj, down_proj, top_k=None):  # top_k: the layer's own (the peers' signature)
        params = {"router.weight": router_w, "experts.gate_up_proj": gate_up_proj, "experts.down_proj": down_proj}
        return bind_params(module, params)(x)

    return run


# --------------------------------------------------------------------------
# harness


def make_problem(shape: str, tokens: int, device: str, seed: int = 0, ep_size: int = 1, ep_rank: int = 0,
                 dtype=torch.bfloat16):
    """x, top-k ids and renormalised softmax weights from a random fp32 router (kept as "router", for the
    whole-layer rows), gate_up_proj, down_proj, dy. The same arguments give the same tensors in any process
    on the same device (the peers' processes build their problem with this function). With ep_size > 1:
    this rank's tokens and its E/ep_size experts; the router is shared."""
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
    return dict(x=x, ids=ids, w=w, gate_up_proj=gate_up_proj, down_proj=down_proj, dy=dy, router=router)


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
    return dict(x=x, ids=ids, w=w, gate_up_proj=gate_up_proj, down_proj=down_proj, dy=dy, router=router)


def _leaves(p):
    """Fresh leaves: copies of x and w; the weights on p's own storage (no second copy: 45 GB at deepseek-v3 fp32)."""
    return [p["x"].detach().clone().requires_grad_(True), p["w"].detach().clone().requires_grad_(True),
            p["gate_up_proj"].detach().requires_grad_(True), p["down_proj"].detach().requires_grad_(True)]


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
    activation GB kept for bwd)} for every implementation in impls {name: fn(x, ids, w, gate_up, down)}.

    The implementations share the same leaf tensors (measure_calls). With a process group, times and peak
    are the slowest rank's.
    """
    leaves = _leaves(p)
    x, w, gu, dn = leaves
    ids = p["ids"]
    calls = {name: (lambda fn=fn: fn(x, ids, w, gu, dn)) for name, fn in impls.items()}
    out = {}
    for name, (f_ms, fb_ms, peak, act) in measure_calls(calls, leaves, p["dy"], device, iters, warmup).items():
        if group is not None:  # an iteration takes as long as its slowest rank
            import torch.distributed as dist

            t = torch.tensor([f_ms, fb_ms, peak or 0.0], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            f_ms, fb_ms, peak = t.tolist()
        out[name] = (f_ms, fb_ms - f_ms, peak, act)
    return out


def warm_up(call, leaves, dy, n):
    """n forward+backward passes of call() (compilation, autotuning, allocation stay out of the timing)."""
    for _ in range(n):
        for t in leaves:
            t.grad = None
        call().backward(dy)
    for t in leaves:
        t.grad = None


def measure_calls(calls, leaves, dy, device, iters, warmup):
    """{name: (median fwd ms, median fwd+bwd ms, peak GB above inputs+params, activation GB kept for bwd)} of
    calls {name: call() -> y} whose inputs and parameters are the tensors `leaves`, y.backward(dy).

    Each call is warmed up (`warmup` forward+backward passes), then, on CUDA, its memory is read: what the
    forward keeps alive for the backward (with y) and the peak of one forward+backward, both above what was
    allocated before (inputs, parameters). The timed iterations rotate the calls (A B, B A, ... for two;
    A B C, B C A, C A B, ... for three), so clock and temperature drift over the run affects all alike
    instead of favouring whichever runs first or second. Gradients are reset to None before every
    iteration, as optimizer.zero_grad() does in training, so no call pays for accumulating into old grads.
    One call (a peer in its own process) is the same measurement without the rotation.
    """

    def zero():
        for t in leaves:
            t.grad = None

    def fwd(call):
        with torch.no_grad():
            call()

    def fwd_bwd(call):
        zero()
        call().backward(dy)

    timer = _timer(device)
    mem = {}
    for name, call in calls.items():
        warm_up(call, leaves, dy, warmup)
        act = peak = None
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            y = call()  # what the forward keeps alive for backward (+ y itself)
            act = (torch.cuda.memory_allocated() - base) / 2**30
            del y
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fwd_bwd(call)  # every iteration allocates alike: one shows the peak
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            zero()
        mem[name] = (peak, act)
    f = {name: [] for name in calls}
    fb = {name: [] for name in calls}
    order = list(calls.items())
    for step, times in ((fwd, f), (fwd_bwd, fb)):
        for i in range(iters):
            # Rotated order: A B C, B C A, C A B, ... (two: A B, B A, ...): every implementation takes
            # every position equally often (the mirrored A B C, C B A ran the first and the last twice
            # in a row). Even so, one configuration listed twice differs by up to ~4% in the backward
            # at deepseek-v3 and mixtral: compare layer variants with that in mind.
            k = i % len(order)
            for name, call in order[k:] + order[:k]:
                times[name].append(timer(lambda: step(call)))
    zero()
    return {name: (statistics.median(f[name]), statistics.median(fb[name])) + mem[name] for name in calls}


def timing_fields(flops, fwd_ms, bwd_ms, peak, act):
    """The timing fields of a record (TFLOP/s from the routed experts' FLOPs: forward flops, backward 2x)."""
    return dict(fwd_ms=round(fwd_ms, 4), bwd_ms=round(bwd_ms, 4), fwd_tflops=round(flops / fwd_ms / 1e9, 2),
                bwd_tflops=round(2 * flops / bwd_ms / 1e9, 2) if bwd_ms > 0 else None,
                peak_mem_gb=None if peak is None else round(peak, 3), act_mem_gb=None if act is None else round(act, 3))


def check_agreement(a, b, p):
    """Relative L2 errors of the forward output and the gradients (those both give) of implementation a against
    b on the same problem."""
    outs = []
    for fn in (a, b):
        x, w, gu, dn = _leaves(p)
        y = fn(x, p["ids"], w, gu, dn)
        y.backward(p["dy"])
        out = (y.detach(), x.grad, w.grad, gu.grad, dn.grad)
        if not outs:
            out = _spill_if_large(out)
        outs.append(out)
        del x, w, gu, dn, y, out
    errs = {}
    for name, u, v in zip(("y", "dx", "dw", "d_gate_up", "d_down"), *outs):
        if u is not None and v is not None:  # (frozen weights have no gradient)
            errs[name] = rel_l2(u, v)
    return errs


def _spill_if_large(tensors):
    """The tensors, those on a GPU moved to host memory where together they take more than a third of the GPU's
    free memory: the first implementation's weight gradients, while the second computes its own (deepseek-v3
    in fp32: 45 GB each)."""
    cuda = [t for t in tensors if t is not None and t.is_cuda]
    if not cuda or sum(t.numel() * t.element_size() for t in cuda) < torch.cuda.mem_get_info()[0] / 3:
        return tensors
    return tuple(None if t is None else t.cpu() for t in tensors)


def rel_l2(u, v):
    """||u - v|| / ||v||, fp32, in chunks (weight gradients are large); u may lie in host memory."""
    num = den = 0.0
    for a, b in zip(u.reshape(u.shape[0], -1).split(8), v.reshape(v.shape[0], -1).split(8)):
        a, b = a.to(b.device).float(), b.float()
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


def _impls(device, backend, group, ep, shape, dtype, precision="bf16"):
    """{impl: fn}: mok_nn's fused path (CUDA) or reference path, or with backend "torch" the portable backend
    beside the fused path (on CUDA, bf16), the baseline and transformers' default experts. precision "mxfp8"
    adds mok_nn's MXFP8 rows: trained weights ("_mxfp8"), and frozen ones beside frozen bf16 weights
    ("_mxfp8_frozen": MXFP8-only weights; "_frozen": bf16), on the path of the first row."""
    baseline = baseline_experts if ep == 1 else baseline_experts_ep(group)
    impls = {}
    if backend != "torch":
        impls["mok_nn"] = mok_experts(backend, group)
        mine = backend
    else:
        if device == "cuda" and dtype == torch.bfloat16:
            impls["mok_nn"] = mok_experts("cuda", group)
        impls["mok_nn_torch"] = mok_experts("torch", group)
        mine = "torch"
    if precision == "mxfp8" and (ep == 1 or mine == "torch"):  # (the fused path's MXFP8 is one-GPU for now)
        name = "mok_nn_torch" if mine == "torch" else "mok_nn"
        impls[f"{name}_mxfp8"] = mok_experts(mine, group, precision="mxfp8")
        if ep == 1:  # (MXFP8-only weights are local experts)
            impls[f"{name}_frozen"] = mok_experts(mine, group, weights="frozen")
            impls[f"{name}_mxfp8_frozen"] = mok_experts(mine, group, precision="mxfp8", weights="mxfp8_only")
    impls["torch_baseline"] = baseline
    if backend == "torch" and ep == 1 and _hf_available():
        impls["hf_default"] = hf_experts(shape, device, dtype)
    return impls


def run(shapes, tokens, device, iters, warmup, check=True, group=None, commit=None, backend=None, dtype="bf16",
        precision="bf16", layer=False, peers=(), peers_only=False, peer_site=None, peer_timeout=600, check_tokens=1024,
        peer_budget=None):
    from .distributed import group_size_and_rank

    ep, rank = group_size_and_rank(group)
    if backend is None:
        backend = "cuda" if device == "cuda" else "reference"
    dt = DTYPES[dtype]
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = commit or _commit()
    peer_records = _peer_records(peers, peers_only, shapes, tokens, device, dtype, iters, warmup, layer, commit,
                                 peer_site, peer_timeout, check_tokens, backend, ep, rank, check, peer_budget)
    records = []
    for shape in [] if peers_only else shapes:
        hidden, inter, _, top_k = SHAPES[shape]
        impls = _impls(device, backend, group, ep, shape, dt, precision)
        p = make_problem(shape, tokens, device, ep_size=ep, ep_rank=rank, dtype=dt)
        ref_errs = {}
        if check:
            first = next(iter(impls))
            for other in impls:
                if other == first:
                    continue
                errs = check_agreement(impls[other], impls[first], p)
                print(f"{shape} (rank {rank}): {other} vs {first} rel L2 "
                      + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
                limit = 0.1 if "mxfp8" in other else 2e-2  # MXFP8: ~3 mantissa bits per operand
                bad = {k: v for k, v in errs.items() if not v < limit}
                if bad:
                    raise RuntimeError(f"{shape}: implementations disagree: {other} vs {first}: {bad}")
            if ep == 1 and check_tokens:  # the fp32 reference the peers are checked against (bench_peers)
                ref_errs = _reference_errors(impls, p, shape, tokens, check_tokens)
        flops = 6 * tokens * top_k * hidden * inter
        measured = measure(impls, p, device, iters, warmup, group)
        for impl, (fwd_ms, bwd_ms, peak, act) in measured.items():
            if act is not None and rank == 0:
                print(f"{shape} {impl}: activation memory kept for backward {act:.3f} GB (rank 0)", flush=True)
            rec = dict(shape=shape, ep=ep, tokens_per_rank=tokens, impl=impl,
                       precision="mxfp8" if "mxfp8" in impl else dtype,
                       **timing_fields(flops, fwd_ms, bwd_ms, peak, act), gpu=gpu, torch=torch.__version__,
                       commit=commit, date=date)
            if impl in ref_errs:
                rec["check"] = ref_errs[impl]
            records.append(rec)
            if rank == 0:
                print(json.dumps(rec), flush=True)
        del p
        if layer and ep == 1:
            records += _layer_records(shape, tokens, device, dt, dtype, iters, warmup, flops, gpu, commit, date,
                                      impls, backend, check_tokens if check else 0)
        if device == "cuda":
            torch.cuda.empty_cache()
    return records + peer_records


def _peer_records(peers, peers_only, shapes, tokens, device, dtype, iters, warmup, layer, commit, site, timeout,
                  check_tokens, backend, ep, rank, check, budget=None):
    """The peers, each in its own process (bench_peers.run_subprocesses), before this process touches the GPU;
    "hf" runs in this process instead where --backend torch already has it (hf_default), not twice."""
    if not peers:
        return []
    if ep > 1:
        if rank == 0:
            print(f"skip peers {','.join(peers)}: they run at EP=1 only (this run has EP={ep})", flush=True)
        return []
    from . import bench_peers

    for spec in peers:
        bench_peers.resolve(spec)  # an unknown name fails here, before any measurement
    todo = list(peers)
    if backend == "torch" and not peers_only and "hf" in todo and _hf_available():
        print("peer hf: measured in this process beside mok_nn (hf_default, --backend torch), not again in its own",
              flush=True)
        todo.remove("hf")
    return bench_peers.run_subprocesses(todo, shapes, tokens, device, dtype, iters, warmup,
                                        check_tokens if check else 0, layer, commit, site, timeout, budget=budget)


def _reference_errors(impls, p, shape, tokens, check_tokens):
    """{impl: relative L2 errors of y and every gradient} against the float32 reference the peers are checked
    against, on a check problem of min(check_tokens, tokens) tokens with the same weights."""
    from .bench_peers import check_experts, check_problem

    cp = check_problem(p, min(check_tokens, tokens))
    out = {}
    for impl, fn in impls.items():
        gu = cp["gate_up_proj"].detach().requires_grad_(True)  # new leaves on the same storage: no copies
        dn = cp["down_proj"].detach().requires_grad_(True)
        errs = check_experts(fn, cp, gu, dn)
        print(f"{shape} {impl}: rel L2 vs the fp32 reference (T={cp['x'].shape[0]}) "
              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
        out[impl] = {k: float(f"{v:.3e}") for k, v in errs.items()}
        del gu, dn
    return out


def _layer_records(shape, tokens, device, dt, dtype, iters, warmup, flops, gpu, commit, date, impls, backend,
                   check_tokens):
    """The whole block (router, top-k, experts) of the in-process implementations: mok_nn's layer (the path of
    "mok_nn"; "mok_nn_torch": the portable backend) and transformers' Qwen3MoeSparseMoeBlock ("hf_default",
    bench_peers.HfPeer), each with its own router, on make_problem's weights and router; each forward checked
    against the float32 reference layer first (transformers' under the routing its bf16 router picked), then timed
    side by side (measure_calls). FLOPs: the routed experts' (the TFLOP/s compare with the experts rows)."""
    from .bench_peers import LAYER_CHECK_TOL, HfPeer, check_problem, reference_layer_check

    layers, routings = {}, {}  # routings: how a layer's own router routes (the check's); mok_nn's is the fp32 one
    if "mok_nn" in impls:
        layers["mok_nn_layer"] = mok_layer(shape, "cuda" if backend == "torch" else backend, dt)
    if "mok_nn_torch" in impls:
        layers["mok_nn_torch_layer"] = mok_layer(shape, "torch", dt)
    if "hf_default" in impls:
        hf = HfPeer(shape, device, dt)
        layers["hf_default_layer"], routings["hf_default_layer"] = hf.layer, hf.routing
    p = make_problem(shape, tokens, device, dtype=dt)
    top_k = p["ids"].shape[1]
    x = p["x"].detach().clone().requires_grad_(True)
    rw = p["router"].to(dt, copy=True).requires_grad_(True)
    gu = p["gate_up_proj"].detach().requires_grad_(True)  # new leaves on p's storage (22.5 GB at deepseek-v3)
    dn = p["down_proj"].detach().requires_grad_(True)
    calls = {name: (lambda fn=fn: fn(x, rw, gu, dn, top_k)) for name, fn in layers.items()}
    checks = {}
    if check_tokens:
        cp = check_problem(p, min(check_tokens, tokens))
        rw_c = p["router"].to(dt)
        for name, fn in layers.items():
            with torch.no_grad():
                y = fn(cp["x"], rw_c, cp["gate_up_proj"], cp["down_proj"], top_k)
                routing = routings[name](cp["x"], rw_c, top_k) if name in routings else None
            errs, rerouted = reference_layer_check(cp, y, rw_c, routing)
            print(f"{shape}: whole layer {name} rel L2 vs the fp32 reference layer y {errs['y']:.1e}"
                  + (f" (under its own routing: {rerouted:.2%} of the tokens routed otherwise than by the fp32 "
                     "router)" if routing is not None else ""), flush=True)
            if not errs["y"] < LAYER_CHECK_TOL:
                raise RuntimeError(f"{shape}: whole layer {name} disagrees with the fp32 reference: {errs}")
            checks[name] = {k: float(f"{v:.3e}") for k, v in errs.items()}
        del cp
    out = []
    measured = measure_calls(calls, [x, rw, gu, dn], p["dy"], device, iters, warmup)
    for impl, (fwd_ms, fb_ms, peak, act) in measured.items():
        rec = dict(shape=shape, ep=1, tokens_per_rank=tokens, impl=impl, precision=dtype,
                   **timing_fields(flops, fwd_ms, fb_ms - fwd_ms, peak, act), gpu=gpu, torch=torch.__version__,
                   commit=commit, date=date)
        if impl in checks:
            rec["check"] = checks[impl]
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


def _num(v):
    return float("nan") if v is None else v


def summary(records):
    lines = [f"{'shape':<16} {'impl':<20} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9} {'peak GB':>8} "
             f"{'act GB':>7}"]
    by = {}
    for r in records:
        if r.get("skipped"):
            lines.append(f"{r['shape']:<16} {r['impl']:<20} skipped: {r['skipped'][:200]}")
            continue
        by.setdefault(r["shape"], {})[r["impl"]] = r
        lines.append(
            f"{r['shape']:<16} {r['impl']:<20} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} "
            f"{r['fwd_tflops']:9.1f} {_num(r['bwd_tflops']):9.1f} {_num(r['peak_mem_gb']):8.2f} "
            f"{_num(r.get('act_mem_gb')):7.2f}"
        )
    pairs = [("mok_nn", "torch_baseline"), ("mok_nn_torch", "torch_baseline"), ("mok_nn_torch", "hf_default"),
             ("mok_nn_torch_layer", "hf_default_layer")]
    for mine in ("mok_nn", "mok_nn_torch"):  # MXFP8 against bf16 on the same path: "ratio" = speed of bf16's
        pairs += [(f"{mine}_mxfp8", mine), (f"{mine}_mxfp8_frozen", f"{mine}_frozen"),
                  (f"{mine}_mxfp8", "torch_baseline")]
    for shape, d in by.items():
        for theirs in d:  # mok_nn against every peer, routed experts and whole layer
            base = theirs[:-len("_layer")] if theirs.endswith("_layer") else theirs
            if not base.startswith("mok_nn") and base != "torch_baseline":
                pairs.append(("mok_nn_layer" if theirs.endswith("_layer") else "mok_nn", theirs))
        for mine, theirs in dict.fromkeys(pairs):
            if mine in d and theirs in d:
                m, b = d[mine], d[theirs]
                bwd = f"{b['bwd_ms'] / m['bwd_ms']:.2f}x" if m["bwd_ms"] > 0 and b["bwd_ms"] > 0 else "n/a"
                lines.append(f"{shape}: {mine} vs {theirs}: ratio fwd {b['fwd_ms'] / m['fwd_ms']:.2f}x, bwd {bwd}")
        for experts in ("mok_nn", "mok_nn_torch"):  # the protocol's whole-layer target: at most 10% at qwen3
            layer = d.get(f"{experts}_layer")
            if experts in d and layer is not None and layer["fwd_ms"] > 0:
                outside = (layer["fwd_ms"] - d[experts]["fwd_ms"]) / layer["fwd_ms"]
                lines.append(f"{shape}: {experts}_layer: {100 * outside:.1f}% of its forward outside the routed experts")
    return "\n".join(lines)


def main(argv=None):
    # Set before the first CUDA allocation, which reads it (the peers' processes inherit it): without expandable
    # segments deepseek-v3 ran out of memory on an 80 GB H100 after the smaller shapes in one process, with tens
    # of GB reserved by the allocator in pieces too small for its tensors.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ap = argparse.ArgumentParser(description="mok_nn vs torch baseline and peers, routed experts and whole layer "
                                             "(EP = torchrun world size)")
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
    ap.add_argument("--precision", choices=("bf16", "mxfp8"), default="bf16",
                    help="mxfp8: also mok_nn with precision='mxfp8' on its path (trained weights, re-quantised every "
                         "call), and frozen weights: MXFP8-only beside bf16 (no weight gradients)")
    ap.add_argument("--layer", action="store_true",
                    help="also the whole block (router, top-k, experts) of every implementation, each with its own "
                         "router: mok_nn's layer (and the portable backend's, hf's with --backend torch), the peers'")
    ap.add_argument("--peers", default="",
                    help="comma-separated peers, each timed in its own process on the same problem after a check "
                         "against the fp32 reference: sonicmoe, liger, hf (transformers' default experts), or "
                         "package.module:Class (mok_nn/bench_peers.py); one not importable is skipped, with a line "
                         "and a record saying why")
    ap.add_argument("--peers-only", action="store_true", help="only the peers' records (not mok_nn's, the baseline's)")
    ap.add_argument("--peer-site", default=None,
                    help="the peers' install dir (pip --target .../site-packages; default /tmp/site/site-packages "
                         "where it exists), put on the path of the peers' processes only")
    ap.add_argument("--peer-timeout", type=int, default=600,
                    help="seconds per peer process (QuACK and Liger autotune each new shape: minutes); the shapes "
                         "done by then are kept; default %(default)s")
    ap.add_argument("--peer-budget", type=int, default=None,
                    help="seconds for all the peers' processes together (each gets at most what is left): keeps a "
                         "run inside a time limit, with mok_nn's rows measured after the peers")
    ap.add_argument("--check-tokens", type=int, default=1024,
                    help="tokens of the fp32-reference check of the peers and the whole layers (0: none)")
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
    peers = [q for q in args.peers.split(",") if q]
    if args.peers_only and not peers:
        ap.error("--peers-only needs --peers")
    records = run(shapes, args.tokens, args.device, args.iters, args.warmup, check=not args.no_check, group=group,
                  commit=args.commit, backend=args.backend, dtype=args.dtype, precision=args.precision,
                  layer=args.layer,
                  peers=peers, peers_only=args.peers_only, peer_site=args.peer_site, peer_timeout=args.peer_timeout,
                  check_tokens=args.check_tokens, peer_budget=args.peer_budget)
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
