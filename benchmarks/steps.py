"""Helpers shared by the scripts in benchmarks/: the benchmark's layer steps, CUDA-event and host timers,
the torchrun process group."""

import os
import statistics
import time

import torch


def median_ms(fn, reps):
    """Median ms of fn() over reps calls, each between two CUDA events and synchronised, after one warm-up."""
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


def host_ms_busy(fn, reps):
    """Host ms per fn() call while the GPU is busy (a long torch.cuda._sleep first), so the launches only
    queue: the host's own issue time, not a wait for the GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about 1 s of GPU time
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return dt


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


def bench_steps(shape, tokens, group=None, ep_size=1, ep_rank=0, baseline=False, backend="cuda", precision="bf16",
                weights="trained"):
    """[("forward", fwd), ("forward+backward", fwd_bwd)]: mok_nn's routed experts (baseline: the torch
    baseline's, EP = 1) on the problem of mok_nn.bench (this rank's part at EP = ep_size), as the benchmark
    times them (gradients reset first); weights: bench.mok_experts' (trained, frozen, mxfp8_only)."""
    from mok_nn import bench

    p = bench.make_problem(shape, tokens, "cuda", ep_size=ep_size, ep_rank=ep_rank)
    fn = bench.baseline_experts if baseline else bench.mok_experts(backend, group, precision=precision, weights=weights)
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


def layer_steps(shape, tokens, backend="cuda", precision="bf16"):
    """[("forward", fwd), ("forward+backward", fwd_bwd)]: mok_nn's whole layer (MoKMoELayer: router, top-k, weights,
    routed experts) on the problem of mok_nn.bench, as its --layer mode times it."""
    from mok_nn import bench

    p = bench.make_problem(shape, tokens, "cuda")
    fn = bench.mok_layer(shape, backend, p["x"].dtype, precision)
    x = p["x"].detach().clone().requires_grad_(True)
    leaves = [x, p["router"].to(x.dtype).requires_grad_(True), p["gate_up_proj"].detach().requires_grad_(True),
              p["down_proj"].detach().requires_grad_(True)]

    def fwd():
        with torch.no_grad():
            fn(*leaves)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(p["dy"])

    return [("forward", fwd), ("forward+backward", fwd_bwd)]


def ep_steps(shape, tokens):
    """Under torchrun: an NCCL process group, and (rank, world, bench_steps at EP = world size)."""
    group, rank, world = torchrun_group()
    return rank, world, bench_steps(shape, tokens, group, world, rank)


def ep_steps_from_args(description: str):
    """The EP profilers' command line (--shape, --tokens) and their ep_steps: (shape, tokens, rank, world, steps)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    return (args.shape, args.tokens, *ep_steps(args.shape, args.tokens))
