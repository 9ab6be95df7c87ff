"""Ahead-of-time build of every kernel for sm_90a (no GPU needed) and the loader's lookup."""

import ctypes
import importlib.util
import json

import pytest

from mok_nn.kernels import loader, registry

HAVE_DSL = importlib.util.find_spec("cutlass") is not None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One AOT build for the module, made by the loader's compile-on-first-use path."""
    if not HAVE_DSL:
        pytest.skip("nvidia-cutlass-dsl not installed")
    out = tmp_path_factory.mktemp("kernels")
    loader._loaded.clear()
    lib = loader.load("sm_90a", lib_dir=out, build_if_missing=True)  # runs python -m mok_nn.kernels.build
    assert lib.path == out / registry.LIB_NAME
    loader._loaded.clear()
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


def test_registry_stays_within_its_budget_and_the_docs_count():
    """At most 39 kernels (the product's budget: every variant is a default of some GEMM or precision, or an
    oracle; 35 for bf16, 4 for MXFP8-only weights: 2 forward GEMMs, 2 dgrad GEMMs of precision="mxfp8"), and
    docs/kernels.md says how many there are."""
    import pathlib

    from mok_nn.kernels import registry

    n = len(registry.SPECS)
    assert n <= 39, f"{n} kernels: over the budget of 39 (docs/kernels.md); drop a variant before adding one"
    assert len(registry.SPECS_BY_NAME) == n  # no two variants share a name
    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    assert f"run as {n} CUDA kernels" in doc and f"the {n} kernel variants" in doc
