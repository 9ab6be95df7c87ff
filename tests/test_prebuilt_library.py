"""The packaged (prebuilt) kernel library: the loader's order (lib_dir; $MOK_KERNEL_CACHE; the packaged
mok_nn/kernels/prebuilt/<arch>; the default cache; a build) and its source-hash check, on fake library folders
(nothing is compiled or loaded: KernelLibrary is replaced by a recorder); and registry.source_hash giving the same
hash in a checkout's layout (csrc/ beside mok_nn/) and an installed wheel's (mok_nn/kernels/csrc/)."""

import importlib.util
import json
import pathlib
import shutil
import sys

import pytest

from mok_nn.kernels import loader, registry

ARCH = "sm_90a"
STALE = "0" * 16


def make_lib(d: pathlib.Path, source_hash=None, kernels=None, arch=ARCH) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / registry.LIB_NAME).write_bytes(b"not a real library")
    man = {"arch": arch, "source_hash": source_hash or registry.source_hash(), "dsl_version": "test",
           "kernels": list(registry.SPECS_BY_NAME) if kernels is None else kernels}
    (d / registry.MANIFEST).write_text(json.dumps(man))
    return d


class FakeLibrary:
    def __init__(self, path):
        self.path = pathlib.Path(path)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """packaged / default cache / explicit cache folders under tmp_path; nothing built, no DSL, no real dlopen."""
    d = {"packaged": tmp_path / "site" / "prebuilt" / ARCH, "cache": tmp_path / "xdg" / "mok_nn" / "kernels" / ARCH,
         "explicit": tmp_path / "explicit"}
    monkeypatch.setattr(loader, "packaged_dir", lambda arch=ARCH: tmp_path / "site" / "prebuilt" / arch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MOK_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(loader, "KernelLibrary", FakeLibrary)
    monkeypatch.setattr(loader, "_dsl_importable", lambda: False)
    builds = []
    d["builds"] = builds

    def no_build(arch, target, cmd):
        builds.append(target)
        raise AssertionError("no build expected")

    monkeypatch.setattr(loader, "_build_in_child", no_build)
    return d


def test_packaged_dir_is_beside_the_loader():
    assert loader.packaged_dir(ARCH) == pathlib.Path(loader.__file__).resolve().parent / "prebuilt" / ARCH


def test_packaged_before_default_cache(dirs):
    make_lib(dirs["packaged"])
    make_lib(dirs["cache"])
    assert loader.load(ARCH).path == dirs["packaged"] / registry.LIB_NAME


def test_explicit_cache_before_packaged(dirs, monkeypatch):
    make_lib(dirs["packaged"])
    make_lib(dirs["explicit"] / ARCH)
    monkeypatch.setenv("MOK_KERNEL_CACHE", str(dirs["explicit"]))
    assert loader.load(ARCH).path == dirs["explicit"] / ARCH / registry.LIB_NAME


def test_explicit_cache_holding_the_library_itself(dirs, monkeypatch):
    make_lib(dirs["packaged"])
    make_lib(dirs["explicit"])
    monkeypatch.setenv("MOK_KERNEL_CACHE", str(dirs["explicit"]))
    assert loader.load(ARCH).path == dirs["explicit"] / registry.LIB_NAME


def test_packaged_before_building(dirs, monkeypatch):
    """An empty MOK_KERNEL_CACHE and the DSL at hand: the packaged library is used, nothing is built."""
    make_lib(dirs["packaged"])
    (dirs["explicit"]).mkdir()
    monkeypatch.setenv("MOK_KERNEL_CACHE", str(dirs["explicit"]))
    monkeypatch.setattr(loader, "_dsl_importable", lambda: True)
    assert loader.load(ARCH).path == dirs["packaged"] / registry.LIB_NAME
    assert dirs["builds"] == []


def test_lib_dir_argument_ignores_packaged(dirs, tmp_path):
    make_lib(dirs["packaged"])
    with pytest.raises(loader.KernelLibraryError, match="not built"):
        loader.load(ARCH, lib_dir=tmp_path / "empty")


@pytest.mark.parametrize("bad", ["hash", "kernels", "arch"])
def test_unusable_packaged_falls_back_to_cache_with_warning(dirs, bad):
    kw = {"hash": {"source_hash": STALE}, "kernels": {"kernels": list(registry.SPECS_BY_NAME)[1:]},
          "arch": {"arch": "sm_100a"}}[bad]
    make_lib(dirs["packaged"], **kw)
    make_lib(dirs["cache"])
    with pytest.warns(UserWarning, match="packaged library"):
        lib = loader.load(ARCH)
    assert lib.path == dirs["cache"] / registry.LIB_NAME


def test_stale_packaged_without_dsl_names_mismatch_and_build_command(dirs):
    make_lib(dirs["packaged"], source_hash=STALE)
    with pytest.warns(UserWarning, match="stale"), pytest.raises(loader.KernelLibraryError) as e:
        loader.load(ARCH)
    msg = str(e.value)
    assert "packaged library" in msg and str(dirs["packaged"]) in msg
    assert STALE in msg and registry.source_hash() in msg  # both hashes of the mismatch
    assert registry.BUILD_COMMAND.format(arch=ARCH, out=dirs["cache"]) in msg
    assert dirs["builds"] == []


def test_stale_packaged_builds_into_the_cache(dirs, monkeypatch):
    make_lib(dirs["packaged"], source_hash=STALE)
    monkeypatch.setattr(loader, "_dsl_importable", lambda: True)
    built = []

    def fake_build(arch, target, cmd):
        built.append((target, cmd))
        make_lib(target)

    monkeypatch.setattr(loader, "_build_in_child", fake_build)
    with pytest.warns(UserWarning, match="packaged library"):
        lib = loader.load(ARCH)
    assert lib.path == dirs["cache"] / registry.LIB_NAME
    assert [t for t, _ in built] == [dirs["cache"]]


def test_stale_packaged_and_failed_build_names_both(dirs, monkeypatch):
    make_lib(dirs["packaged"], source_hash=STALE)
    monkeypatch.setattr(loader, "_dsl_importable", lambda: True)

    def failing_build(arch, target, cmd):
        raise loader.KernelLibraryError(f"building the kernels failed ({cmd}):\ng++: not found")

    monkeypatch.setattr(loader, "_build_in_child", failing_build)
    with pytest.warns(UserWarning), pytest.raises(loader.KernelLibraryError) as e:
        loader.load(ARCH)
    msg = str(e.value)
    assert "building the kernels failed" in msg and registry.BUILD_COMMAND.format(arch=ARCH, out=dirs["cache"]) in msg
    assert "packaged library" in msg and STALE in msg


def test_plain_install_error_does_not_mention_a_packaged_library(dirs):
    with pytest.raises(loader.KernelLibraryError) as e:
        loader.load(ARCH)
    assert "packaged" not in str(e.value) and "python -m mok_nn.kernels.build" in str(e.value)


# --- source_hash in the two layouts ---------------------------------------------------------------------------

KERNELS = pathlib.Path(registry.__file__).resolve().parent


def _hash_of(kernels_dir: pathlib.Path, name: str):
    """(source_hash(), csrc_dir()) of the registry.py copy in kernels_dir, loaded as its own module."""
    spec = importlib.util.spec_from_file_location(name, kernels_dir / "registry.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        return mod.source_hash(), mod.csrc_dir()
    finally:
        del sys.modules[name]


def _copy_kernels(dst: pathlib.Path) -> None:
    dst.mkdir(parents=True)
    for f in KERNELS.glob("*.py"):
        shutil.copyfile(f, dst / f.name)


def test_source_hash_same_in_checkout_and_wheel_layouts(tmp_path):
    csrc = registry.csrc_dir()
    assert csrc is not None and (csrc / "mok_runtime.cpp").is_file()
    repo = tmp_path / "repo"  # a checkout: csrc/ beside mok_nn/
    _copy_kernels(repo / "mok_nn" / "kernels")
    shutil.copytree(csrc, repo / "csrc")
    site = tmp_path / "site"  # an installed wheel: csrc as package data, and a stranger's csrc/ in site-packages
    _copy_kernels(site / "mok_nn" / "kernels")
    shutil.copytree(csrc, site / "mok_nn" / "kernels" / "csrc")
    (site / "csrc").mkdir()
    (site / "csrc" / "other.cpp").write_text("// another distribution's file\n")
    (site / "mok_nn" / "kernels" / "csrc" / ".hidden.swp").write_text("not shipped, not hashed")

    h_repo, d_repo = _hash_of(repo / "mok_nn" / "kernels", "_mok_registry_repo")
    h_site, d_site = _hash_of(site / "mok_nn" / "kernels", "_mok_registry_site")
    assert d_repo == (repo / "csrc").resolve() and d_site == (site / "mok_nn" / "kernels" / "csrc").resolve()
    assert h_repo == h_site == registry.source_hash()

    (site / "mok_nn" / "kernels" / "csrc" / "mok_runtime.cpp").write_text("// edited\n")
    assert _hash_of(site / "mok_nn" / "kernels", "_mok_registry_site")[0] != h_repo  # the C glue is covered
    shutil.rmtree(site / "mok_nn" / "kernels" / "csrc")
    assert _hash_of(site / "mok_nn" / "kernels", "_mok_registry_site")[0] != h_repo  # a wheel without it differs
