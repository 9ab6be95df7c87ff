"""Find, (build,) load and call the prebuilt kernel library.

Search order for `libmok_kernels.so` + `manifest.json`:
1. an explicit `lib_dir` argument (then nothing else);
2. `$MOK_KERNEL_CACHE/<arch>`, or `$MOK_KERNEL_CACHE` itself if it directly holds the library, where that
   variable is set (an explicit choice beats what was installed);
3. the packaged library, `mok_nn/kernels/prebuilt/<arch>/`, which a platform wheel carries (README,
   "Prebuilt kernels"): with it a machine that has only PyTorch runs the kernels with no build step;
4. `~/.cache/mok_nn/kernels/<arch>` (XDG_CACHE_HOME respected) where MOK_KERNEL_CACHE is unset.
A library whose manifest names another source hash than these installed sources (registry.source_hash) is
stale and is not used, the packaged one included (with a warning: reinstall a matching wheel). Where none is
usable and the CuTe DSL is importable, the library is compiled once into the cache
(`$MOK_KERNEL_CACHE/<arch>`, else the default; a child process, so the DSL never shares a process with CUDA
state); otherwise a KernelLibraryError gives every folder's reason and the build command.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import struct
import subprocess
import sys
import threading
import warnings

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


def packaged_dir(arch: str = "sm_90a") -> pathlib.Path:
    """Where a platform wheel carries the prebuilt library (package data; absent in a plain install)."""
    return pathlib.Path(__file__).resolve().parent / "prebuilt" / arch


def _candidates(arch: str, lib_dir):
    if lib_dir is not None:
        return [pathlib.Path(lib_dir)]
    c = []
    root = os.environ.get("MOK_KERNEL_CACHE")
    if root:
        c += [pathlib.Path(root) / arch, pathlib.Path(root)]
    c.append(packaged_dir(arch))
    if not root:
        c.append(default_cache_dir(arch))
    return list(dict.fromkeys(c))


def _usable(d: pathlib.Path, arch: str) -> tuple[bool, str]:
    lib, man = d / registry.LIB_NAME, d / registry.MANIFEST
    if not lib.is_file() or not man.is_file():
        return False, f"no {registry.LIB_NAME} in {d}"
    try:
        m = json.loads(man.read_text())
    except (OSError, ValueError) as e:  # e.g. a manifest being written by another process's build
        return False, f"{man} is unreadable ({e})"
    if m.get("arch") != arch:
        return False, f"{d} holds kernels for {m.get('arch')}, not {arch}"
    if m.get("source_hash") != registry.source_hash():
        return False, (f"{d} holds kernels built from other sources (stale: manifest source_hash "
                       f"{m.get('source_hash')}, installed sources {registry.source_hash()})")
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
        self._lib = ctypes.CDLL(str(path))
        if self._lib.mok_abi_version() != _ABI_VERSION:
            raise KernelLibraryError(f"{path} has another ABI version; rebuild it")
        self._lib.mok_error_string.restype = ctypes.c_char_p
        fns = {}
        for name in registry.SPECS_BY_NAME:
            fn = getattr(self._lib, f"{name}_launch")
            fn.argtypes = [ctypes.c_void_p]  # void **args: an int address or a ctypes pointer array
            fn.restype = ctypes.c_int
            fns[name] = fn
        self._init(path, fns, lambda rc: self._lib.mok_error_string(rc).decode())

    @classmethod
    def from_functions(cls, path, fns: dict, error_string) -> "KernelLibrary":
        """A library over given launch functions (name -> callable(void **args) -> int); for tests."""
        lib = cls.__new__(cls)
        lib._init(path, fns, error_string)
        return lib

    def _init(self, path, fns: dict, error_string) -> None:
        self.path = path
        self._fns = fns
        self._error_string = error_string
        self._plans = {name: _Plan(spec) for name, spec in registry.SPECS_BY_NAME.items()}

    def launch(self, name: str, *args, stream: int) -> None:
        """args: torch tensors / python scalars in the order of the spec; stream: cudaStream_t as int."""
        plan = self._plans[name]
        if len(args) != plan.nargs:
            raise TypeError(f"{name} takes {plan.nargs} arguments, got {len(args)}")
        try:
            buf, addr = plan.pack(args, stream)  # buf: the block, alive until the call has returned
        except Exception:
            # invalid or unusual arguments: the ctypes path raises its error, or converts what the
            # packed path does not (stream None, an int32 scalar out of range, ...)
            return self.launch_ctypes(name, *args, stream=stream)
        rc = self._fns[name](addr)
        if rc:
            self._raise(name, rc)

    def launch_ctypes(self, name: str, *args, stream: int) -> None:
        """`launch` with one ctypes object per argument: slower; the oracle of the packed path."""
        spec = registry.SPECS_BY_NAME[name]
        if len(args) != len(spec.args):
            raise TypeError(f"{name} takes {len(spec.args)} arguments, got {len(args)}")
        keep = []  # ctypes objects must outlive the call
        for a, t in zip(spec.args, args):
            keep.append(_to_ctypes(a, t, name))
        keep.append(ctypes.c_void_p(stream))
        ptrs = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.pointer(k), ctypes.c_void_p) for k in keep])
        rc = self._fns[name](ptrs)
        if rc:
            self._raise(name, rc)

    def _raise(self, name: str, rc: int) -> None:
        raise KernelLibraryError(f"{name} failed to launch: {self._error_string(rc)} ({rc})")


_TORCH_DTYPES = {"bf16": "bfloat16", "f32": "float32", "i32": "int32", "i64": "int64", "u8": "uint8", "u16": "uint16"}


def _to_ctypes(a, t, kname: str):
    if isinstance(a, registry.ScalarArg):
        if a.dtype == "i32":
            v = int(t)
            if not -(2**31) <= v < 2**31:  # c_int32 would wrap it silently
                raise ValueError(f"{kname}.{a.name}: {v} does not fit an int32")
            return ctypes.c_int32(v)
        return ctypes.c_float(float(t))
    check_tensor(a, t, kname)
    size, stride = t.shape, t.stride()
    shapes = [size[i] for i in a.dyn_shape_modes()]
    strides = [stride[i] for i in a.dyn_stride_modes()]
    return _struct_type(len(shapes), len(strides))(t.data_ptr(), tuple(shapes), tuple(strides))


def check_tensor(a, t, kname: str, on_device: bool = True) -> None:
    """Raise if tensor t does not fit TensorArg a. Reads t's dtype, dim (= len(shape)), is_cuda,
    data_ptr % a.align, shape and stride only: _Plan caches the outcome under these.
    on_device=False: a CPU tensor is accepted (check_launch_args for the tests' stub libraries)."""
    import torch

    want = getattr(torch, _TORCH_DTYPES[a.dtype])
    if t.dtype != want:
        raise TypeError(f"{kname}.{a.name}: dtype {t.dtype}, expected {want}")
    if t.dim() != len(a.shape):
        raise ValueError(f"{kname}.{a.name}: {t.dim()} dims, expected {len(a.shape)}")
    if on_device and not t.is_cuda:
        raise ValueError(f"{kname}.{a.name}: must be a CUDA tensor")
    if t.data_ptr() % a.align:
        raise ValueError(f"{kname}.{a.name}: data pointer not {a.align}-byte aligned")
    size, stride = t.shape, t.stride()
    if any(n >= 2**31 for n in size):  # the argument structs carry extents as int32
        raise ValueError(f"{kname}.{a.name}: extents {tuple(size)} do not fit int32")
    for i, (s, st) in enumerate(zip(a.shape, a.stride)):
        if s != registry.DYN and size[i] != s:
            raise ValueError(f"{kname}.{a.name}: mode {i} has extent {size[i]}, expected {s}")
        if st != registry.DYN and size[i] > 1 and stride[i] != st:
            raise ValueError(f"{kname}.{a.name}: mode {i} has stride {stride[i]}, expected {st}")
        if st == registry.DYN and size[i] > 1 and stride[i] % a.stride_divisibility:
            raise ValueError(f"{kname}.{a.name}: stride {stride[i]} of mode {i} not a multiple of {a.stride_divisibility}")
        if a.divisibility and s == registry.DYN and size[i] % a.divisibility[i]:
            raise ValueError(f"{kname}.{a.name}: extent {size[i]} of mode {i} not a multiple of {a.divisibility[i]}")


def check_launch_args(name: str, args, on_device: bool = True) -> None:
    """Raise if args do not fit kernel `name`'s spec: the count, each tensor as check_tensor checks it, each
    scalar a Python number of its kind (an i32 in range). What a launch's arguments must satisfy, for the
    CPU stand-ins of the library in the tests (on_device=False), so that they reject what the real one would."""
    import torch

    spec = registry.SPECS_BY_NAME[name]
    if len(args) != len(spec.args):
        raise TypeError(f"{name} takes {len(spec.args)} arguments, got {len(args)}")
    for a, v in zip(spec.args, args):
        if isinstance(a, registry.TensorArg):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{name}.{a.name}: a tensor, got {type(v).__name__}")
            check_tensor(a, v, name, on_device)
        elif a.dtype == "i32":
            if isinstance(v, bool) or not isinstance(v, int) or not -(2**31) <= v < 2**31:
                raise TypeError(f"{name}.{a.name}: an int32, got {v!r}")
        elif not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{name}.{a.name}: a float, got {v!r}")


_STRUCTS: dict = {}


def _struct_type(n_shapes: int, n_strides: int):
    """ctypes mirror of the exported `{void *data; int32_t dynamic_shapes[n]; int64_t dynamic_strides[m];}`."""
    key = (n_shapes, n_strides)
    if key not in _STRUCTS:
        fields = [("data", ctypes.c_void_p), ("shapes", ctypes.c_int32 * max(n_shapes, 0))]
        if n_strides:
            fields.append(("strides", ctypes.c_int64 * n_strides))
        if not n_shapes:
            fields.pop(1)

        class Arg(ctypes.Structure):
            _fields_ = fields

            def __init__(self, data, shapes, strides):
                super().__init__()
                self.data = data
                if n_shapes:
                    self.shapes[:] = shapes
                if n_strides:
                    self.strides[:] = strides

        _STRUCTS[key] = Arg
    return _STRUCTS[key]


class _Plan:
    """The argument block of one kernel, laid out once; `pack` fills a fresh copy per call.

    The block: the `void *args[]` array (one pointer per argument, stream last), then per argument
    what its pointer points at: a tensor's `{void *data; int32_t shapes[n]; int64_t strides[m];}`
    (natural C alignment, as `_struct_type`), an int32 / float scalar, the stream (a pointer).
    One `struct.pack_into` writes it all. The tensor checks run once per signature of the call
    (everything `check_tensor` reads, per tensor), not on every call.

    `pack` is generated per kernel as straight-line code (`pack_source` holds it, from the first call): the same reads
    of every tensor (shape, stride(), data_ptr(), dtype, is_cuda) and the same block, without the
    loop, list building and per-argument branches of a generic packer, which cost about twice the
    host time per launch (the EP forward waits for the host before its first GEMM; every us there
    is an us of the step). The ctypes path (`KernelLibrary.launch_ctypes`) is its test oracle.
    """

    _MAX_SIGNATURES = 4096  # validated call signatures kept per kernel (then forgotten, re-checked)

    def __init__(self, spec: registry.KernelSpec):
        assert ctypes.sizeof(ctypes.c_void_p) == 8, "the argument block assumes 64-bit pointers"
        self.spec = spec
        self.nargs = len(spec.args)
        nptr = self.nargs + 1
        fmt, off, offsets, items = "=" + "Q" * nptr, 8 * nptr, [], []
        for a in spec.args:
            offsets.append(off)
            if isinstance(a, registry.ScalarArg):
                fmt += ("i" if a.dtype == "i32" else "f") + "4x"
                off += 8
                items.append(None)
                continue
            sm, tm = tuple(a.dyn_shape_modes()), tuple(a.dyn_stride_modes())
            size = 8 + 4 * len(sm)
            fmt += "Q" + "i" * len(sm)
            if tm:  # int64 strides start 8-aligned
                fmt += f"{-size % 8}x" + "q" * len(tm)
                size += -size % 8 + 8 * len(tm)
            fmt += f"{-size % 8}x"  # the struct's size is a multiple of its alignment, 8
            off += size + -size % 8
            items.append((a.align, sm, tm))
        offsets.append(off)
        fmt += "Q"
        off += 8
        self._struct = struct.Struct(fmt)
        assert self._struct.size == off
        self._buf_type = ctypes.c_char * off
        self._offsets, self._items = tuple(offsets), tuple(items)
        self._valid = set()

    def pack(self, args, stream):
        """(buffer, address of its `void *args[]`); the buffer must live until the launch returns.
        The first call generates the kernel's packer (compiling it takes ~0.3 ms: only kernels that
        run pay it), which then replaces this method on the instance."""
        self.pack_source = self._source()
        namespace = {"valid": self._valid, "validate": self._validate, "buf_type": self._buf_type,
                     "addressof": ctypes.addressof, "pack_into": self._struct.pack_into}
        exec(compile(self.pack_source, f"<mok_nn pack of {self.spec.name}>", "exec"), namespace)
        self.pack = namespace["pack"]
        return self.pack(args, stream)

    def _source(self) -> str:
        """The source of pack(args, stream) -> (buffer, address of its `void *args[]`); the buffer must
        live until the launch returns. Argument i is a{i}; a tensor's shape, strides and data pointer are
        s{i}, t{i}, p{i}; the signature key holds (dtype, shape, strides, is_cuda, pointer % align) per
        tensor; the values follow the block's format (pointer array, then per argument its fields)."""
        names = [f"a{i}" for i in range(self.nargs)]
        lines = [f"    ({', '.join(names)},) = args"]
        key, vals = [], []
        for i, item in enumerate(self._items):
            if item is None:
                vals.append(f"a{i}")  # struct.error where ctypes would convert (floats for int32, ...)
                continue
            align, sm, tm = item
            lines.append(f"    s{i} = a{i}.shape; t{i} = a{i}.stride(); p{i} = a{i}.data_ptr()")
            key.append(f"a{i}.dtype, s{i}, t{i}, a{i}.is_cuda, p{i} % {align}")
            vals += [f"p{i}"] + [f"s{i}[{m}]" for m in sm] + [f"t{i}[{m}]" for m in tm]
        vals.append("stream")
        lines += [
            f"    key = ({''.join(k + ', ' for k in key)})",
            "    if key not in valid:",
            "        validate(args, key)",
            "    buf = buf_type()",
            "    base = addressof(buf)",
            f"    pack_into(buf, 0, {', '.join(f'base + {o}' for o in self._offsets)}, {', '.join(vals)})",
            "    return buf, base",
        ]
        return "def pack(args, stream):\n" + "\n".join(lines) + "\n"

    def _validate(self, args, key) -> None:
        """check_tensor for every tensor argument of a new signature (raises on a bad one), then remember it."""
        for a, t in zip(self.spec.args, args):
            if isinstance(a, registry.TensorArg):
                check_tensor(a, t, self.spec.name)
        if len(self._valid) >= self._MAX_SIGNATURES:
            self._valid.clear()
        self._valid.add(key)


_lock = threading.Lock()
_loaded: dict = {}


def _build_in_child(arch: str, target: pathlib.Path, cmd: str) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [sys.executable, "-m", "mok_nn.kernels.build", "--arch", arch, "--out", str(target)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:
        raise KernelLibraryError(f"building the kernels failed ({cmd}):\n{r.stderr[-4000:]}")


def build_once(target: pathlib.Path, arch: str, build_fn) -> bool:
    """Run build_fn unless `target` already holds a usable library, under a file lock in `target` shared by
    every process on this machine (the ranks of a torchrun job starting on an empty cache all got here at
    once and built into the same folder). Returns whether this process built."""
    import fcntl

    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _usable(target, arch)[0]:  # another process built it while this one waited
            return False
        build_fn()
        return True


def load(arch: str = "sm_90a", lib_dir=None, build_if_missing: bool = True) -> KernelLibrary:
    key = (arch, str(lib_dir))
    lib = _loaded.get(key)  # without the lock: an entry, once there, is complete
    if lib is not None:
        return lib
    with _lock:
        if key in _loaded:
            return _loaded[key]
        reasons = []
        for d in _candidates(arch, lib_dir):
            ok, why = _usable(d, arch)
            if ok:
                _loaded[key] = KernelLibrary(d / registry.LIB_NAME)
                return _loaded[key]
            if d == packaged_dir(arch):
                if not d.exists():
                    continue  # a plain install carries none: nothing to report
                why = f"packaged library: {why}"
                warnings.warn(f"mok_nn: the {why}; not used (reinstall a wheel matching these sources)", stacklevel=2)
            reasons.append(why)
        target = pathlib.Path(lib_dir) if lib_dir is not None else default_cache_dir(arch)
        cmd = registry.BUILD_COMMAND.format(arch=arch, out=target)
        if not (build_if_missing and _dsl_importable()):
            raise KernelLibraryError(
                "mok_nn CUDA kernels are not built (" + "; ".join(reasons) + "). "
                f"Install nvidia-cutlass-dsl[cu13]==4.8.1 and run: {cmd}"
            )
        try:
            build_once(target, arch, lambda: _build_in_child(arch, target, cmd))
        except KernelLibraryError as e:  # name what was found unusable too (a stale packaged library, ...)
            raise KernelLibraryError(f"{e}\n(no usable library: " + "; ".join(reasons) + ")") from None
        ok, why = _usable(target, arch)
        if not ok:
            raise KernelLibraryError(f"built kernels are unusable: {why} (before the build: " + "; ".join(reasons) + ")")
        _loaded[key] = KernelLibrary(target / registry.LIB_NAME)
        return _loaded[key]
