"""Ahead-of-time build of every kernel for sm_90a (no GPU needed) and the loader's lookup."""

import ctypes
import importlib.util
import json

import pytest

from mok_nn.kernels import loader, registry

HAVE_DSL = importlib.util.find_spec("cutlass") is not None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not HAVE_DSL:
        pytest.skip("nvidia-cutlass-dsl not installed")
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("kernels")
    # A child process: the DSL latches its target arch at import.
    r = subprocess.run(
        [sys.executable, "-m", "mok_nn.kernels.build", "--arch", "sm_90a", "--out", str(out)],
        capture_output=True, text=True, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_build_exports_every_kernel(built):
    lib = ctypes.CDLL(str(built / registry.LIB_NAME))
    assert lib.mok_abi_version() == 1
    for spec in registry.SPECS:
        assert hasattr(lib, f"{spec.name}_launch"), spec.name
    man = json.loads((built / registry.MANIFEST).read_text())
    assert man["arch"] == "sm_90a"
    assert man["source_hash"] == registry.source_hash()
    assert set(man["kernels"]) == set(registry.SPECS_BY_NAME)


def test_loader_finds_library(built, monkeypatch):
    monkeypatch.setattr(loader, "_loaded", {})
    lib = loader.load("sm_90a", lib_dir=built, build_if_missing=False)
    assert lib.path == built / registry.LIB_NAME
    monkeypatch.setenv("MOK_KERNEL_CACHE", str(built))  # a cache dir holding the library directly
    monkeypatch.setattr(loader, "_loaded", {})
    assert loader.load("sm_90a", build_if_missing=False).path == built / registry.LIB_NAME


def test_loader_rejects_stale_library(built, tmp_path, monkeypatch):
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / registry.LIB_NAME).write_bytes((built / registry.LIB_NAME).read_bytes())
    man = json.loads((built / registry.MANIFEST).read_text())
    man["source_hash"] = "0" * 16
    (stale / registry.MANIFEST).write_text(json.dumps(man))
    monkeypatch.setattr(loader, "_loaded", {})
    with pytest.raises(loader.KernelLibraryError, match="stale"):
        loader.load("sm_90a", lib_dir=stale, build_if_missing=False)


def test_loader_error_names_build_command(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(loader, "_dsl_importable", lambda: False)
    with pytest.raises(loader.KernelLibraryError, match="python -m mok_nn.kernels.build --arch sm_90a"):
        loader.load("sm_90a", lib_dir=tmp_path / "empty")
