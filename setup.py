"""Build hook for the one thing pyproject.toml cannot say: a wheel that carries a prebuilt kernel library
(mok_nn/kernels/prebuilt/<arch>/libmok_kernels.so + manifest.json, README "Prebuilt kernels") is a platform wheel,
py3-none-<platform> (the library is loaded by ctypes, so any Python 3 will do). Before it is packed, every such
folder is checked against the sources being packed (its manifest's source hash, its kernel list): a wheel never
ships a library its own loader would reject. Without a prebuilt folder the wheel is py3-none-any, as before.
"""

import importlib.util
import json
import pathlib
import shutil
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PREBUILT = HERE / "mok_nn" / "kernels" / "prebuilt"


def _prebuilt_dirs() -> list:
    return sorted(d for d in PREBUILT.iterdir() if d.is_dir()) if PREBUILT.is_dir() else []


def _check_prebuilt() -> None:
    """Raise SystemExit on a prebuilt folder that does not match the sources being packed (when a wheel is packed;
    not for an editable install, whose loader merely warns about a stale library and builds its own)."""
    spec = importlib.util.spec_from_file_location("_mok_registry", HERE / "mok_nn" / "kernels" / "registry.py")
    reg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = reg  # dataclasses look their module up there
    spec.loader.exec_module(reg)
    want = reg.source_hash()
    for d in _prebuilt_dirs():
        cmd = reg.BUILD_COMMAND.format(arch=d.name, out=d.relative_to(HERE))
        if not (d / reg.LIB_NAME).is_file() or not (d / reg.MANIFEST).is_file():
            raise SystemExit(f"{d} needs {reg.LIB_NAME} and {reg.MANIFEST}: run {cmd}, or remove the folder")
        man = json.loads((d / reg.MANIFEST).read_text())
        if man.get("source_hash") != want or man.get("arch") != d.name:
            raise SystemExit(f"{d} holds a library for {man.get('arch')} built from other sources (manifest "
                             f"source_hash {man.get('source_hash')}, these sources {want}): run {cmd}")
        missing = set(reg.SPECS_BY_NAME) - set(man.get("kernels", []))
        if missing:
            raise SystemExit(f"{d} lacks kernels {sorted(missing)}: run {cmd}")


class BuildPy(build_py):
    def run(self):
        # setuptools keeps build/lib between builds: a library (or a deleted kernel module) of an earlier build
        # would ride along into this wheel, and change its source hash. Start mok_nn's copy afresh.
        if not getattr(self, "editable_mode", False):
            shutil.rmtree(pathlib.Path(self.build_lib) / "mok_nn", ignore_errors=True)
        super().run()


class KernelDistribution(Distribution):
    def has_ext_modules(self):
        # binary content: the wheel's root is platlib (Root-Is-Purelib: false), the files at its top
        return bool(_prebuilt_dirs())


cmdclass = {"build_py": BuildPy}
try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None
if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        def run(self):
            if _prebuilt_dirs():
                _check_prebuilt()
            super().run()

        def get_tag(self):
            python, abi, plat = super().get_tag()
            return ("py3", "none", plat) if _prebuilt_dirs() else (python, abi, plat)

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass, distclass=KernelDistribution)
