#!/usr/bin/env bash
# mok_nn beside its peers (SonicMoE, Liger, transformers' default experts) on the GPU machine. Run from
# the repo root with the kernel library in build/kernels and the peers' wheels carried in benchmarks/peer_wheels/
# (git-ignored; benchmarks/peers_fetch_wheels.sh makes them; the two halves travel in two calls: README.md "Peers").
#
#   bash benchmarks/peers_device.sh STEP...          e.g.  install bench
#
#   install  copy the carried halves (peer_wheels/a, b; SET=fallback: alt_a, alt_b) to $STAGE (outside the repo: it
#            outlives the call while the machine stays warm), join the split DSL wheel, check every wheel against
#            benchmarks/peers_manifest_$SET.sha256 and pip install --target $PEER_SITE the complete ones; with a
#            half missing only Liger installs (exit 3, expected in the first of the two calls); then an import check
#            of each peer in its own process (python -m mok_nn.bench_peers --impl NAME --import-only)
#   bench    python -m mok_nn.bench --peers $PEERS --layer: mok_nn's and the baseline's rows, then each peer in its
#            own process, routed experts and whole layer -> $OUT/peers$TAG.json (log $OUT/peers$TAG.log)
#   experts  the same without --layer -> $OUT/peers_experts$TAG.json
#   bench and experts end by packing the peers' finished autotunes (Triton's and QuACK's *.autotune.json under
#   $PEER_CACHE) into $OUT/peer_autotune.tgz; unpacked into benchmarks/peer_cache/ on the CPU machine and carried
#   in a later call (README.md "Peers"), they should spare that call the autotune: the configurations they name
#   were timed on this kind of GPU, and only those are compiled (seen on a warm machine; a fresh machine reading
#   a carried cache has not run yet)
#
# env: PEERS (default hf,sonicmoe,liger: in this order they share PEER_BUDGET, the quick one first), SHAPES
#      (default qwen3-30b-a3b,deepseek-v3; mixtral-8x7b: QuACK's and Liger's autotune ran past 500 s there on
#      2026-12-04), TOKENS (8192), PEERS_ONLY=1 (only the peers' rows:
#      a second call need not time mok_nn again), PEER_TIMEOUT (seconds per peer process, default 240: the
#      shapes done by then are kept), LIMIT (seconds for the whole step, default 560), PEER_BUDGET (seconds for all
#      the peers' processes, default LIMIT - 150: mok_nn's rows run after them), COMMIT, OUT (/tmp/mok_out),
#      TAG (file-name suffix), SET (primary|fallback), PEER_SITE (/tmp/site/site-packages), STAGE,
#      TRITON_CACHE_AUTOTUNING (default 1: Triton keeps each finished autotune on disk, in its cache under
#      PEER_CACHE, so a peer process killed at PEER_TIMEOUT loses only the unfinished one and a later call on the
#      same warm machine, or one carrying the saved results, goes on from there; the configurations chosen are the
#      same), PEER_CACHE (default benchmarks/peer_cache: TRITON_CACHE_DIR and QUACK_CACHE_DIR under it,
#      QUACK_CACHE_AUTOTUNING=1).
set -u
ROOT=$PWD
export PYTHONPATH=$ROOT MOK_KERNEL_CACHE=${MOK_KERNEL_CACHE:-$ROOT/build/kernels} PYTHONUNBUFFERED=1
export PEER_SITE=${PEER_SITE:-/tmp/site/site-packages} QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-16}
export PEER_TIMEOUT=${PEER_TIMEOUT:-240} TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
PEER_CACHE=${PEER_CACHE:-$ROOT/benchmarks/peer_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PEER_CACHE/triton} QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-$PEER_CACHE/quack}
export QUACK_CACHE_AUTOTUNING=${QUACK_CACHE_AUTOTUNING:-1}
SET=${SET:-primary} STAGE=${STAGE:-/tmp/mok_peer_wheels_${SET:-primary}}
PEERS=${PEERS:-hf,sonicmoe,liger} SHAPES=${SHAPES:-qwen3-30b-a3b,deepseek-v3} TOKENS=${TOKENS:-8192}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)} TAG=${TAG:-}
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
W=$ROOT/benchmarks/peer_wheels

do_install() {
  case "$SET" in
    primary) halves="a b" ;;
    fallback) halves="alt_a alt_b" ;;
    *) echo "SET=$SET: primary or fallback"; return 2 ;;
  esac
  case "$PEER_SITE" in
    */site-packages | */site-packages/*) ;;
    *) echo "PEER_SITE=$PEER_SITE must contain 'site-packages' (quack 0.6 treats code elsewhere as its own)"; return 2 ;;
  esac
  mkdir -p "$STAGE/parts"
  for h in $halves; do
    if [ -d "$W/$h" ]; then
      echo "carried $W/$h: $(ls "$W/$h" | wc -l) files, $(du -sm "$W/$h" | cut -f1) MB -> $STAGE"
      cp "$W/$h"/*.whl "$STAGE"/ 2>/dev/null
      cp "$W/$h"/*.whl.part* "$STAGE/parts"/ 2>/dev/null
    elif ls "$STAGE/parts" 2>/dev/null | grep -q .; then
      echo "$W/$h not here; using what an earlier call staged in $STAGE"
    else
      echo "MISSING $W/$h (not carried in this call, or the machine was given back since the call that carried it)"
    fi
  done
  for name in $(ls "$STAGE/parts" 2>/dev/null | sed 's/\.part[0-9]*$//' | sort -u); do
    cat $(ls "$STAGE/parts/$name".part* | sort) > "$STAGE/$name"  # part0, part1: one digit, sorted
  done
  local ok=() bad=()
  while read -r sum name; do
    if [ -f "$STAGE/$name" ] && [ "$(sha256sum "$STAGE/$name" | cut -d' ' -f1)" = "$sum" ]; then ok+=("$name"); else bad+=("$name"); fi
  done < "$ROOT/benchmarks/peers_manifest_$SET.sha256"
  if [ ${#bad[@]} -gt 0 ]; then
    echo "NOT COMPLETE (missing or bad sha256): ${bad[*]} => SonicMoE not installed in this call; Liger only"
    local keep=(); for n in "${ok[@]}"; do case "$n" in liger_kernel-*) keep+=("$n") ;; esac; done; ok=("${keep[@]}")
  fi
  [ ${#ok[@]} -gt 0 ] || { echo "nothing to install"; return 1; }
  mkdir -p "$PEER_SITE"
  (cd "$STAGE" && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$PEER_SITE" "${ok[@]}") || { echo "pip install failed"; return 1; }
  echo "installed into $PEER_SITE: ${ok[*]}"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  local failed=0
  for p in sonicmoe liger hf; do
    timeout 300 python3 -m mok_nn.bench_peers --impl "$p" --site "$PEER_SITE" --import-only > "$STAGE/import_$p.log" 2>&1 || failed=1
    tail -n 2 "$STAGE/import_$p.log" | cut -c1-600
  done
  [ ${#bad[@]} -eq 0 ] || return 3  # a half missing: SonicMoE cannot import, expected
  [ $failed = 0 ] || return 4  # every wheel installed, a peer still does not import: its line above says why
}

do_bench() {  # do_bench NAME [--layer]
  local name=$1; shift
  local args=(-m mok_nn.bench --peers "$PEERS" --shapes "$SHAPES" --tokens "$TOKENS" --commit "$COMMIT"
              --peer-site "$PEER_SITE" --peer-timeout "$PEER_TIMEOUT"
              --out "$OUT/$name$TAG.json" --peer-budget "${PEER_BUDGET:-$(( ${LIMIT:-560} - 150 ))}" "$@")
  [ "${PEERS_ONLY:-0}" = 1 ] && args+=(--peers-only)
  local t0=$SECONDS
  timeout -k 20 "${LIMIT:-560}" python3 "${args[@]}" > "$OUT/$name$TAG.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (LIMIT: nothing written; lower PEER_TIMEOUT or SHAPES)')"
  grep -E "rel L2|^skip|^=== peer|Error|WARNING" "$OUT/$name$TAG.log" | cut -c1-300 | tail -n 40
  sed -n '/^shape /,$p' "$OUT/$name$TAG.log"  # the summary table and the ratios
  save_autotunes
}

save_autotunes() {  # the finished autotunes (small JSON files; not the compiled kernels) -> $OUT/peer_autotune.tgz
  local files
  files=$(cd "$PEER_CACHE" 2>/dev/null && find . -name '*.autotune.json')
  [ -n "$files" ] || { echo "no autotune results under $PEER_CACHE"; return 0; }
  (cd "$PEER_CACHE" && echo "$files" | tar czf "$OUT/peer_autotune.tgz" -T -)
  echo "saved $(echo "$files" | wc -l) autotune results -> $OUT/peer_autotune.tgz" \
       "(on the CPU machine: tar xzf it -C benchmarks/peer_cache)"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
rc=0
for s in "$@"; do
  case $s in
  install) do_install; r=$?; echo "=== install rc=$r"; [ $r = 0 ] || rc=$r ;;
  bench) do_bench peers --layer || rc=1 ;;
  experts) do_bench peers_experts || rc=1 ;;
  *) echo "unknown step $s (see the top of benchmarks/peers_device.sh)"; rc=2 ;;
  esac
done
exit $rc
