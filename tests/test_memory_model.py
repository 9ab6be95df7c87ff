"""benchmarks/memory_model.py runs (in its own process: it replaces cuda_backend's kernels by allocations) and
reports a backward peak that holds at least the weight gradients and the saved rows' size."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_memory_model_reports_plausible_bytes():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_model.py"), "--shapes", "tiny",
                          "--tokens", "512"], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""},
                         capture_output=True, text=True, check=True, timeout=300).stdout
    rec = json.loads([line for line in out.splitlines() if line.startswith("{")][0])
    assert rec["shape"] == "tiny" and rec["tokens"] == 512
    # tiny: H 64, I 32, E 8, k 2: weight gradients 8 * (64*64 + 64*32) bf16 = 96 KiB
    assert rec["weight_grads_bytes"] == 8 * (64 * 64 + 64 * 32) * 2
    assert rec["backward_peak_bytes"] >= rec["weight_grads_bytes"] and rec["saved_bytes"] > 0
