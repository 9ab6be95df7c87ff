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


def _main(ex, argv):
    """ex.main(argv), restoring the global deterministic-algorithms flag it sets."""
    before = torch.are_deterministic_algorithms_enabled()
    try:
        return ex.main(argv)
    finally:
        torch.use_deterministic_algorithms(before)


def test_short_run_compares_half_the_steps_each(capsys):
    """With fewer than 20 steps the printed first/last averages are over steps // 2 steps each, and the
    line says how many; the values are those of train() with the same arguments."""
    import re

    ex = _load()
    seed = int(torch.randint(0, 1000, ()))
    for steps in (5, 7):
        args = argparse.Namespace(steps=steps, batch=4, seq_len=8, vocab=8, experts=4, top_k=2, lr=5e-3, seed=seed)
        losses, _ = ex.train(args, torch.device("cpu"), verbose=False)
        capsys.readouterr()
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()] + ["--no-repeat", "--device=cpu"]
        rc = _main(ex, argv)
        out = capsys.readouterr().out
        n = steps // 2
        m = re.search(r"loss: first (\d+) steps (\d+\.\d{4}) -> last (\d+) steps (\d+\.\d{4})", out)
        assert m, out
        assert int(m.group(1)) == n and int(m.group(3)) == n
        assert m.group(2) == f"{sum(losses[:n]) / n:.4f}" and m.group(4) == f"{sum(losses[-n:]) / n:.4f}"
        assert rc == (0 if sum(losses[-n:]) < sum(losses[:n]) else 1)


def test_unusable_arguments_are_argparse_errors(capsys):
    import pytest

    ex = _load()
    for argv, name in ((["--steps", "0"], "--steps"), (["--steps", "-4"], "--steps"), (["--steps", "1"], "--steps"),
                       (["--batch", "0"], "--batch"), (["--vocab", "1"], "--vocab"), (["--seq-len", "0"], "--seq-len"),
                       (["--experts", "0"], "--experts"), (["--top-k", "3", "--experts", "2"], "--top-k"),
                       (["--lr", "-1"], "--lr"), (["--device", "bogus"], "--device")):
        with pytest.raises(SystemExit) as info:
            _main(ex, argv + ["--no-repeat"])
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"error: {name}" in err, (argv, err)
