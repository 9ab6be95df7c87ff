"""benchmarks/router_variants.py runs on CPU (in its own process) and finds the two top-k forms choosing the same
experts, as the layer's routing does."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_router_variants_agree_on_cpu():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "router_variants.py"), "--shapes", "tiny,deepseek-v3",
                          "--tokens", "96", "--device", "cpu", "--iters", "2"], cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(r["shape"], r["topk"]) for r in recs} == {(s, t) for s in ("tiny", "deepseek-v3") for t in ("keys", "sort")}
    for r in recs:
        assert r["gemm"] == "fp32" and r["same_ids_as_layer"] and r["tokens_with_other_experts"] == 0.0
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
