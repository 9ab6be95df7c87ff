"""The kernel cache's publication and first build on one machine (CPU; no kernels are compiled here):
os.replace publication, unreadable manifests, one build for many processes."""

import json
import multiprocessing as mp
import os
import pathlib
import time

from mok_nn.kernels import loader, registry


def _fake_manifest() -> dict:
    return {"arch": "sm_90a", "source_hash": registry.source_hash(), "dsl_version": "test",
            "kernels": list(registry.SPECS_BY_NAME)}


def test_publish_replaces_and_keeps_a_loaded_copy(tmp_path):
    """build.publish puts the library and then its manifest in place by rename: a handle on the old library (a
    process that has it loaded) still reads the old bytes, the new name has the new ones, no temporary file is
    left, and the manifest is whole JSON."""
    from mok_nn.kernels import build

    out = tmp_path / "cache"
    out.mkdir()
    (out / registry.LIB_NAME).write_bytes(b"old library" * 1000)
    new_lib = tmp_path / "new.so"
    new_lib.write_bytes(b"new library" * 2000)
    with open(out / registry.LIB_NAME, "rb") as loaded:
        build.publish(new_lib, _fake_manifest(), out)
        assert loaded.read() == b"old library" * 1000
    assert (out / registry.LIB_NAME).read_bytes() == b"new library" * 2000
    assert json.loads((out / registry.MANIFEST).read_text()) == _fake_manifest()
    assert sorted(p.name for p in out.iterdir()) == sorted([registry.LIB_NAME, registry.MANIFEST])


def test_unreadable_manifest_is_unusable_not_an_error(tmp_path):
    """A half-written manifest (another process's build) makes the folder unusable with a reason; it used to
    raise JSONDecodeError, which backend='auto' took as 'no kernels' on that rank alone."""
    (tmp_path / registry.LIB_NAME).write_bytes(b"x")
    (tmp_path / registry.MANIFEST).write_text('{"arch": "sm_9')
    ok, why = loader._usable(tmp_path, "sm_90a")
    assert not ok and "unreadable" in why


def _rank(target, log, results, i):
    def fake_build():
        time.sleep(0.5)  # long enough for the other process to arrive and wait
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        lib = pathlib.Path(target) / f"built_by_{i}.so"
        lib.write_bytes(b"lib")
        from mok_nn.kernels import build

        build.publish(lib, _fake_manifest(), pathlib.Path(target))

    results.put(loader.build_once(pathlib.Path(target), "sm_90a", fake_build))


def test_one_build_for_many_processes(tmp_path):
    """loader.build_once: processes starting on an empty cache (the ranks of a torchrun job) build once, under a
    file lock in the cache folder; the others find the library usable when they get the lock."""
    target, log = tmp_path / "cache", tmp_path / "builds.log"
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(target), str(log), results, i)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    built = sorted(results.get(timeout=5) for _ in procs)
    assert built == [False, False, True]
    assert len(log.read_text().split()) == 1
    assert loader._usable(target, "sm_90a")[0]
