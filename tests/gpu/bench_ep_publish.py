"""Diagnostic (not a test): step 1 of the EP forward, SymmBuffers.publish, as one mok_ep_publish launch
(MOK_EP_PUBLISH=kernel) against the torch ops it replaces (=torch).

    python tests/gpu/bench_ep_publish.py                       # one GPU: the peers' buffers are local memory (P=2)
    torchrun --nproc_per_node 2 tests/gpu/bench_ep_publish.py  # two GPUs: real NVLink peers
        [--tokens 8192] [--iters 50]

Per shape (qwen3 H=2048 k=8, mixtral H=4096 k=2, deepseek H=7168 k=8) and mode, `iters` calls issued
behind a GPU sleep (so no launch waits), median of 5 repeats: GPU time per call (CUDA events around
the calls, which run back to back) and host time per call (what the host spends issuing one). Before
timing, both modes' buffers (poisoned first) are compared bitwise. Prints a table; writes
bench_ep_publish.json / .txt to $OUT (default /tmp). Runtime: ~10-20 s.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("MOK_EP_TIMEOUT_S", "20")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mok_nn import cuda_ep  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 8), "mixtral-8x7b": (4096, 2), "deepseek-v3": (7168, 8)}


def _bufs(distributed, tc, H, K, dev):
    if distributed:
        return cuda_ep.SymmBuffers.create(dist.group.WORLD, tc, H, K, dev)
    _, nbytes = cuda_ep.buffer_layout(2, tc, H, K)
    return cuda_ep.SymmBuffers([torch.zeros(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)], 0, tc, H, K,
                               dev)


def _with_mode(mode, fn):
    os.environ["MOK_EP_PUBLISH"] = mode
    try:
        return fn()
    finally:
        del os.environ["MOK_EP_PUBLISH"]


def _sync(distributed):
    torch.cuda.synchronize()
    if distributed:
        dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    distributed = "RANK" in os.environ
    rank = 0
    if distributed:
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    records, lines, ok = [], [], True
    for shape, (H, K) in SHAPES.items():
        tc = args.tokens
        bufs = _bufs(distributed, tc, H, K, dev)
        g = torch.Generator(device=dev).manual_seed(7 + rank)
        x = torch.randn(tc, H, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 128, (tc, K), device=dev, generator=g)
        w = torch.rand(tc, K, device=dev, generator=g)
        P = bufs.ep_size

        def publish():
            bufs.publish(x, ids, w, tc)

        # bitwise: every rank's buffer after each mode (poisoned first); peers' writes land in mine
        got = {}
        for mode in ("torch", "kernel"):
            _sync(distributed)
            bufs.raw.fill_(0x7F)
            _sync(distributed)
            _with_mode(mode, publish)
            _sync(distributed)
            got[mode] = bufs.raw.clone()
        same = torch.equal(got["torch"], got["kernel"])
        if distributed:
            flag = torch.tensor([int(same)], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            same = bool(flag.item())
        ok &= same
        del got
        bufs.raw.zero_()  # the barrier pads must start at 0 again (only publish runs below: no barrier)
        _sync(distributed)
        for mode in ("kernel", "torch"):
            def run():
                gpu, host = [], []
                for _ in range(5):
                    _sync(distributed)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda._sleep(int(2e8))  # ~0.1 s: the host issues everything before the GPU reaches a
                    a.record()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        publish()
                    host.append((time.perf_counter() - t0) * 1e6 / args.iters)
                    b.record()
                    torch.cuda.synchronize()
                    gpu.append(a.elapsed_time(b) * 1e3 / args.iters)
                return statistics.median(gpu), statistics.median(host)

            _with_mode(mode, publish)  # warm-up (module load, argument checks)
            gpu_us, host_us = _with_mode(mode, run)
            rec = dict(shape=shape, ep=P, tokens=tc, hidden=H, top_k=K, mode=mode, gpu_us=round(gpu_us, 2),
                       host_us=round(host_us, 2), bitwise_eq=same)
            records.append(rec)
            line = (f"{shape:<15} P={P} T={tc} H={H} k={K} {mode:<6} gpu {gpu_us:8.2f} us/call  "
                    f"host {host_us:7.2f} us/call  bits={'eq' if same else 'DIFF'}")
            lines.append(line)
            if rank == 0:
                print(line, flush=True)
        _sync(distributed)  # no peer writes into this buffer any more
        del bufs, publish
    if rank == 0:
        out = os.environ.get("OUT", "/tmp")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_ep_publish.json"), "w") as f:
            json.dump(records, f, indent=1)
        with open(os.path.join(out, "bench_ep_publish.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if distributed:
        dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
