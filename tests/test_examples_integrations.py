"""The integration examples run (tiny config-built models, CPU)."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_experts_implementation_example(capsys):
    pytest.importorskip("transformers.integrations.moe")
    diff, losses = _load("hf_experts_implementation").main(["--steps", "3", "--device", "cpu"])
    assert diff < 1e-4 and losses[-1] < losses[0]
    assert "experts_implementation='mok'" in capsys.readouterr().out


def test_torchtitan_swap_example():
    pytest.importorskip("torchtitan.models.common.moe")
    out, grad = _load("torchtitan_swap").main(["--device", "cpu"])
    assert out < 1e-2 and grad < 2e-2
