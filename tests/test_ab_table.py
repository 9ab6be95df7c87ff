"""benchmarks/ab_table.py: the old / new table of the device script's A/B runs, from records written here."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import ab_table  # noqa: E402


def _record(impl, fwd, bwd, peak=None, act=None):
    return {"shape": "qwen3-30b-a3b", "ep": 1, "impl": impl, "fwd_ms": fwd, "bwd_ms": bwd, "peak_mem_gb": peak,
            "act_mem_gb": act}


def test_table_gives_medians_and_new_over_old(tmp_path):
    runs = {"old_1": (2.0, 4.0, 2.7, 0.6), "new_1": (2.2, 4.4, 1.5, 0.3), "old_2": (2.4, 4.8, 2.7, 0.6),
            "new_2": (2.0, 4.0, 1.5, 0.3), "old_3": (2.2, 4.4, 2.7, 0.6), "new_3": (1.8, 3.6, 1.5, 0.3)}
    for name, (f, b, peak, act) in runs.items():
        records = [_record("mok_nn", f, b, peak, act), _record("torch_baseline", 3.0, 5.0)]
        (tmp_path / f"ab_{name}.json").write_text(json.dumps(records))
    text = ab_table.tables(ab_table.load(tmp_path))
    lines = text.splitlines()
    assert lines[0] == "### qwen3-30b-a3b"
    assert "| old 1 | 2.000 | 4.000 | 3.000 | 5.000 | 2.700 | 0.600 |" in lines
    # medians: old fwd 2.2 bwd 4.4; new fwd 2.0 bwd 4.0; new / old 0.909, 0.909; peak 1.5 / 2.7, act 0.3 / 0.6
    assert "| old (median of 3) | 2.200 | 4.400 | | | 2.700 | 0.600 |" in lines
    assert "| new (median of 3) | 2.000 | 4.000 | | | 1.500 | 0.300 |" in lines
    assert "| new / old | 0.909 | 0.909 | | | 0.556 | 0.500 |" in lines


def test_records_without_memory_figures(tmp_path):
    """CPU runs and older trees record no memory: the table shows '-' there."""
    for name in ("old_1", "new_1"):
        (tmp_path / f"ab_{name}.json").write_text(json.dumps([_record("mok_nn", 1.0, 2.0)]))
    lines = ab_table.tables(ab_table.load(tmp_path)).splitlines()
    assert "| old 1 | 1.000 | 2.000 | - | - | - | - |" in lines
    assert "| new / old | 1.000 | 1.000 | | | - | - |" in lines


def test_every_mok_nn_implementation_gets_its_table(tmp_path):
    """--precision mxfp8 records: a table for each mok_nn implementation, compared old / new on its own."""
    runs = {"old_1": (1.0, 4.0), "new_1": (1.0, 2.0)}
    for name, (mx_fwd, mx_bwd) in runs.items():
        records = [_record("mok_nn", 1.0, 2.0), _record("mok_nn_mxfp8_frozen", mx_fwd, mx_bwd),
                   _record("torch_baseline", 3.0, 5.0)]
        (tmp_path / f"ab_{name}.json").write_text(json.dumps(records))
    text = ab_table.tables(ab_table.load(tmp_path))
    sections = text.split("### ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["qwen3-30b-a3b", "qwen3-30b-a3b, mok_nn_mxfp8_frozen"]
    assert "| new / old | 1.000 | 1.000 | | | - | - |" in sections[0].splitlines()
    assert "| new / old | 1.000 | 0.500 | | | - | - |" in sections[1].splitlines()
