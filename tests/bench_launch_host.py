"""Host time of one kernel launch's argument marshalling: packed (launch) vs ctypes (launch_ctypes).

    python tests/bench_launch_host.py        # writes launch_host.json / .txt to $OUT (default /tmp)

The launch function is a no-op stand-in (no kernel runs, no library needed), so the figures are the
Python side only; a real launch adds the ctypes call and cudaLaunchKernel. Without CUDA the tensors
are fake objects (what launch reads of a tensor, methods in Python: a little slower than torch's);
with CUDA they are CUDA tensors, and cuda_backend._stream() / _lib() are timed too.
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mok_nn.kernels import loader, registry  # noqa: E402
from test_loader_launch import DTYPES, FakeTensor  # noqa: E402

KERNELS = ("mok_gemm_bk_ef", "mok_ep_copy_rows", "mok_combine")
CUDA = torch.cuda.is_available()


def make_args(spec):
    out = []
    for a in spec.args:
        if isinstance(a, registry.ScalarArg):
            out.append(3 if a.dtype == "i32" else 1.5)
            continue
        div = a.divisibility or (1,) * len(a.shape)
        shape = [256 * div[i] if s == registry.DYN else s for i, s in enumerate(a.shape)]
        stride = [2048 if st == registry.DYN else st for st in a.stride]
        if CUDA:  # an overlapping view is fine: no kernel reads it
            n = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
            out.append(torch.empty(n, dtype=DTYPES[a.dtype], device="cuda").as_strided(shape, stride))
        else:
            out.append(FakeTensor(DTYPES[a.dtype], shape, stride, 1 << 20))
    return out


def per_call_us(fn, n=20000):
    fn()
    best = float("inf")
    for _ in range(5):  # best of 5: the machine is shared
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best = min(best, (time.perf_counter() - t0) / (n // 5) * 1e6)
    return best


def main():
    lib = loader.KernelLibrary.from_functions("none", {s.name: (lambda p: 0) for s in registry.SPECS}, str)
    rows = []
    for name in KERNELS:
        args = make_args(registry.SPECS_BY_NAME[name])
        old = per_call_us(lambda: lib.launch_ctypes(name, *args, stream=0))
        new = per_call_us(lambda: lib.launch(name, *args, stream=0))
        rows.append({"what": name, "args": len(args), "ctypes_us": round(old, 2), "packed_us": round(new, 2)})
    if CUDA:
        from mok_nn import cuda_backend as cb

        rows.append({"what": "stream", "args": 0,
                     "ctypes_us": round(per_call_us(lambda: torch.cuda.current_stream().cuda_stream), 2),
                     "packed_us": round(per_call_us(cb._stream), 2)})
        try:
            cb._lib()
            lib_us = per_call_us(cb._lib)
            load_us = per_call_us(lambda: loader.load("sm_90a"))
            rows.append({"what": "_lib()", "args": 0, "ctypes_us": round(load_us, 2), "packed_us": round(lib_us, 2)})
        except loader.KernelLibraryError as e:
            print(f"_lib() not timed: {e}")
    lines = [f"launch host time per call ({'CUDA tensors' if CUDA else 'fake tensors, CPU'}; old = ctypes path "
             "/ torch.cuda.current_stream() / loader.load)",
             f"{'what':<18} {'args':>4} {'old us':>8} {'new us':>8} {'speed-up':>8}"]
    for r in rows:
        lines.append(f"{r['what']:<18} {r['args']:>4} {r['ctypes_us']:>8.2f} {r['packed_us']:>8.2f} "
                     f"{r['ctypes_us'] / r['packed_us']:>7.1f}x")
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "launch_host.json"), "w") as f:
        json.dump({"cuda": CUDA, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "launch_host.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
