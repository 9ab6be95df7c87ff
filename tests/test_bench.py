"""The benchmark harness and the torch baseline run on CPU with tiny shapes."""

import json

import pytest
import torch

from mok_nn import bench

KEYS = {"shape", "ep", "tokens_per_rank", "impl", "precision", "fwd_ms", "bwd_ms", "fwd_tflops",
        "bwd_tflops", "peak_mem_gb", "act_mem_gb", "gpu", "torch", "commit", "date"}  # fmt: skip
CHECK = {"y", "dx", "dw", "d_gate_up", "d_down"}  # "check": errors against the fp32 reference (EP = 1)


def test_bench_cpu_tiny(tmp_path):
    pytest.importorskip("mok_nn.reference")
    out = tmp_path / "b.json"
    bench.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "64", "--iters", "2", "--warmup", "1", "--out", str(out)])
    recs = json.loads(out.read_text())
    assert [r["impl"] for r in recs] == ["mok_nn", "torch_baseline"]
    for r in recs:
        assert set(r) == KEYS | {"check"} and set(r["check"]) == CHECK
        assert r["fwd_ms"] > 0 and r["tokens_per_rank"] == 64  # bwd_ms is a difference: noisy on CPU


def test_summary_states_the_whole_layers_share_outside_the_experts():
    """The protocol's whole-layer target (what lies outside the routed experts, as a share of the layer's forward)
    is printed per shape and path; a path without both rows prints none."""
    def rec(impl, fwd_ms, shape="qwen3-30b-a3b"):
        return {"shape": shape, "impl": impl, "fwd_ms": fwd_ms, "bwd_ms": 2.0, "fwd_tflops": 1.0, "bwd_tflops": 1.0,
                "peak_mem_gb": 1.0, "act_mem_gb": 0.1}
    text = bench.summary([rec("mok_nn", 1.5), rec("mok_nn_layer", 2.0), rec("mok_nn_torch", 3.0),
                          rec("mok_nn_torch_layer", 4.0), rec("mok_nn", 1.0, "tiny")])
    lines = [ln for ln in text.splitlines() if "outside the routed experts" in ln]
    assert lines == ["qwen3-30b-a3b: mok_nn_layer: 25.0% of its forward outside the routed experts",
                     "qwen3-30b-a3b: mok_nn_torch_layer: 25.0% of its forward outside the routed experts"], lines


def _fp64_experts(p):
    """The benchmark's routed experts in float64, token by token: the oracle of the rows below."""
    x, W13, W2 = p["x"].double(), p["gate_up_proj"].double(), p["down_proj"].double()
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(p["ids"].shape[1]):
            e = int(p["ids"][t, j])
            g, u = (W13[e] @ x[t]).chunk(2)
            ref[t] += p["w"][t, j].double() * (W2[e] @ (torch.nn.functional.silu(g) * u))
    return ref


def test_baseline_matches_fp64_oracle():
    p = bench.make_problem("tiny", 48, "cpu", seed=3)
    y = bench.baseline_experts(p["x"], p["ids"], p["w"], p["gate_up_proj"], p["down_proj"])
    ref = _fp64_experts(p)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


def test_commit_is_the_package_checkout_not_the_cwd(tmp_path, monkeypatch):
    """The recorded commit is mok_nn's, wherever the benchmark is started from."""
    import pathlib
    import subprocess

    root = pathlib.Path(bench.__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("mok_nn is not in a git checkout")
    monkeypatch.chdir(tmp_path)  # not a git repository
    assert bench._commit() == head.stdout.strip()


def test_commit_flag_overrides(tmp_path):
    """--commit names the records' commit (a tree that travels without .git)."""
    out = tmp_path / "d.json"
    bench.main(["--device", "cpu", "--iters", "1", "--warmup", "0", "--no-check", "--out", str(out), "--commit", "abc123"])
    assert {r["commit"] for r in json.loads(out.read_text())} == {"abc123"}


def test_bench_cpu_defaults_to_the_tiny_shape(tmp_path):
    """Without --shapes/--tokens a CPU run exercises the harness on the tiny shape, not the
    full benchmark shapes (hours on a CPU)."""
    out = tmp_path / "d.json"
    bench.main(["--device", "cpu", "--iters", "1", "--warmup", "0", "--out", str(out)])
    recs = json.loads(out.read_text())
    assert {r["shape"] for r in recs} == {"tiny"}
    assert {r["tokens_per_rank"] for r in recs} == {64}


@pytest.mark.parametrize("n_impls", [2, 3, 4])
def test_measure_rotates_the_order(n_impls):
    """Timed iterations rotate the implementations (A B, B A for two; A B C, B C A, C A B for three):
    over n iterations each one runs once in every position of the forward and forward+backward loops."""
    p = bench.make_problem("tiny", 16, "cpu", seed=1)
    calls = []

    def make(name):
        def fn(x, ids, w, gu, dn):
            calls.append(name)
            return bench.baseline_experts(x, ids, w, gu, dn)
        return fn

    names = [f"impl{i}" for i in range(n_impls)]
    bench.measure({n: make(n) for n in names}, p, "cpu", iters=n_impls, warmup=0)
    timed = calls[-2 * n_impls * n_impls:]  # after the per-implementation memory pass: fwd loop, then fwd+bwd
    for loop in (timed[: n_impls * n_impls], timed[n_impls * n_impls:]):
        rounds = [loop[i * n_impls:(i + 1) * n_impls] for i in range(n_impls)]
        assert all(sorted(r) == names for r in rounds)  # every implementation once per iteration
        for pos in range(n_impls):
            assert sorted(r[pos] for r in rounds) == names  # and once in each position
    if n_impls == 2:
        assert timed[:4] == ["impl0", "impl1", "impl1", "impl0"]  # the A B, B A of the two-way benchmark


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_waits_for_the_others_before_teardown(tmp_path, monkeypatch, rank):
    """Under torchrun (WORLD_SIZE > 1) every rank passes a barrier before destroy_process_group (a rank
    tearing down while another still wrote the results made gloo abort); only rank 0 writes the file.
    The process group calls are recorded here instead of run."""
    import types

    import torch.distributed as dist

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append("init"))
    monkeypatch.setattr(dist, "get_rank", lambda *a, **kw: rank)
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: calls.append("destroy"))
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=object()))
    records = [{"shape": "tiny", "impl": "x", "fwd_ms": float(rank + 1)}]
    monkeypatch.setattr(bench, "run", lambda *a, **kw: calls.append("run") or records)
    monkeypatch.setattr(bench, "summary", lambda recs: calls.append("write") or "")
    out = tmp_path / "r.json"
    bench.main(["--device", "cpu", "--out", str(out)])
    assert calls == ["init", "run"] + (["write"] if rank == 0 else []) + ["barrier", "destroy"], calls
    assert out.exists() == (rank == 0)
    if rank == 0:
        assert json.loads(out.read_text()) == records


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_bench_cpu_portable_backend(tmp_path, dtype):
    """--backend torch records the portable backend beside the baseline and transformers' default experts, with
    the MXFP8 variant and the whole block, in the same schema; the implementations were checked against each
    other first (bench.run raises where they disagree)."""
    pytest.importorskip("transformers")
    out = tmp_path / "t.json"
    bench.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "48", "--iters", "1", "--warmup", "0",
                "--backend", "torch", "--dtype", dtype, "--precision", "mxfp8", "--layer", "--out", str(out)])
    recs = json.loads(out.read_text())
    assert [r["impl"] for r in recs] == ["mok_nn_torch", "mok_nn_torch_mxfp8", "mok_nn_torch_frozen",
                                         "mok_nn_torch_mxfp8_frozen", "torch_baseline", "hf_default",
                                         "mok_nn_torch_layer", "hf_default_layer"]
    for r in recs:
        assert set(r) == KEYS | {"check"}
        frozen = r["impl"].endswith("_frozen")  # no weight gradients to check
        assert set(r["check"]) == ({"y"} if r["impl"].endswith("_layer") else
                                   CHECK - {"d_gate_up", "d_down"} if frozen else CHECK)
        assert r["precision"] == ("mxfp8" if "mxfp8" in r["impl"] else dtype)
        # MXFP8 (3 mantissa bits per operand) is visibly further from the fp32 reference than the layer dtype
        if r["impl"] in ("mok_nn_torch_mxfp8", "mok_nn_torch_mxfp8_frozen"):
            assert 1e-2 < r["check"]["y"] < 0.1, r
        elif not r["impl"].endswith("_layer"):
            assert r["check"]["y"] < 1e-2, r
        assert r["fwd_ms"] > 0 and r["tokens_per_rank"] == 48


def test_hf_default_experts_match_the_fp64_oracle():
    """The hf_default row computes the benchmark's function on the benchmark's weights and routing."""
    pytest.importorskip("transformers")
    p = bench.make_problem("tiny", 40, "cpu", seed=4, dtype=torch.float32)
    y = bench.hf_experts("tiny", "cpu", torch.float32)(p["x"], p["ids"], p["w"], p["gate_up_proj"], p["down_proj"])
    ref = _fp64_experts(p)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5
