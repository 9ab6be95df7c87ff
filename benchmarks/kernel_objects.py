"""Do two source trees compile a kernel to the same object? No GPU needed.

Compiles each kernel of this tree's registry here and, in a subprocess, the kernel of the same name in another
source tree (--old-src, a checkout holding mok_nn/ and csrc/), then compares the exported objects byte for
byte (host launch code with the cubin inside). Where the objects differ (a kernel parameter removed changes
the host code and the parameter layout), it disassembles the cubin embedded in each (nvdisasm, from a CUDA
toolkit: --nvdisasm or PATH) and compares the SASS, then the SASS with the kernel-parameter offsets masked
(c[0x0][...]: removing an unused parameter moves the ones after it). Equal SASS runs the same instructions: a
refactoring of the kernel sources that keeps every kernel's SASS cannot change a result. A kernel the other tree does not
have (or has under another name: its symbols carry the name) is listed as not compared.

    python benchmarks/kernel_objects.py --old-src build/old_src
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# run in each tree: compile the named kernels into a folder (the exported name.o and name.h)
_COMPILE = """
import sys
from concurrent.futures import ProcessPoolExecutor
from mok_nn.kernels import build
names, out, jobs = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
with ProcessPoolExecutor(jobs) as pool:
    list(pool.map(build.compile_one, names, ["sm_90a"] * len(names), [out] * len(names)))
"""


def compile_in(src: pathlib.Path, names: list[str], out: pathlib.Path, jobs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", _COMPILE, ",".join(names), str(out), str(jobs)], cwd=src, check=True,
                   env={**os.environ, "PYTHONPATH": str(src)})


def embedded_cubin(obj: bytes) -> bytes:
    """The device ELF (e_machine EM_CUDA) inside an exported object, cut at the end of its last part."""
    i = 1
    while True:
        i = obj.find(b"\x7fELF", i)
        if i < 0:
            raise ValueError("no cubin in the object")
        if obj[i + 4] == 2 and struct.unpack_from("<H", obj, i + 0x12)[0] == 190:  # 64-bit, EM_CUDA
            break
        i += 4
    phoff, shoff = struct.unpack_from("<QQ", obj, i + 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", obj, i + 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for k in range(shnum):
        sh = i + shoff + k * shentsize
        if struct.unpack_from("<I", obj, sh + 4)[0] != 8:  # SHT_NOBITS occupies no bytes
            offset, size = struct.unpack_from("<QQ", obj, sh + 0x18)
            end = max(end, offset + size)
    return obj[i:i + end]


def sass(obj_path: pathlib.Path, nvdisasm: str) -> str:
    cubin = obj_path.with_suffix(".cubin")
    cubin.write_bytes(embedded_cubin(obj_path.read_bytes()))
    return subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-src", required=True, help="the other source tree (holds mok_nn/ and csrc/)")
    ap.add_argument("--only", default="", help="comma-separated kernel names (default: this tree's registry)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="nvdisasm, for kernels whose objects differ")
    ap.add_argument("--out", default=None, help="JSON of {kernel: same object | same SASS | DIFFERENT}")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from mok_nn.kernels import registry

    names = [n for n in args.only.split(",") if n] or [s.name for s in registry.SPECS]
    old_src = pathlib.Path(args.old_src).resolve()
    old_names = set(subprocess.run(
        [sys.executable, "-c", "from mok_nn.kernels import registry as r; print(' '.join(s.name for s in r.SPECS))"],
        cwd=old_src, env={**os.environ, "PYTHONPATH": str(old_src)}, check=True, capture_output=True, text=True,
    ).stdout.split())
    work = pathlib.Path(tempfile.mkdtemp(prefix="kernel_objects_"))
    print(f"compiling {len(names)} kernels in each tree ...", flush=True)
    common = [n for n in names if n in old_names]
    compile_in(ROOT, common, work / "new", args.jobs)
    compile_in(old_src, common, work / "old", args.jobs)
    result = {}
    for n in names:
        if n not in old_names:
            print(f"{'-':<36} {n} (not in the other tree)")
            continue
        old, new = work / "old" / f"{n}.o", work / "new" / f"{n}.o"
        if old.read_bytes() == new.read_bytes():
            result[n] = "same object"
        elif args.nvdisasm:
            a, b = sass(old, args.nvdisasm), sass(new, args.nvdisasm)
            masked = [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][param]", t) for t in (a, b)]
            result[n] = ("same SASS" if a == b else "same SASS, parameter offsets moved" if masked[0] == masked[1]
                         else "DIFFERENT")
        else:
            result[n] = "DIFFERENT (object; no nvdisasm for the SASS)"
        print(f"{result[n]:<36} {n}", flush=True)
    same = sum(v.startswith("same") for v in result.values())
    print(f"{same} of {len(result)} compared kernels compile to the same instructions "
          f"({len(names) - len(result)} not compared)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same == len(result) else 1


if __name__ == "__main__":
    sys.exit(main())
