"""Count the torch ops of cuda_ep's host bookkeeping (sequential EP forward + backward), on the CPU.

The EP ranks are simulated by threads (as in test_cuda_ep_simulated); every kernel of the CUDA
path (GEMMs, activations, combine, weight gradients, row copies as MOK_EP_COPY=v2 issues them: one
per pull_rows / push_rows, step 1 of the forward as MOK_EP_PUBLISH=kernel does it: one launch, barrier
signals, the schedule:
make_schedule, whose CUDA path also allocates its 6 outputs) is stubbed by a
torch stand-in and counted as one launch, its inner ops not counted. What is left is what
cuda_ep itself dispatches: on the GPU each op is (about) one kernel launch plus Python/ATen time.

    python tests/count_ep_host_ops.py            # P=2, qwen3-like routing (E=128, k=8), 512 tokens/rank
"""

import collections
import sys
import threading
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from mok_nn import cuda_backend as cb  # noqa: E402
from mok_nn import cuda_ep  # noqa: E402
from mok_nn.config import MoKConfig  # noqa: E402
from mok_nn.functional import ExpertParams  # noqa: E402


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


# views and host-side scalar wrappers: Python/ATen time, but no kernel launch on the GPU
NO_LAUNCH = {"slice", "select", "view", "unsqueeze", "alias", "detach", "reshape", "expand", "permute", "t",
             "transpose", "_unsafe_view", "as_strided", "lift_fresh", "scalar_tensor", "squeeze",
             "empty", "new_empty", "empty_like", "empty_strided"}

_counters = {}  # thread id -> Counter (the mode stack is per thread)


def _kernel(fn):
    """fn counted as one launch; its own torch ops are not counted."""
    def run(*a, **kw):
        c = _counters.get(threading.get_ident())
        if c is None:
            return fn(*a, **kw)
        c.ops["<kernel>"] += 1
        was, c.paused = c.paused, True
        try:
            return fn(*a, **kw)
        finally:
            c.paused = was
    return run


def main(P=2, T=512, H=64, I=32, E=128, K=8):
    import os

    os.environ.update(MOK_GEMM="torch", MOK_ACT="torch", MOK_EP_COPY="torch")
    from test_cuda_ep_simulated import _ThreadBuffers

    cb.check_supported = lambda *a: None
    cuda_ep._record_errors = lambda ws, flags, what: None
    cb.combine = _kernel(cb.combine_torch)
    for name in ("grouped_gemm", "act_forward", "act_backward", "weight_grad", "make_schedule"):
        setattr(cb, name, _kernel(getattr(cb, name)))
    # row copies as in the default MOK_EP_COPY=v2: one launch per pull_rows / push_rows (carried out
    # by the torch mode underneath, not counted)
    _ThreadBuffers.pull_rows = _kernel(cuda_ep.SymmBuffers.pull_rows)
    _ThreadBuffers.push_rows = _kernel(cuda_ep.SymmBuffers.push_rows)
    _ThreadBuffers.push_partials = _kernel(cuda_ep.SymmBuffers.push_partials)
    _ThreadBuffers.final_combine = _kernel(cuda_ep.SymmBuffers.final_combine)
    # steps 1 and 2 of the forward as in the default MOK_EP_PUBLISH=kernel: one mok_ep_publish launch,
    # which ends with the barrier
    barrier_fn = _ThreadBuffers.barrier

    def publish(self, x, ids, w, num_tokens, then_barrier=False, **kw):
        cuda_ep.SymmBuffers.publish(self, x, ids, w, num_tokens, **kw)
        if then_barrier:
            barrier_fn(self)  # the simulated ranks' barrier, inside the launch

    _ThreadBuffers.publish = _kernel(publish)
    _ThreadBuffers.barrier = lambda self: [_kernel(lambda: None)() for _ in range(P - 1)] and barrier_fn(self)

    g = torch.Generator().manual_seed(0)
    e_l = E // P
    W13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    W2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    xs = [torch.randn(T, H, generator=g).bfloat16() for _ in range(P)]
    dys = [torch.randn(T, H, generator=g).bfloat16() for _ in range(P)]
    ids = [torch.topk(torch.randn(T, E, generator=g), K, dim=1).indices for _ in range(P)]
    wts = [torch.rand(T, K, generator=g) for _ in range(P)]
    _, nbytes = cuda_ep.buffer_layout(P, T, H, K)
    raws = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(P)]
    bar = threading.Barrier(P)
    result = {}

    def rank_fn(r):
        sl = slice(r * e_l, (r + 1) * e_l)
        params = ExpertParams(W13[sl], W2[sl], None, None)
        ws = SimpleNamespace(num_experts=E, hidden_size=H, top_k=K, config=MoKConfig(), activation="swiglu",
                             swiglu_limit=None, device=torch.device("cpu"), buffers={},
                             ep_state={"bufs": _ThreadBuffers(raws, r, T, H, K, bar), "pending": []})
        for step in range(2):  # the second step is counted (caches warm)
            c = Counter()
            _counters[threading.get_ident()] = c
            with c:
                y, saved = cuda_ep.forward(xs[r], ids[r], wts[r], params, None, ws)
                fwd = dict(c.ops)
                c.ops.clear()
                cuda_ep.backward(dys[r], saved, xs[r], ids[r], wts[r], params, ws)
                bwd = dict(c.ops)
            del _counters[threading.get_ident()]
        c = Counter()
        _counters[threading.get_ident()] = c  # make_schedule counted as its kernel
        with c:
            cuda_ep.make_ep_schedule(ws.ep_state["bufs"].local("ids"), T, r, e_l, saved.eps.sched.capacity)
        del _counters[threading.get_ident()]
        cuda_ep.dispatch_plan(saved.eps, r)  # its constant tables built
        with Counter() as plan:  # the overlapped forward's dispatch plan (not in the sequential forward)
            cuda_ep.dispatch_plan(saved.eps, r)
        result[r] = (fwd, bwd, dict(c.ops), dict(plan.ops))

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fwd, bwd, sched, plan = result[0]

    def line(name, ops):
        ker = ops.get("<kernel>", 0)
        torch_ops = sum(ops.values()) - ker
        launching = sum(v for k, v in ops.items() if k not in NO_LAUNCH and k != "<kernel>")
        print(f"{name:18s} torch ops {torch_ops:4d}  launching {launching:4d}  kernels {ker:3d}  | "
              + " ".join(f"{k}:{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if k != "<kernel>"))

    print(f"P={P} tokens/rank={T} E={E} k={K} (rank 0)")
    line("make_ep_schedule", sched)
    line("dispatch_plan", plan)
    line("forward", fwd)
    line("backward", bwd)


if __name__ == "__main__":
    main()
