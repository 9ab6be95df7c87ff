"""Is mok_nn's forward host-bound? Host time per call of the routed experts against their GPU time,
then cProfile of the host side (--backward: of forward+backward calls).

    python benchmarks/profile_host.py [--shape qwen3-30b-a3b] [--tokens 8192] [--top 22] [--long] [--layer]
                                      [--segments] [--timeline] [--backward]
                                      [--precision bf16|mxfp8] [--weights trained|frozen|mxfp8_only]

The GPU is kept busy (torch.cuda._sleep) while the host issues the calls, so the host's time per call is its
own issue time, not a wait for the GPU. A forward whose host time is above its GPU time leaves the GPU idle
(the benchmark times each call from an idle GPU). Then cProfile of 20 forward calls: the Python functions
with the most host time (--long: also by cumulative time, and the callers of the costly builtins).
--segments: instead of cProfile (whose per-call overhead inflates call-heavy code), when each step of a
forward starts and ends on the host (perf_counter, the GPU busy), in us from the forward's start: where the
host time goes before the gate/up GEMM's launch, which an idle GPU waits for. --timeline: one forward and one
forward+backward from an idle GPU under torch.profiler, each kernel's launch on the host beside its start and end
on the GPU, and the GPU's idle time between them.
"""
import argparse
import cProfile
import functools
import importlib
import pstats
import time

import torch

from mok_nn import bench
from steps import bench_steps, host_ms_busy, layer_steps, median_ms  # benchmarks/ is on sys.path when run as a script


# (module, attribute): the steps of a forward whose host time --segments shows, outermost first
SEGMENTS = [
    ("mok_nn.layer", "MoKMoELayer.forward"), ("mok_nn.layer", "MoKMoELayer._check_input"),
    ("mok_nn.router", "route_tokens"), ("mok_nn.router", "_FusedRouter.forward"), ("mok_nn.triton_ops", "router_forward"),
    ("mok_nn.triton_ops", "_Launcher.launch"),
    ("mok_nn.router", "router_logits"), ("mok_nn.router", "_TensorCoreLogits.forward"), ("mok_nn.router", "route"),
    ("mok_nn.triton_ops", "route"), ("mok_nn.triton_ops", "_Route.forward"), ("mok_nn.layer", "MoKMoELayer._choose_backend"),
    ("mok_nn.cuda_backend", "unsupported_reason"), ("mok_nn.cuda_backend", "check_supported"), ("mok_nn.layer", "MoKMoELayer._local_experts"),
    ("mok_nn.functional", "get_workspace"), ("mok_nn.autograd", "MoKFunction.forward"),
    ("mok_nn.autograd", "expert_weights"), ("mok_nn.functional", "build_schedule"),
    ("mok_nn.cuda_backend", "make_schedule"), ("mok_nn.cuda_backend", "_schedule_buffers"),
    ("mok_nn.cuda_backend", "_gathers_with_schedule"), ("mok_nn.cuda_backend", "num_sms"),
    ("mok_nn.cuda_backend", "Schedule.__init__"), ("mok_nn.functional", "forward"),
    ("mok_nn.cuda_backend", "launch_gate_up_act"), ("mok_nn.cuda_backend", "grouped_gemm"),
    ("mok_nn.cuda_backend", "combine"), ("mok_nn.kernels.loader", "KernelLibrary.launch"),
    ("triton.runtime.jit", "JITFunction.run"),
]


def segments(fwd, reps=50):
    """Calls per forward and mean host start / end (us from the outermost step's start) of each SEGMENTS step;
    "all calls": the span times the calls per forward."""
    marks, origin = {}, [None]

    def wrap(label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            if origin[0] is None:
                origin[0] = t
            try:
                return fn(*args, **kwargs)
            finally:
                marks.setdefault(label, []).append((t - origin[0], time.perf_counter() - origin[0]))
        return timed

    patched = []
    for mod_name, attr in SEGMENTS:
        owner = importlib.import_module(mod_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        orig = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if orig is None:
            continue
        fn = orig.__func__ if isinstance(orig, staticmethod) else orig
        new = wrap(f"{mod_name.rsplit('.', 1)[-1]}.{attr}", fn)
        setattr(owner, name, staticmethod(new) if isinstance(orig, staticmethod) else new)
        patched.append((owner, name, orig))
    try:
        fwd()  # (the first call through the wrappers)
        marks.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        for _ in range(reps):
            origin[0] = None
            fwd()
        torch.cuda.synchronize()
    finally:
        for owner, name, orig in patched:
            setattr(owner, name, orig)
    print(f"host steps of one forward (mean of {reps}, GPU busy), us from its start:")
    print(f"{'step':40s} {'calls':>5s} {'start':>8s} {'end':>8s} {'span':>8s} {'all calls':>9s}")
    for label, spans in sorted(marks.items(), key=lambda kv: sum(s for s, _ in kv[1]) / len(kv[1])):
        n = len(spans)
        start = sum(s for s, _ in spans) / n * 1e6
        end = sum(e for _, e in spans) / n * 1e6
        print(f"{label:40s} {n / reps:5.1f} {start:8.1f} {end:8.1f} {end - start:8.1f} {(end - start) * n / reps:9.1f}")


def timeline(call, what):
    """Host launch time, GPU start and GPU end (us from the call's start) of each kernel of one call from an idle
    GPU (the last of 6, under torch.profiler, whose own host time is in it), and the GPU's idle gaps: a kernel that
    starts well after its predecessor ended waited for its launch (the host), not for the GPU."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(6):
            torch.cuda.synchronize()
            with record_function(f"call{i}"):
                call()
            torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    mark = next(e for e in events if e.name() == "call5")
    t0, t1 = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    on_gpu = {}
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            on_gpu.setdefault(e.correlation_id(), []).append(e)
    rows = []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU and t0 <= e.start_ns() <= t1 and "aunch" in e.name():
            for k in on_gpu.get(e.correlation_id(), []):
                rows.append(((k.start_ns() - t0) / 1e3, (k.start_ns() + k.duration_ns() - t0) / 1e3,
                             (e.start_ns() - t0) / 1e3, k.name()[:70]))
    rows.sort()
    print(f"{what} from an idle GPU under torch.profiler: host span {(t1 - t0) / 1e3:.1f} us")
    print(f"{'launch us':>10s} {'gpu start':>10s} {'gpu end':>10s} {'idle':>7s}  kernel")
    busy, idle, prev_end = 0.0, 0.0, 0.0
    for start, end, launch, name in rows:
        gap = max(0.0, start - prev_end)
        idle += gap
        busy += end - start
        prev_end = max(prev_end, end)
        print(f"{launch:10.1f} {start:10.1f} {end:10.1f} {gap:7.1f}  {name}")
    print(f"GPU busy {busy:.1f} us, idle before and between kernels {idle:.1f} us, last kernel ends at {prev_end:.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s in bench.SHAPES if s != "tiny"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=22, help="rows of each cProfile table")
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--layer", action="store_true", help="the whole layer (MoKMoELayer) instead of the routed experts")
    ap.add_argument("--segments", action="store_true", help="host start / end of each step of a forward, no cProfile")
    ap.add_argument("--backward", action="store_true", help="cProfile forward+backward calls instead of forwards")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "mxfp8"])
    ap.add_argument("--weights", default="trained", choices=bench.WEIGHT_MODES,
                    help="the routed experts' weights (bench.mok_experts); not with --layer")
    ap.add_argument("--timeline", action="store_true",
                    help="one forward's and one forward+backward's launches beside their kernels on the GPU")
    a = ap.parse_args()
    if a.layer and a.weights != "trained":
        ap.error("--weights applies to the routed experts (not --layer)")
    steps = layer_steps if a.layer else bench_steps
    kw = {} if a.layer else {"weights": a.weights}
    fwd, fwd_bwd = (call for _, call in steps(a.shape, a.tokens, precision=a.precision, **kw))
    for call in (fwd, fwd_bwd):
        for _ in range(3):
            call()
    for name, call, reps in (("forward", fwd, 20), ("forward+backward", fwd_bwd, 8)):
        what = f"{a.shape}{' layer' if a.layer else ''} {name}"
        print(f"{what}: host {host_ms_busy(call, reps):.3f} ms per call (GPU busy), "
              f"call from an idle GPU {median_ms(call, 20):.3f} ms", flush=True)
    if a.segments or a.timeline:
        if a.segments:
            segments(fwd)
        if a.timeline:
            timeline(fwd, f"one {a.shape} forward")
            timeline(fwd_bwd, f"one {a.shape} forward+backward")
        return

    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    call, name = (fwd_bwd, "forward+backward") if a.backward else (fwd, "forward")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        call()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of 20 {name} calls ({a.shape}), by own time:")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(a.top)
    if a.long:
        stats.sort_stats("cumulative").print_stats(a.top)
        stats.sort_stats("tottime").print_callers("empty|get|launch|pack")


if __name__ == "__main__":
    main()
