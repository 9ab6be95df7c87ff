"""benchmarks/fingerprint.py: its compare mode's verdicts and exit status, and its configurations at the
tiny scale on the CPU reference path."""
import importlib.util
import json
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "fingerprint.py"


@pytest.fixture(scope="module")
def fp():
    spec = importlib.util.spec_from_file_location("fingerprint", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def test_compare_equal_files_exit_zero(fp, tmp_path, capsys):
    data = {"qwen3": {"y": "aa", "x.grad": "bb"}}
    assert fp.main(["--compare", write(tmp_path / "a.json", data), write(tmp_path / "b.json", data)]) == 0
    assert "all equal" in capsys.readouterr().out


def test_compare_different_or_missing_exit_one(fp, tmp_path, capsys):
    a = write(tmp_path / "a.json", {"qwen3": {"y": "aa", "x.grad": "bb"}})
    b = write(tmp_path / "b.json", {"qwen3": {"y": "aa", "x.grad": "cc"}, "t1": {"y": "dd"}})
    assert fp.main(["--compare", a, b]) == 1
    out = capsys.readouterr().out
    assert "different" in out and "missing" in out and "2 tensor(s)" in out


def test_every_config_constructs_at_tiny_scale(fp):
    import torch

    from mok_nn import MoKMoELayer

    for tokens, kw in (fp.tiny(*c) for c in fp.CONFIGS.values()):
        assert 1 <= tokens <= 8
        MoKMoELayer(**kw, backend="reference", device="cpu", dtype=torch.bfloat16)


def test_tiny_run_on_cpu_writes_hashes_and_is_repeatable(fp, tmp_path):
    out = tmp_path / "fp.json"
    args = ["--device", "cpu", "--backend", "reference", "--scale", "tiny", "--configs", "deepseek-v3",
            "--repeat", "2", "--out", str(out)]
    assert fp.main(args) == 0
    got = json.loads(out.read_text())["deepseek-v3"]
    assert {"y", "x.grad", "router.weight.grad", "experts.gate_up_proj.grad", "experts.down_proj.grad"} <= set(got)
    assert all(len(h) == 64 for h in got.values())
