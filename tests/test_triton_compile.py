"""Every Triton kernel form mok_nn.triton_ops launches compiles for sm_90 (tests/triton_compile_forms.py, in its own
process without Triton's interpreter; Triton's compiler and the ptxas of its wheel, no GPU). The interpreter tests
check what the kernels compute; the compiler rejects things the interpreter runs (a global that is not a
tl.constexpr did)."""

import os
import pathlib
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

TESTS = pathlib.Path(__file__).resolve().parent


def test_every_kernel_form_compiles_for_sm90():
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no ptxas of its own")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent)] + [p for p in sys.path if p])
    out = subprocess.run([sys.executable, str(TESTS / "triton_compile_forms.py")], env=env, capture_output=True,
                         text=True, timeout=1800)
    lines = out.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert out.returncode == 0 and not failed, "\n".join(failed) or out.stderr[-3000:]
    from mok_nn.triton_ops import kernels

    compiled = {line.split()[1] for line in lines if line.startswith("ok ")}
    assert compiled == {name for name in dir(kernels) if name.endswith("_kernel")}  # each kernel, some form
