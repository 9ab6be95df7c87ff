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


def _progress_run(ex):
    args = argparse.Namespace(steps=12, batch=4, seq_len=8, vocab=8, experts=4, top_k=2, lr=5e-3, seed=7)
    losses, _ = ex.train(args, torch.device("cpu"), verbose=False)
    return args, [(s, sum(losses[s - 5:s]) / 5) for s in (5, 10)] + [(12, sum(losses[7:12]) / 5)]


def test_progress_is_a_line_per_update_without_a_tty(capsys):
    """Written to a log file or a pipe (not a TTY) the progress bar gives one line per update
    (steps 5, 10 and the last), no carriage returns, with the losses of the run."""
    import re

    ex = _load()
    args, want = _progress_run(ex)
    capsys.readouterr()
    ex.train(args, torch.device("cpu"))
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) == len(want) + 1, out
    for line, (step, loss) in zip(lines, want):
        m = re.fullmatch(r"  \[[#.]{30}\] step +(\d+)/12  loss (\d+\.\d{4}) +\d+ tok/s", line)
        assert m and int(m.group(1)) == step and m.group(2) == f"{loss:.4f}", line


def test_progress_redraws_in_place_on_a_tty(capsys, monkeypatch):
    import sys

    ex = _load()
    args, want = _progress_run(ex)
    capsys.readouterr()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    ex.train(args, torch.device("cpu"))
    out = capsys.readouterr().out
    assert out.count("\r") == len(want) and out.startswith("\r") and out.endswith("\n") and out.count("\n") == 1
