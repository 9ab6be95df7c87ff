"""`python -m mok_nn.bench --peers`: each peer in its own process on the benchmark's problem, checked against the
float32 reference before timing, skipped with a reason where it cannot run (mok_nn/bench_peers.py). CPU, tiny
shape; the fake peers below are written into a module the peers' processes import (`module:Class`)."""

import json
import sys
import textwrap

import pytest
import torch

from mok_nn import bench, bench_peers

KEYS = {"shape", "ep", "tokens_per_rank", "impl", "precision", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops",
        "peak_mem_gb", "act_mem_gb", "gpu", "torch", "commit", "date"}  # fmt: skip

FAKE_PEERS = '''
import os

import torch

from mok_nn import bench
from mok_nn.bench_peers import Peer


def _log(what):
    if os.environ.get("FAKE_PEER_LOG"):
        with open(os.environ["FAKE_PEER_LOG"], "a") as f:
            f.write(what + "\\n")


class Right(Peer):
    """The torch baseline under another name."""
    name = "right_peer"

    def experts(self, x, ids, w, gate_up, down):
        _log("right")
        return bench.baseline_experts(x, ids, w, gate_up, down)


class Wrong(Peer):
    """gate and up swapped: a plausible layout bug, wrong by O(1)."""
    name = "wrong_peer"

    def experts(self, x, ids, w, gate_up, down):
        _log("wrong")
        gate, up = gate_up.chunk(2, dim=1)
        return bench.baseline_experts(x, ids, w, torch.cat([up, gate], dim=1), down)


class WrongGrad(Peer):
    """Right forward, the down projection's gradient halved: only the gradient check can see it."""
    name = "wrong_grad_peer"

    def experts(self, x, ids, w, gate_up, down):
        _log("wrong_grad")
        half = down * 0.5 + (down * 0.5).detach()  # value: down; gradient: half of it
        return bench.baseline_experts(x, ids, w, gate_up, half)


class Unimportable(Peer):
    name = "unimportable_peer"

    def __init__(self, shape, device, dtype):
        import fake_dsl_that_is_not_installed  # noqa: F401
'''


@pytest.fixture
def fake_peers(tmp_path, monkeypatch):
    mod = tmp_path / "fake_peers_mod.py"
    mod.write_text(FAKE_PEERS)
    log = tmp_path / "calls.log"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the peers' processes (bench_peers puts mok_nn's root first)
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    yield log
    sys.modules.pop("fake_peers_mod", None)


def _calls(log):
    return log.read_text().split() if log.exists() else []


def test_peers_each_in_its_own_process(tmp_path):
    """--peers hf --layer: transformers' default experts and block in a subprocess (routed experts and whole
    layer), records in the benchmark's schema, each checked against the fp32 reference first (--peers-only: the
    rows of mok_nn and the baseline are test_bench.py's)."""
    pytest.importorskip("transformers")
    out = tmp_path / "p.json"
    bench.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "32", "--iters", "2", "--warmup", "1", "--layer",
                "--peers", "hf", "--peers-only", "--out", str(out)])
    recs = {r["impl"]: r for r in json.loads(out.read_text())}
    assert list(recs) == ["hf_default", "hf_default_layer"]
    for r in recs.values():
        assert KEYS <= set(r), KEYS - set(r)
        assert r["shape"] == "tiny" and r["tokens_per_rank"] == 32 and r["ep"] == 1 and r["precision"] == "bf16"
        assert "skipped" not in r and r["fwd_ms"] > 0
        assert max(r["check"].values()) < 2e-2, r["check"]  # against the fp32 reference
    assert set(recs["hf_default"]["check"]) == {"y", "dx", "dw", "d_gate_up", "d_down"}
    assert set(recs["hf_default_layer"]["check"]) == {"y"}
    assert recs["hf_default"]["timed"] and recs["hf_default"]["versions"]["transformers"]


def test_a_wrong_peer_is_rejected_before_timing(fake_peers, capsys):
    """A fake peer with gate and up swapped fails the check: a record saying so, no times, and it never ran
    beyond the check's forward (routed experts, then the whole layer's forward check)."""
    recs = bench_peers.run_peer("fake_peers_mod:Wrong", ["tiny"], 32, "cpu", iters=2, warmup=0, layer=True)
    assert [r["impl"] for r in recs] == ["wrong_peer", "wrong_peer_layer"]
    for r in recs:
        assert KEYS <= set(r) and r["fwd_ms"] is None
        assert r["skipped"].startswith("check failed (not timed)") and r["check"]["y"] > 0.1
    assert _calls(fake_peers) == ["wrong", "wrong"]  # the two checks' forwards: no warm-up (0), no timing
    assert "skip wrong_peer tiny: check failed" in capsys.readouterr().out


def test_an_unimportable_peer_is_skipped_with_the_reason(fake_peers, capsys):
    recs = bench_peers.run_peer("fake_peers_mod:Unimportable", ["tiny"], 16, "cpu", iters=1, warmup=0)
    (r,) = recs
    assert KEYS <= set(r) and r["fwd_ms"] is None
    assert r["skipped"] == "not importable: ModuleNotFoundError: No module named 'fake_dsl_that_is_not_installed'"
    assert f"skip unimportable_peer tiny: {r['skipped']}" in capsys.readouterr().out


def test_a_wrong_gradient_is_rejected_too(fake_peers):
    """The check covers every gradient, not only the output (in this process: run_peer, what the subprocess runs)."""
    recs = bench_peers.run_peer("fake_peers_mod:WrongGrad", ["tiny"], 32, "cpu", iters=2, warmup=0)
    (r,) = recs
    assert r["skipped"].startswith("check failed (not timed)") and "d_down" in r["skipped"]
    assert r["check"]["y"] < 2e-2 and r["check"]["d_down"] > 0.1
    assert _calls(fake_peers) == ["wrong_grad"]


def test_a_right_peer_is_warmed_up_checked_then_timed(fake_peers):
    recs = bench_peers.run_peer("fake_peers_mod:Right", ["tiny"], 32, "cpu", iters=3, warmup=2, commit="abc")
    (r,) = recs
    assert KEYS <= set(r) and "skipped" not in r and r["commit"] == "abc"
    assert max(r["check"].values()) < 2e-2
    # 2 warm-up, 1 check, 1 more warm-up, then 3 forwards and 3 forward+backwards (no memory pass on CPU)
    assert _calls(fake_peers) == ["right"] * (2 + 1 + 1 + 3 + 3)


@pytest.mark.parametrize("peer", ["sonicmoe", "liger"])
def test_gpu_peers_are_skipped_on_cpu_with_the_reason(peer, capsys):
    """SonicMoE and Liger: 'not importable: ...' where their packages are missing, else 'needs a CUDA device'."""
    recs = bench_peers.run_peer(peer, ["tiny"], 16, "cpu", iters=1, warmup=0, layer=True)
    assert [r["impl"] for r in recs] == [peer, peer + "_layer"]
    for r in recs:
        assert KEYS <= set(r) and r["fwd_ms"] is None
        assert r["skipped"].startswith("not importable") or r["skipped"] == "needs a CUDA device"
    assert f"skip {peer} tiny: {recs[0]['skipped']}" in capsys.readouterr().out


def test_a_peer_process_that_dies_leaves_skipped_records(tmp_path, monkeypatch):
    """A peer's process that ends without records (crash, time limit) gets one skipped record per shape and mode."""
    mod = tmp_path / "dying_peer_mod.py"
    mod.write_text(textwrap.dedent('''
        import os
        from mok_nn.bench_peers import Peer

        class Dies(Peer):
            name = "dying_peer"

            def __init__(self, shape, device, dtype):
                os._exit(7)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    recs = bench_peers.run_subprocesses(["dying_peer_mod:Dies"], ["tiny"], 16, "cpu", iters=1, warmup=0, layer=True)
    assert [(r["impl"], r["skipped"]) for r in recs] == [("dying_peer", "no record from its process (exit 7)"),
                                                         ("dying_peer_layer", "no record from its process (exit 7)")]
    sys.modules.pop("dying_peer_mod", None)


def test_hf_peer_is_the_hf_default_row(monkeypatch):
    """--peers hf and the hf_default row of --backend torch are the same code (bench_peers.HfPeer); with both flags
    hf runs once, in the process of the other rows."""
    pytest.importorskip("transformers")
    p = bench.make_problem("tiny", 24, "cpu", seed=2, dtype=torch.float32)
    args = (p["x"], p["ids"], p["w"], p["gate_up_proj"], p["down_proj"])
    peer = bench_peers.HfPeer("tiny", "cpu", torch.float32)
    assert torch.equal(bench.hf_experts("tiny", "cpu", torch.float32)(*args), peer.experts(*args))
    spawned = []
    monkeypatch.setattr(bench_peers, "run_subprocesses", lambda peers, *a, **k: spawned.append(list(peers)) or [])
    bench.run(["tiny"], 16, "cpu", 1, 0, backend="torch", peers=["hf", "liger"], check=False)
    assert spawned == [["liger"]]
    spawned.clear()
    bench.run(["tiny"], 16, "cpu", 1, 0, peers=["hf"], peers_only=True)
    assert spawned == [["hf"]]


def test_unknown_peer_is_an_error():
    with pytest.raises(ValueError, match="unknown peer"):
        bench.run(["tiny"], 16, "cpu", 1, 0, peers=["nope"])


def test_reference_layer_check_sees_a_wrong_router():
    """The whole-layer check compares with the fp32 reference layer: another router weight is caught."""
    p = bench.make_problem("tiny", 64, "cpu", dtype=torch.float32)
    cp = bench_peers.check_problem(p, 64)
    rw = p["router"]
    layer = bench.mok_layer("tiny", "torch", torch.float32)
    with torch.no_grad():
        good = layer(cp["x"], rw, cp["gate_up_proj"], cp["down_proj"])
        bad = layer(cp["x"], rw.flip(0), cp["gate_up_proj"], cp["down_proj"])
    assert bench_peers.reference_layer_check(cp, good, rw)[0]["y"] < 1e-4
    assert bench_peers.reference_layer_check(cp, bad, rw)[0]["y"] > 0.1


def test_layer_check_takes_the_layers_own_routing():
    """transformers' block routes with bf16 logits, which pick other experts than the fp32 router for near-ties:
    checked under the routing it picked, its output agrees with the fp32 reference experts, the share of
    rerouted tokens is counted, and a routing it did not pick is caught."""
    pytest.importorskip("transformers.models.qwen3_moe")
    p = bench.make_problem("tiny", 512, "cpu", dtype=torch.bfloat16)
    cp = bench_peers.check_problem(p, 512)
    rw = p["router"].to(torch.bfloat16)
    k = cp["ids"].shape[1]
    hf = bench_peers.HfPeer("tiny", "cpu", torch.bfloat16)
    with torch.no_grad():
        y = hf.layer(cp["x"], rw, cp["gate_up_proj"], cp["down_proj"], k)
        ids, w = hf.routing(cp["x"], rw, k)
    errs, rerouted = bench_peers.reference_layer_check(cp, y, rw, (ids, w))
    assert errs["y"] < bench_peers.LAYER_CHECK_TOL
    fp32_ids = torch.topk(cp["x"].float() @ rw.float().T, k, dim=-1).indices.sort(-1).values
    assert rerouted == (ids.sort(-1).values != fp32_ids).any(-1).float().mean().item()
    assert bench_peers.reference_layer_check(cp, y, rw, (ids.roll(1, dims=0), w.roll(1, dims=0)))[0]["y"] > 0.1


def test_the_peers_budget_bounds_their_processes(monkeypatch):
    """--peer-budget: a peer that would get under 30 s of what is left is not started; its records say so."""
    import types

    clock, started = [1000.0], []

    def run_one(cmd, env, out, spec, limit):  # takes 15 s of its limit, reports nothing
        started.append(limit)
        clock[0] += 15
        return 0, []

    monkeypatch.setattr(bench_peers, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    monkeypatch.setattr(bench_peers, "_run_one", run_one)
    recs = bench_peers.run_subprocesses(["hf", "liger"], ["tiny"], 16, "cpu", timeout=600, budget=40)
    assert started == [40]  # hf got the budget (under its timeout); 25 s were left for liger: not started
    assert [r["impl"] for r in recs] == ["hf_default", "liger"]
    assert recs[0]["skipped"] == "no record from its process (exit 0)"
    assert recs[1]["skipped"] == "no record from its process (exit not started: 25 s left of the peers' budget)"
