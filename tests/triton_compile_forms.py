"""Compiles every Triton kernel form mok_nn.triton_ops launches for sm_90 (Hopper), without a GPU: Triton's own
compiler and the ptxas its wheel ships. Run by tests/test_triton_compile.py in its own process, without
TRITON_INTERPRET (under the interpreter @triton.jit gives functions that do not compile).

The wrappers of mok_nn.triton_ops run on small CPU tensors with each kernel's launch replaced by a record of its
arguments (nothing runs); each distinct form (argument dtypes and meta-parameters) is then compiled from those
arguments. Prints one line per form, "ok <kernel> <form>" or "FAIL <kernel> <form>: <error>"; exit status 1 if one
failed. With --sass each "ok" line also gives the form's SASS instruction count and its global loads / stores by
width (reading the SASS needs no GPU):

    env -u TRITON_INTERPRET python tests/triton_compile_forms.py --sass

The interpreter tests (tests/test_triton_ops.py) check what the kernels compute; this catches what only the
compiler rejects (e.g. a global that is not a tl.constexpr).
"""

import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mok_nn import triton_ops  # noqa: E402

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8"}


class _Recorder:
    """A kernel whose launches record (kernel, positional arguments, meta-parameters)."""

    def __init__(self, fn, forms):
        self.fn, self.forms = fn, forms

    def __getitem__(self, grid):
        def launch(*args, **meta):
            # launch options are the compiler's, not the kernel's arguments
            options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
            sig, aligned = {}, []
            names = [n for n in self.fn.arg_names if n not in meta]
            for name, a in zip(names, args):
                if isinstance(a, torch.Tensor):
                    sig[name] = "*" + _TYPES[a.dtype]
                    aligned.append(a.data_ptr() % 16 == 0)
                elif isinstance(a, bool):
                    sig[name] = "i1"
                    aligned.append(False)
                elif isinstance(a, int):
                    sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
                    aligned.append(a % 16 == 0)
                else:
                    sig[name] = "fp32"
                    aligned.append(False)
            # as the JIT specialises a launch: pointers and integers that are multiples of 16 say so (the
            # vector width of loads and stores follows from it)
            attrs = {(i,): [["tt.divisibility", 16]] for i, ok in enumerate(aligned) if ok}
            every = tuple(sorted({**meta, **options}.items()))
            key = (self.fn.__name__, tuple(sig.items()), every, tuple(sorted(attrs)))
            self.forms.setdefault(key, (self.fn, sig, meta, attrs, options))
        return launch


def record_forms() -> dict:
    """Runs the wrappers over the dtypes and options the library uses; returns the distinct launches."""
    from mok_nn.triton_ops import kernels

    forms = {}
    names = [n for n in dir(kernels) if n.endswith("_kernel")]
    fake = type("Kernels", (), {n: _Recorder(getattr(kernels, n), forms) for n in names})
    triton_ops._kernels = lambda: fake
    g = torch.Generator().manual_seed(0)
    hw_e4m3 = triton_ops.hw_e4m3
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(64, 96, generator=g).to(dt)
        for hw in (False, True):  # (the rounding by arithmetic, and by the E4M3 conversion sm_89 and later have)
            triton_ops.hw_e4m3 = lambda device, hw=hw: hw
            for axis in (0, 1):
                triton_ops.fake_quantize(x, axis)
            triton_ops.quantize(x)
            triton_ops.fake_quantize_rows(x, torch.tensor([0, 32], dtype=torch.int64), torch.tensor([32, 20]))
        triton_ops.hw_e4m3 = hw_e4m3
        data = torch.randint(0, 256, (4, 64), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        triton_ops.dequantize(data, torch.randint(0, 256, (4, 2), dtype=torch.uint8, generator=g), dt)
        if dt != torch.float16:
            data = torch.randint(0, 256, (2, 64, 96), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
            for hw in (False, True):
                triton_ops.hw_e4m3 = lambda device, hw=hw: hw
                triton_ops.requantize_rows(data, torch.randint(0, 256, (2, 64, 3), dtype=torch.uint8, generator=g), dt)
            triton_ops.hw_e4m3 = hw_e4m3
        gate_up, dh = torch.randn(8, 64, generator=g).to(dt), torch.randn(8, 32, generator=g).to(dt)
        for act in ("swiglu", "swiglu_oai"):
            for limit in (None, 7.0):
                triton_ops.activation_forward(gate_up, act, limit)
                for write_wh in (False, True):
                    triton_ops.mlp_backward_rows(gate_up, dh, torch.rand(8, generator=g), act, limit, write_wh)
    triton_ops.mx_row_factors(torch.randint(0, 135, (2, 100, 7), dtype=torch.uint8, generator=g), 120)
    triton_ops.mx_row_factors(torch.randint(0, 135, (2, 96, 7), dtype=torch.uint8, generator=g), 120,
                              torch.randint(0, 4, (2, 3, 7), dtype=torch.int16, generator=g))
    triton_ops.transposed(torch.randint(-2**15, 2**15, (2, 100, 7), dtype=torch.int16, generator=g))
    for cols, k in ((8, 2), (128, 8), (256, 8), (60, 20)):
        triton_ops.topk_indices(torch.randn(16, cols, generator=g), k)
    for cols, k in ((128, 8),):  # (the routing kernels' branches: score function, bias, renormalisation, d scores)
        for softmax in ("softmax", "sigmoid"):
            for bias in (None, torch.randn(cols, generator=g)):
                for norm in (False, True):
                    logits = torch.randn(16, cols, generator=g, requires_grad=True)
                    _, w, scores = triton_ops.route(logits, k, softmax, norm, 2.5, bias)
                    for grads in ((w,), (w, scores)):
                        torch.autograd.backward(grads, [torch.ones_like(t) for t in grads], retain_graph=True)
                    ids = torch.stack([torch.randperm(cols, generator=g)[:k] for _ in range(16)])
                    triton_ops.route_backward(scores.detach(), ids, torch.randn(16, k, generator=g), None, k,
                                              softmax == "softmax", norm, 2.5, d_logits_in=torch.randn(16, cols),
                                              parts=True)  # (the fused router's backward)
    for dt in (torch.bfloat16, torch.float16):  # the fused router: its dot, both biases, both score functions
        for cols, k, hidden in ((128, 8, 2048), (60, 4, 1000), (100, 8, 7168), (8, 2, 64)):
            x, w = torch.randn(16, hidden, generator=g).to(dt), torch.randn(cols, hidden, generator=g).to(dt)
            for softmax in (True, False):
                for bias in (None, torch.randn(cols, generator=g)):
                    triton_ops.router_forward(x, w, bias if bias is None else bias.to(dt), bias, k, softmax, True, 1.0)
    return forms


def sass_summary(kernel) -> str:
    """SASS instructions of a compiled kernel and its global loads / stores by width (cuobjdump of Triton's wheel):
    what shows whether the accesses are 16-byte vectors."""
    import pathlib
    import re
    import subprocess
    import tempfile

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = [line.split("*/", 1)[1].strip() for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    mem = {}
    for op in ops:
        name = op.split()[1] if op.startswith("@") else op.split()[0]
        if name.startswith(("LDG", "STG")):
            mem[name] = mem.get(name, 0) + 1
    return f"{len(ops)} instructions, " + ", ".join(f"{k} x{v}" for k, v in sorted(mem.items()))


def main(argv=None) -> int:
    sass = "--sass" in (sys.argv[1:] if argv is None else argv)  # also each form's SASS summary (sass_summary)
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for (name, sig, meta, _), (fn, signature, constexprs, attrs, options) in record_forms().items():
        form = ", ".join([f"{k}={v}" for k, v in sig] + [f"{k}={v}" for k, v in meta])
        t0 = time.perf_counter()
        try:
            kernel = triton.compile(ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}},
                                              constexprs=constexprs, attrs=attrs), target=target, options=options)
            extra = f"; {sass_summary(kernel)}" if sass else ""
            print(f"ok {name} {form} ({time.perf_counter() - t0:.1f} s{extra})", flush=True)
        except Exception as err:  # noqa: BLE001 - every form is reported
            failed += 1
            print(f"FAIL {name} {form}: {type(err).__name__}: {str(err)[-1500:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
