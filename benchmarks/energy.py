"""How much energy does one call of the layer take, mok_nn against the torch baseline? Read from the GPU's
own energy counter (NVML through ctypes: no package needed), with the mean power and SM clock meanwhile.

    python benchmarks/energy.py [--shapes deepseek-v3] [--seconds 2]

Where the GPU runs at its power limit (deepseek-v3 on H200) a throughput is energy bound: the ratio to the
baseline tends to the ratio of the energies per call. Each (implementation, step) runs back to back for
about --seconds (the power settles), twice in the order mok_nn, baseline, mok_nn, baseline; the backward's
figures are forward+backward minus forward.
"""
import argparse
import ctypes
import threading
import time

import torch

from mok_nn import bench
from steps import bench_steps  # benchmarks/ is on sys.path when run as a script


class Nvml:
    """The few NVML calls needed: total energy (mJ since the driver loaded) and the SM clock (MHz)."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0, "nvmlInit failed"
        self.dev = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.dev)) == 0

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        assert self.lib.nvmlDeviceGetTotalEnergyConsumption(self.dev, ctypes.byref(v)) == 0
        return v.value

    def sm_clock(self) -> int:
        v = ctypes.c_uint()
        assert self.lib.nvmlDeviceGetClockInfo(self.dev, 1, ctypes.byref(v)) == 0  # NVML_CLOCK_SM
        return v.value


def run_for(fn, seconds, nvml):
    """(ms, J, W, MHz) per call of fn, over back-to-back calls lasting about `seconds`."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(3, int(seconds / max(time.perf_counter() - t0, 1e-4)))
    clocks, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.02):
            clocks.append(nvml.sm_clock())

    th = threading.Thread(target=sample)
    th.start()
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    dt, de = time.perf_counter() - t0, (nvml.energy_mj() - e0) / 1e3
    stop.set()
    th.join()
    mhz = sum(clocks) / len(clocks) if clocks else float("nan")
    return dt / calls * 1e3, de / calls, de / dt, mhz


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="deepseek-v3", help="comma-separated benchmark shapes")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    nvml = Nvml(torch.cuda.current_device())
    for shape in a.shapes.split(","):
        if shape not in bench.SHAPES:
            ap.error(f"unknown shape {shape}; known: {', '.join(bench.SHAPES)}")
        impls = {"mok_nn": bench_steps(shape, a.tokens), "torch_baseline": bench_steps(shape, a.tokens, baseline=True)}
        print(f"{shape}: per call, back to back ~{a.seconds:.1f} s each; bwd = fwd+bwd - fwd", flush=True)
        for rep in range(2):
            for name, st in impls.items():
                (ms_f, j_f, w_f, c_f), (ms_fb, j_fb, w_fb, c_fb) = (run_for(f, a.seconds, nvml) for _, f in st)
                print(f"  {rep} {name:15s} fwd {ms_f:7.3f} ms {j_f:6.2f} J {w_f:4.0f} W {c_f:5.0f} MHz | "
                      f"fwd+bwd {ms_fb:7.3f} ms {j_fb:6.2f} J {w_fb:4.0f} W {c_fb:5.0f} MHz | "
                      f"bwd {ms_fb - ms_f:7.3f} ms {j_fb - j_f:6.2f} J", flush=True)


if __name__ == "__main__":
    main()
