"""docs/switches.md lists exactly the MOK_* environment variables the package reads."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _read_by_code() -> set:
    """Every string literal of the form MOK_NAME in mok_nn (the variables are only ever named that way)."""
    names = set()
    for f in (ROOT / "mok_nn").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"MOK_[A-Z0-9_]+",
                                                                                               node.value):
                names.add(node.value)
    return names


def _documented() -> set:
    """The variables named in the first column of docs/switches.md's tables."""
    names = set()
    for line in (ROOT / "docs" / "switches.md").read_text().splitlines():
        if line.startswith("| `MOK_"):
            names.update(re.findall(r"`(MOK_[A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_switches_doc_matches_code():
    code, doc = _read_by_code(), _documented()
    assert "MOK_KERNEL_CACHE" in code  # the scan found the switches (a broken scan would pass the comparison vacuously)
    assert len(code) <= 8, f"at most 8 MOK_* variables, got {sorted(code)}"
    assert code - doc == set(), f"read by mok_nn but not in docs/switches.md: {sorted(code - doc)}"
    assert doc - code == set(), f"in docs/switches.md but not read by mok_nn: {sorted(doc - code)}"
