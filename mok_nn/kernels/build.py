"""Ahead-of-time build of every kernel variant into one shared library.

    python -m mok_nn.kernels.build --arch sm_90a --out DIR

Needs the CuTe DSL (`nvidia-cutlass-dsl[cu13]`), g++ and libcudart_static.a;
needs no GPU. Steps: compile each spec of registry.SPECS with fake tensors,
export it to C (header + object with the cubin inside), generate a thin
extern "C" launcher per kernel, link everything with csrc/mok_runtime.cpp into
DIR/libmok_kernels.so and write DIR/manifest.json (source hash, DSL version,
arch, per-kernel argument layout) for the loader.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from . import registry

# the repository's csrc/, or its copy in an installed wheel (registry.csrc_dir)
_CSRC = registry.csrc_dir() or pathlib.Path(__file__).resolve().parent.parent.parent / "csrc"


def _setup_dsl_env(arch: str) -> None:
    # The DSL latches the target at import; no GPU may be visible on build hosts.
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _fake_args(spec: registry.KernelSpec):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    dtypes = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32, "i32": cutlass.Int32, "i64": cutlass.Int64,
              "u8": cutlass.Uint8, "u16": cutlass.Uint16}
    out = []
    for a in spec.args:
        if isinstance(a, registry.ScalarArg):
            out.append(dtypes[a.dtype](0))
            continue
        div = a.divisibility or (1,) * len(a.shape)
        shape = tuple(cute.sym_int(divisibility=div[i]) if s == registry.DYN else s for i, s in enumerate(a.shape))
        # Run-time strides are multiples of 16 bytes unless the spec says otherwise.
        # 64-bit: the exported C header always declares int64_t stride slots, and a
        # 32-bit SymInt would make the kernel read them at other offsets.
        sdiv = a.stride_divisibility
        stride = tuple(cute.sym_int64(divisibility=sdiv) if s == registry.DYN else s for s in a.stride)
        out.append(make_fake_tensor(dtypes[a.dtype], shape, stride, assumed_align=a.align))
    out.append(cutlass.runtime.make_fake_stream())
    return out


def compile_one(name: str, arch: str, out_dir: str) -> dict:
    """Compile and export one kernel (runs in a worker process)."""
    _setup_dsl_env(arch)
    import cutlass.cute as cute

    spec = registry.SPECS_BY_NAME[name]
    t0 = time.time()
    mod = importlib.import_module(f"mok_nn.kernels.{spec.module}")
    fn = getattr(mod, spec.factory)(**dict(spec.factory_kwargs))
    compiled = cute.compile(fn, *_fake_args(spec), options=f"--gpu-arch {arch}")
    compiled.export_to_c(out_dir, name, name)
    header = pathlib.Path(out_dir, f"{name}.h").read_text()
    return {"name": name, "seconds": round(time.time() - t0, 2), "header": header}


def _launcher_source(name: str, header: str) -> str:
    """extern "C" int <name>_launch(void **args): args[i] points at argument i, stream last."""
    m = re.search(rf"cute_dsl_{name}_wrapper\(([^)]*)\)", header)
    if not m:
        raise RuntimeError(f"wrapper of {name} not found in its exported header")
    params = [p.strip() for p in m.group(1).split(",")][1:]  # drop the module pointer
    spec = registry.SPECS_BY_NAME[name]
    if len(params) != len(spec.args) + 1:  # + stream
        raise RuntimeError(f"{name}: exported wrapper takes {params}, the spec lists {len(spec.args)} args + stream")
    casts = []
    for i, p in enumerate(params):
        ptype, pname = p.rsplit(" ", 1)
        if pname.startswith("*"):
            ptype += " *"
        if ptype.strip().endswith("*"):
            casts.append(f"({ptype})args[{i}]")
        else:
            casts.append(f"*({ptype} *)args[{i}]")
    return f"""
#include "{name}.h"
#include <mutex>
static {name}_Kernel_Module_t g_{name};
static std::once_flag g_{name}_once;
extern "C" int {name}_launch(void **args) {{
    std::call_once(g_{name}_once, [] {{ {name}_Kernel_Module_Load(&g_{name}); }});
    int32_t rc = cute_dsl_{name}_wrapper(&g_{name}, {", ".join(casts)});
    cudaError_t err = cudaGetLastError();
    return rc != 0 ? rc : (int)err;
}}
"""


def _find_static_libs() -> tuple[str, str]:
    import nvidia_cutlass_dsl

    base = pathlib.Path(nvidia_cutlass_dsl.__path__[0])
    cands = sorted(base.glob("cu13/lib/libcuda_dialect_runtime_static.a")) + sorted(
        base.glob("*/lib/libcuda_dialect_runtime_static.a")
    )
    if not cands:
        raise RuntimeError(f"libcuda_dialect_runtime_static.a not found under {base}")
    dialect = str(cands[0])
    # Order: explicit file, $CUDA_HOME, the pip wheel nvidia-cuda-runtime (cu13), /usr/local/cuda.
    cudart_cands = [os.environ.get("MOK_CUDART_STATIC", "")]
    if os.environ.get("CUDA_HOME"):
        root = os.environ["CUDA_HOME"]
        cudart_cands += glob.glob(f"{root}/lib*/libcudart_static.a") + glob.glob(f"{root}/targets/*/lib/libcudart_static.a")
    try:
        import nvidia.cu13 as _cu13  # type: ignore

        for path in _cu13.__path__:
            cudart_cands += glob.glob(f"{path}/lib/libcudart_static.a")
    except ImportError:
        pass
    cudart_cands += glob.glob("/usr/local/cuda/lib*/libcudart_static.a")
    cudart_cands += glob.glob("/usr/local/cuda/targets/*/lib/libcudart_static.a")
    cudart = next((c for c in cudart_cands if c and os.path.isfile(c)), None)
    if cudart is None:
        raise RuntimeError(
            "libcudart_static.a not found: pip install nvidia-cuda-runtime==13.0.*, or set CUDA_HOME or MOK_CUDART_STATIC"
        )
    return dialect, cudart


def _cuda_include(cudart: str) -> str:
    """Toolkit headers beside the static runtime or in /usr/local/cuda, else csrc/cuda_shim.

    A pip-installed runtime wheel carries cuda_runtime.h without the compiler's
    crt/ headers it includes; the shim declares the few names the glue needs.
    """
    root = pathlib.Path(cudart).resolve().parent.parent
    for cand in (root / "include", root.parent / "include", pathlib.Path("/usr/local/cuda/include")):
        if (cand / "cuda_runtime.h").is_file() and (cand / "crt" / "host_config.h").is_file():
            return str(cand)
    return str(_CSRC / "cuda_shim")


def publish(lib_file: pathlib.Path, manifest: dict, out_dir: pathlib.Path) -> None:
    """Put the library, then the manifest that vouches for it, into out_dir, each by os.replace from a temporary
    file in out_dir itself: a rename within one file system, so a reader sees the old file or the new one, never a
    half-written one, and a process that has the old library loaded keeps its (unlinked) file (shutil.move from
    another file system overwrote it in place: a loaded copy could then crash)."""
    tmp_lib = out_dir / f".{registry.LIB_NAME}.{os.getpid()}.tmp"
    tmp_man = out_dir / f".{registry.MANIFEST}.{os.getpid()}.tmp"
    try:
        shutil.copyfile(lib_file, tmp_lib)
        os.chmod(tmp_lib, 0o755)
        os.replace(tmp_lib, out_dir / registry.LIB_NAME)
        tmp_man.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp_man, out_dir / registry.MANIFEST)
    finally:
        for t in (tmp_lib, tmp_man):
            t.unlink(missing_ok=True)


def build(arch: str, out: str, jobs: int | None = None, verbose: bool = True) -> pathlib.Path:
    t0 = time.time()
    out_dir = pathlib.Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="mok_build_"))
    names = [s.name for s in registry.SPECS]
    jobs = jobs or min(len(names), os.cpu_count() or 1)
    try:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(compile_one, names, [arch] * len(names), [str(work)] * len(names)))
        for r in results:
            if verbose:
                print(f"  compiled {r['name']:<16} {r['seconds']:6.2f} s", flush=True)
        glue = work / "launchers.cpp"
        glue.write_text("".join(_launcher_source(r["name"], r["header"]) for r in results))
        dialect, cudart = _find_static_libs()
        lib_tmp = work / registry.LIB_NAME
        cmd = [
            os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O2", "-std=c++17",
            f"-I{work}", f"-I{_cuda_include(cudart)}",
            str(glue), str(_CSRC / "mok_runtime.cpp"),
            *[str(work / f"{n}.o") for n in names],
            dialect, cudart, "-ldl", "-lpthread", "-lrt",
            "-o", str(lib_tmp),
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        import cutlass

        manifest = {
            "arch": arch,
            "source_hash": registry.source_hash(),
            "dsl_version": getattr(cutlass, "__version__", "unknown"),
            "kernels": names,
        }
        publish(lib_tmp, manifest, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if verbose:
        print(f"built {out_dir / registry.LIB_NAME} in {time.time() - t0:.1f} s", flush=True)
    return out_dir / registry.LIB_NAME


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90a", choices=["sm_90a"])
    p.add_argument("--out", default=None, help="output folder (default: the kernel cache)")
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args(argv)
    from .loader import default_cache_dir

    build(args.arch, args.out or str(default_cache_dir(args.arch)), args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
