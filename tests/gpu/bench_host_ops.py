"""Diagnostic (not a test): host cost of the small operations on the path before the first kernel launch.

    python tests/gpu/bench_host_ops.py

Each operation runs many times with the GPU busy (torch.cuda._sleep), so the figures are the host's own
time per operation (median of batches, us)."""
import time

import torch

from layer_runs import host_us_per_call  # the script's folder is on sys.path

dev = torch.device("cuda")
buf64 = torch.empty(1 << 20, dtype=torch.int64, device=dev)
buf32 = torch.empty(1 << 20, dtype=torch.int32, device=dev)
big = torch.empty(1 << 16, 2048, dtype=torch.bfloat16, device=dev)
pinned = torch.zeros(5, dtype=torch.int64, pin_memory=True)
host_np = pinned.numpy()
ids = torch.randint(0, 128, (8192, 8), device=dev)


ops = {
    "torch.empty(65536, i64, cuda)": lambda: torch.empty(65536, dtype=torch.int64, device=dev),
    "torch.empty(128, i32, cuda)": lambda: torch.empty(128, dtype=torch.int32, device=dev),
    "torch.empty(73728 x 2048 bf16, cuda)": lambda: torch.empty(73728, 2048, dtype=torch.bfloat16, device=dev),
    "slice buf64[a:b]": lambda: buf64[1000:66536],
    "buf64.narrow(0, a, n)": lambda: buf64.narrow(0, 1000, 65536),
    "slice + view(T, k)": lambda: buf64[:65536].view(8192, 8),
    "ids.reshape(-1).contiguous()": lambda: ids.reshape(-1).contiguous(),
    "t.data_ptr()": lambda: buf64.data_ptr(),
    "torch.cuda.Event().record()": lambda: torch.cuda.Event().record(),
    "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
    "torch.device('cuda', 0)": lambda: torch.device("cuda", 0),
    "torch.is_autocast_enabled('cuda')": lambda: torch.is_autocast_enabled("cuda"),
    "numpy pinned host[4] != 1": lambda: host_np[4] != 1,
    "int(numpy) x4": lambda: [int(v) for v in host_np[:4]],
    "pinned torch.zeros(5)": lambda: torch.zeros(5, dtype=torch.int64, pin_memory=True),
    "pinned copy_ non_blocking": lambda: pinned[:4].copy_(buf64[:4], non_blocking=True),
}
torch.cuda.synchronize()
torch.cuda._sleep(2_000_000_000)
for name, fn in ops.items():
    print(f"{name:40s} {host_us_per_call(fn):7.2f} us", flush=True)
torch.cuda.synchronize()

# What cuda_ep._record_errors makes per EP step, and what freeing it costs once the step is done (check_errors
# used to free it at the start of the next call, before its first launch; _record_errors now does, after them)
flags = torch.zeros(4, dtype=torch.int32, device=dev)
one = torch.ones(1, dtype=torch.int32, device=dev)


def record():
    host = torch.zeros(5, dtype=torch.int32, pin_memory=True)
    host[:-1].copy_(flags, non_blocking=True)
    host[-1:].copy_(one, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host.numpy(), ev


print(f"{'record a step (pinned zeros, 2 copies, event)':40s} {host_us_per_call(record, calls=50):7.2f} us", flush=True)
steps = [record() for _ in range(2000)]
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(len(steps)):
    steps.pop()
print(f"{'free a finished step':40s} {(time.perf_counter() - t0) / 2000 * 1e6:7.2f} us", flush=True)
