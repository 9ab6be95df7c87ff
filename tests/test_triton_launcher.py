"""triton_ops._Launcher's logic on the CPU, with a stand-in for a Triton kernel: the first launch of a form goes
through Triton and caches the compiled kernel; a later launch of the same form calls the compiled kernel's
launcher with Triton's arguments (grid padded to three, the stream, the kernel's handles, no launch metadata or
hooks, then every kernel argument in signature order); a new form (an integer 1, an unaligned tensor, other
meta-parameters), a set launch hook, or a launcher that rejects the arguments goes through Triton.
(tests/gpu/test_torch_backend_cuda.py runs the real thing.)"""

import pytest
import torch

pytest.importorskip("triton")

from mok_nn import triton_ops  # noqa: E402


class _Compiled:
    function, packed_metadata = "function handle", "packed metadata"

    def __init__(self):
        self.calls, self.reject = [], False

    def run(self, *args):
        if self.reject:
            raise TypeError("another launcher signature")
        self.calls.append(args)


class _Kernel:
    arg_names = ["x_ptr", "out_ptr", "n", "scale", "K", "BLOCK"]

    def __init__(self):
        self.compiled, self.through_triton = _Compiled(), []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.through_triton.append((grid, args, meta))
            return self.compiled
        return launch


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(triton_ops, "current_stream", lambda: 1234)
    monkeypatch.setattr(triton_ops, "_launch_hooks", lambda: False)
    lau = triton_ops._Launcher(_Kernel())
    lau.fast = True  # (a JITFunction's launcher; the stand-in is not one)
    return lau


def test_second_launch_of_a_form_calls_the_compiled_kernel(launcher):
    x, out = torch.zeros(64), torch.zeros(64)
    launcher[(4,)](x, out, 64, 1.5, K=8, BLOCK=32, num_warps=2)
    assert len(launcher.fn.through_triton) == 1 and launcher.fast_launches == 0
    x2, out2 = torch.zeros(128), torch.zeros(128)
    launcher[(8, 2)](x2, out2, 128, 2.5, K=8, BLOCK=32, num_warps=2)
    assert len(launcher.fn.through_triton) == 1 and launcher.fast_launches == 1
    args = launcher.fn.compiled.calls[-1]
    assert args[:9] == (8, 2, 1, 1234, "function handle", "packed metadata", None, None, None)
    assert args[9] is x2 and args[10] is out2 and args[11:] == (128, 2.5, 8, 32)


@pytest.mark.parametrize("change", ["int one", "unaligned", "meta", "options", "dtype"])
def test_a_new_form_goes_through_triton(launcher, change):
    x, out = torch.zeros(64), torch.zeros(64)
    launcher[(4,)](x, out, 64, 1.5, K=8, BLOCK=32, num_warps=2)
    n, meta, opts = 64, dict(K=8, BLOCK=32), dict(num_warps=2)
    if change == "int one":
        n = 1
    elif change == "unaligned":
        x = torch.zeros(65)[1:]
    elif change == "meta":
        meta["K"] = 4
    elif change == "options":
        opts["num_warps"] = 4
    else:
        x = torch.zeros(64, dtype=torch.float64)
    launcher[(4,)](x, out, n, 1.5, **meta, **opts)
    assert len(launcher.fn.through_triton) == 2 and launcher.fast_launches == 0


def test_hooks_and_rejected_arguments_go_through_triton(launcher, monkeypatch):
    x, out = torch.zeros(64), torch.zeros(64)
    launcher[(4,)](x, out, 64, 1.5, K=8, BLOCK=32)
    monkeypatch.setattr(triton_ops, "_launch_hooks", lambda: True)
    launcher[(4,)](x, out, 64, 1.5, K=8, BLOCK=32)
    assert len(launcher.fn.through_triton) == 2 and launcher.fast_launches == 0
    monkeypatch.setattr(triton_ops, "_launch_hooks", lambda: False)
    launcher.fn.compiled.reject = True
    launcher[(4,)](x, out, 64, 1.5, K=8, BLOCK=32)  # rejected before launching: Triton's path, and from now on
    assert len(launcher.fn.through_triton) == 3 and not launcher.fast and launcher.fast_launches == 0


def test_a_launch_without_every_argument_named_is_not_kept(launcher):
    x, out = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        launcher[(4,)](x, out, 64, 1.5, K=8)  # (BLOCK left to a default: the argument order is not known)
    assert len(launcher.fn.through_triton) == 2 and launcher.fast_launches == 0


def test_launch_hooks_are_those_a_launch_would_call(monkeypatch):
    from triton import knobs

    assert not triton_ops._launch_hooks()  # Triton's empty hook chains
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert triton_ops._launch_hooks()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
