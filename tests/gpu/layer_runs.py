"""Shared by the GPU tests and timers: the error measure, an fp64 oracle of routed GEMM rows,
one forward+backward of a layer, and a CUDA-event timer."""

import importlib.util
import os
import pathlib
import statistics
import sys
import time

import torch

GRAD_NAMES = ("y", "dx", "dW13", "dW2", "dWr", "db13", "db2")


def rel_err(a, b):
    """||a - b|| / ||b|| in float64, in chunks along dim 0 (weight gradients can be large)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    num = den = 0.0
    for u, v in zip(a.reshape(a.shape[0], -1).split(16), b.reshape(b.shape[0], -1).split(16)):
        u, v = u.double(), v.double()
        num += (u - v).pow(2).sum().item()
        den += v.pow(2).sum().item()
    return (num / max(den, 1e-300)) ** 0.5


def run_layer(layer, x, dy):
    """[y, dx, d gate_up_proj, d down_proj, d router.weight (, d biases)] of one forward+backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    e = layer.experts
    out = [y.detach(), x.grad, e.gate_up_proj.grad, e.down_proj.grad, layer.router.weight.grad]
    if e.gate_up_proj_bias is not None:
        out += [e.gate_up_proj_bias.grad, e.down_proj_bias.grad]
    return out


def slot_products(x, ids, W, transpose_w):
    """fp64 [T*k, N]: row (t, j) = x[t] @ W[e] (transpose_w) or x[t] @ W[e]^T, e = ids[t, j], expert by expert."""
    flat = ids.reshape(-1)
    xs = x.double().repeat_interleave(ids.shape[1], 0)
    out = torch.empty(flat.numel(), W.shape[2] if transpose_w else W.shape[1], dtype=torch.float64, device=x.device)
    for e in flat.unique().tolist():
        sel = flat == e
        We = W[e].double()
        out[sel] = xs[sel] @ (We if transpose_w else We.T)
    return out


def median_ms(fn, reps):
    """Median ms of fn() over reps calls, each between two CUDA events (host in the loop), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def median_ms_queued(fn, reps, warmup=3):
    """Median ms of fn() over reps calls queued back to back, each between two CUDA events
    (one synchronize at the end: the host stays ahead, so launch latency is hidden)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def host_ms_busy(fn, reps):
    """Host ms per fn() call while the GPU is busy (a long torch.cuda._sleep first), so the launches only
    queue: the host's own issue time, not a wait for the GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return dt


def host_us_per_call(fn, calls=200, batches=7):
    """Median over `batches` of the host time per call of fn (us), each batch `calls` calls in a row; for host-only
    costs (keep the GPU busy, torch.cuda._sleep, where fn launches work)."""
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def load_cpu_test(name):
    """A module of tests/ (the CPU tests) by file name, e.g. an oracle kept there; the CPU test modules
    import each other by name, so tests/ goes on sys.path."""
    tests = pathlib.Path(__file__).resolve().parents[1]
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    spec = importlib.util.spec_from_file_location(name, tests / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def torchrun_group():
    """(group, rank, world): under torchrun (RANK set) an NCCL process group over every rank, each on its
    LOCAL_RANK's GPU; else (None, 0, 1)."""
    if "RANK" not in os.environ:
        return None, 0, 1
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return dist.group.WORLD, rank, dist.get_world_size()


def bench_steps(shape, tokens, group=None, ep_size=1, ep_rank=0, baseline=False):
    """[("forward", fwd), ("forward+backward", fwd_bwd)]: mok_nn's routed experts (baseline: the torch
    baseline's, EP = 1) on the problem of mok_nn.bench (this rank's part at EP = ep_size), as the benchmark
    times them (gradients reset first)."""
    from mok_nn import bench

    p = bench.make_problem(shape, tokens, "cuda", ep_size=ep_size, ep_rank=ep_rank)
    fn = bench.baseline_experts if baseline else bench.mok_experts("cuda", group)
    leaves = bench._leaves(p)
    x, w, gu, dn = leaves

    def fwd():
        with torch.no_grad():
            fn(x, p["ids"], w, gu, dn)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        y = fn(x, p["ids"], w, gu, dn)
        y.backward(p["dy"])

    return [("forward", fwd), ("forward+backward", fwd_bwd)]


def ep_steps(shape, tokens):
    """Under torchrun: NCCL process group, and (rank, world, bench_steps at EP = world size)."""
    group, rank, world = torchrun_group()
    return rank, world, bench_steps(shape, tokens, group, world, rank)
