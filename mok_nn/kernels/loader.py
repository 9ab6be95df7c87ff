"""Find, (build,) load and call the prebuilt kernel library.

Search order for `libmok_kernels.so` + `manifest.json`:
an explicit `lib_dir` argument, then `$MOK_KERNEL_CACHE/<arch>` (or
`$MOK_KERNEL_CACHE` itself if it directly holds the library), then
`~/.cache/mok_nn/kernels/<arch>` (XDG_CACHE_HOME respected). A library whose
manifest names another source hash than this checkout's kernels is stale and
is not used. Where none is usable and the CuTe DSL is importable, the library
is compiled once into the cache (a child process, so the DSL never shares a
process with CUDA state); otherwise a KernelLibraryError names the build
command.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys
import threading

from . import registry

_ABI_VERSION = 1


class KernelLibraryError(RuntimeError):
    pass


def default_cache_dir(arch: str = "sm_90a") -> pathlib.Path:
    root = os.environ.get("MOK_KERNEL_CACHE")
    if root:
        return pathlib.Path(root) / arch
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "mok_nn" / "kernels" / arch


def _candidates(arch: str, lib_dir):
    if lib_dir is not None:
        return [pathlib.Path(lib_dir)]
    c = []
    root = os.environ.get("MOK_KERNEL_CACHE")
    if root:
        c += [pathlib.Path(root) / arch, pathlib.Path(root)]
    c.append(default_cache_dir(arch) if not root else pathlib.Path(root) / arch)
    return list(dict.fromkeys(c))


def _usable(d: pathlib.Path, arch: str) -> tuple[bool, str]:
    lib, man = d / registry.LIB_NAME, d / registry.MANIFEST
    if not lib.is_file() or not man.is_file():
        return False, f"no {registry.LIB_NAME} in {d}"
    m = json.loads(man.read_text())
    if m.get("arch") != arch:
        return False, f"{d} holds kernels for {m.get('arch')}, not {arch}"
    if m.get("source_hash") != registry.source_hash():
        return False, f"{d} holds kernels built from other sources (stale)"
    missing = set(registry.SPECS_BY_NAME) - set(m.get("kernels", []))
    if missing:
        return False, f"{d} lacks kernels {sorted(missing)}"
    return True, ""


def _dsl_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None


class KernelLibrary:
    """The loaded library; `launch(name, *args, stream)` calls one kernel."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        if self._lib.mok_abi_version() != _ABI_VERSION:
            raise KernelLibraryError(f"{path} has another ABI version; rebuild it")
        self._lib.mok_error_string.restype = ctypes.c_char_p
        self._fns = {}
        for name in registry.SPECS_BY_NAME:
            fn = getattr(self._lib, f"{name}_launch")
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            fn.restype = ctypes.c_int
            self._fns[name] = fn

    def launch(self, name: str, *args, stream: int) -> None:
        """args: torch tensors / python scalars in the order of the spec; stream: cudaStream_t as int."""
        spec = registry.SPECS_BY_NAME[name]
        if len(args) != len(spec.args):
            raise TypeError(f"{name} takes {len(spec.args)} arguments, got {len(args)}")
        keep = []  # ctypes objects must outlive the call
        for a, t in zip(spec.args, args):
            keep.append(_to_ctypes(a, t, name))
        keep.append(ctypes.c_void_p(stream))
        ptrs = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.pointer(k), ctypes.c_void_p) for k in keep])
        rc = self._fns[name](ptrs)
        if rc != 0:
            msg = self._lib.mok_error_string(rc).decode()
            raise KernelLibraryError(f"{name} failed to launch: {msg} ({rc})")


_TORCH_DTYPES = {"bf16": "bfloat16", "f32": "float32", "i32": "int32", "i64": "int64"}


def _to_ctypes(a, t, kname: str):
    if isinstance(a, registry.ScalarArg):
        return ctypes.c_int32(int(t)) if a.dtype == "i32" else ctypes.c_float(float(t))
    import torch

    want = getattr(torch, _TORCH_DTYPES[a.dtype])
    if t.dtype != want:
        raise TypeError(f"{kname}.{a.name}: dtype {t.dtype}, expected {want}")
    if t.dim() != len(a.shape):
        raise ValueError(f"{kname}.{a.name}: {t.dim()} dims, expected {len(a.shape)}")
    if not t.is_cuda:
        raise ValueError(f"{kname}.{a.name}: must be a CUDA tensor")
    if t.data_ptr() % a.align:
        raise ValueError(f"{kname}.{a.name}: data pointer not {a.align}-byte aligned")
    size, stride = t.shape, t.stride()
    for i, (s, st) in enumerate(zip(a.shape, a.stride)):
        if s != registry.DYN and size[i] != s:
            raise ValueError(f"{kname}.{a.name}: mode {i} has extent {size[i]}, expected {s}")
        if st != registry.DYN and size[i] > 1 and stride[i] != st:
            raise ValueError(f"{kname}.{a.name}: mode {i} has stride {stride[i]}, expected {st}")
        if st == registry.DYN and a.dtype == "bf16" and size[i] > 1 and stride[i] % 8:
            raise ValueError(f"{kname}.{a.name}: stride {stride[i]} of mode {i} not a multiple of 8 (16 bytes)")
        if a.divisibility and s == registry.DYN and size[i] % a.divisibility[i]:
            raise ValueError(f"{kname}.{a.name}: extent {size[i]} of mode {i} not a multiple of {a.divisibility[i]}")
    shapes = [size[i] for i in a.dyn_shape_modes()]
    strides = [stride[i] for i in a.dyn_stride_modes()]
    fields = [("data", ctypes.c_void_p)]
    if shapes:
        fields.append(("shapes", ctypes.c_int32 * len(shapes)))
    if strides:
        fields.append(("strides", ctypes.c_int64 * len(strides)))
    S = type("Arg", (ctypes.Structure,), {"_fields_": fields})
    s = S()
    s.data = t.data_ptr()
    if shapes:
        s.shapes = (ctypes.c_int32 * len(shapes))(*shapes)
    if strides:
        s.strides = (ctypes.c_int64 * len(strides))(*strides)
    return s


_lock = threading.Lock()
_loaded: dict = {}


def load(arch: str = "sm_90a", lib_dir=None, build_if_missing: bool = True) -> KernelLibrary:
    key = (arch, str(lib_dir))
    with _lock:
        if key in _loaded:
            return _loaded[key]
        reasons = []
        for d in _candidates(arch, lib_dir):
            ok, why = _usable(d, arch)
            if ok:
                _loaded[key] = KernelLibrary(d / registry.LIB_NAME)
                return _loaded[key]
            reasons.append(why)
        target = pathlib.Path(lib_dir) if lib_dir is not None else default_cache_dir(arch)
        cmd = registry.BUILD_COMMAND.format(arch=arch, out=target)
        if not (build_if_missing and _dsl_importable()):
            raise KernelLibraryError(
                "mok_nn CUDA kernels are not built (" + "; ".join(reasons) + "). "
                f"Install nvidia-cutlass-dsl[cu13]==4.8.1 and run: {cmd}"
            )
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        r = subprocess.run(
            [sys.executable, "-m", "mok_nn.kernels.build", "--arch", arch, "--out", str(target)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode != 0:
            raise KernelLibraryError(f"building the kernels failed ({cmd}):\n{r.stderr[-4000:]}")
        ok, why = _usable(target, arch)
        if not ok:
            raise KernelLibraryError(f"built kernels are unusable: {why}")
        _loaded[key] = KernelLibrary(target / registry.LIB_NAME)
        return _loaded[key]
