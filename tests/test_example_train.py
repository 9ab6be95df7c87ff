"""The main job: the tiny MoE LM trains (loss goes down) and is bitwise reproducible."""

import argparse
import importlib.util
import pathlib

import torch

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tiny_moe.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_tiny_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_goes_down_and_repeats_bitwise():
    ex = _load()
    args = argparse.Namespace(steps=40, batch=16, seq_len=16, vocab=12, experts=4, top_k=2, lr=5e-3, seed=3)
    first, _ = ex.train(args, torch.device("cpu"), verbose=False)
    second, _ = ex.train(args, torch.device("cpu"), verbose=False)
    assert first == second, "two runs with the same seed must give bitwise-identical losses"
    assert sum(first[-5:]) / 5 < sum(first[:5]) / 5 - 0.05, first
    args.seed = 4
    other, _ = ex.train(args, torch.device("cpu"), verbose=False)
    assert other != first
