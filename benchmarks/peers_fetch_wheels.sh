#!/usr/bin/env bash
# Fetch the peers' wheels on the CPU machine into benchmarks/peer_wheels/ (git-ignored), split so that
# each half travels in one device call (64 MiB per call, benchmarks/README.md "Peers"); every wheel is checked
# against benchmarks/peers_manifest_<set>.sha256. Versions and why: /work/shared/peers/README.md (the harness
# that ran them on an H200 on 2026-12-04).
#   bash benchmarks/peers_fetch_wheels.sh [primary|fallback|both]      (default primary)
#     primary : peer_wheels/a + b      CuTe DSL 4.7.1 (cu13), quack-kernels 0.6.5, apache-tvm-ffi 0.1.15.post2
#     fallback: peer_wheels/alt_a + alt_b  CuTe DSL 4.4.2 (cu13), quack-kernels 0.3.11 (sonic-moe's own pins), tvm-ffi 0.1.9
#     both sets: sonic-moe 0.1.2.post1, liger-kernel 0.8.5 (in each half: either call alone can run Liger),
#                torch-c-dlpack-ext 0.1.5. torch, triton, transformers, numpy, einops: the GPU machine's own.
set -euo pipefail
WHICH=${1:-primary}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=$HERE/peer_wheels
DL=${DL:-/tmp/mok_peer_dl}
mkdir -p "$DL" "$W"
get() {  # cp312 manylinux x86_64 wheels (the GPU machine's python3 is 3.12), no dependencies (each is listed)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DL" "$@"
}
COMMON="sonic-moe==0.1.2.post1 liger-kernel==0.8.5 torch-c-dlpack-ext==0.1.5"
build() {  # build SET A_DIR B_DIR BIGWHEEL SPLIT_SIZE "wheels for the A half"
  local set=$1 a=$W/$2 b=$W/$3 big=$4 size=$5 aside=$6
  (cd "$DL" && sha256sum -c --quiet "$HERE/peers_manifest_$set.sha256")
  rm -rf "$a" "$b" && mkdir -p "$a" "$b"
  (cd "$DL" && split -b "$size" -d -a 1 "$big" "$big.part") && mv "$DL/$big.part0" "$a/" && mv "$DL/$big.part1" "$b/"
  [ ! -e "$DL/$big.part2" ] || { echo "$big needs more than two parts"; exit 1; }
  while read -r _ name; do
    [ "$name" = "$big" ] && continue
    case " $aside " in *" $name "*) cp "$DL/$name" "$a/" ;; *) cp "$DL/$name" "$b/" ;; esac
  done < "$HERE/peers_manifest_$set.sha256"
  cp "$DL"/liger_kernel-0.8.5-py3-none-any.whl "$a/"
  du -sh "$a" "$b"
}
if [ "$WHICH" != fallback ]; then
  get nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1 nvidia-cutlass-dsl-libs-core==4.7.1 \
      nvidia-cutlass-dsl-libs-cu13==4.7.1 apache-tvm-ffi==0.1.15.post2 quack-kernels==0.6.5 $COMMON
  build primary a b nvidia_cutlass_dsl_libs_cu13-4.7.1-cp312-cp312-manylinux_2_28_x86_64.whl 44M \
    "nvidia_cutlass_dsl-4.7.1-py3-none-any.whl nvidia_cutlass_dsl_libs_base-4.7.1-cp312-cp312-manylinux_2_28_x86_64.whl nvidia_cutlass_dsl_libs_core-4.7.1-py3-none-any.whl"
fi
if [ "$WHICH" = fallback ] || [ "$WHICH" = both ]; then
  get nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-cu13==4.4.2 apache-tvm-ffi==0.1.9 quack-kernels==0.3.11 $COMMON
  build fallback alt_a alt_b nvidia_cutlass_dsl_libs_cu13-4.4.2-cp312-cp312-manylinux_2_28_x86_64.whl 40M \
    "nvidia_cutlass_dsl-4.4.2-py3-none-any.whl"
fi
