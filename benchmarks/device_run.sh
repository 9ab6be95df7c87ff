#!/usr/bin/env bash
# The GPU checks and measurements of mok_nn, as named steps. Run from the repo root on the GPU machine with
# the kernel library in build/kernels (python -m mok_nn.kernels.build --arch sm_90a --out build/kernels/sm_90a):
#
#   COMMIT=<sha> bash benchmarks/device_run.sh STEP...        e.g.  tests bench fingerprint pack
#
# Each step runs under `timeout`, writes its log to $OUT/<name>.log (OUT default /tmp/mok_out) and prints
# its exit status, its seconds and the log's last $TAIL lines (default 12).
#
#   tests        pytest tests/gpu
#   bench        python -m mok_nn.bench -> $OUT/bench.json
#   fingerprint  benchmarks/fingerprint.py -> $OUT/fingerprint_new.json; where the old tree (see ab) is, the same for
#                the old tree (-> fingerprint_old.json) and the comparison: do both compute the same bits?
#   sanitize     compute-sanitizer memcheck, a planted out-of-bounds read it must catch, racecheck, synccheck
#                (benchmarks/sanitize_layer.py; SANITIZE_CASES limits racecheck / synccheck, the slow ones)
#   sanitize_mx  compute-sanitizer memcheck, racecheck and synccheck over the MX GEMM tests with scale extremes
#                (tests/gpu/test_mx_gemm_cuda.py -k extremes: the forward's _mx and the dgrad's _mxq kernels)
#   profile      the kernel table of the qwen3 and deepseek-v3 routed experts, of qwen3's whole layer (forward,
#                forward+backward), ncu of deepseek-v3's gate/up GEMM
#   stages       per-stage times of the three benchmark shapes
#   energy       energy per call, mok_nn vs the torch baseline (deepseek-v3)
#   macrobatch   MoKConfig.macrobatch_size passes vs one pass
#   mx_rule      benchmarks/mx_gemm_rule.py (the MX GEMMs against dequantise + the bf16 kernel over 256-2048 routed rows
#                per expert, the data of cuda_mx.MX_MAX_ROWS_PER_EXPERT) -> $OUT/mx_rule_{forward,backward}.jsonl; the
#                forward's and the backward's GEMMs in two processes (deepseek-v3's resident copies: 23 GB each)
#   portable     the portable backend beside the fused path, the torch baseline and transformers' default experts:
#                bf16 with the whole layer, fp32 (deepseek-v3's needs an H200's memory), and precision="mxfp8"
#                -> $OUT/portable_*.json
#   mxfp8        precision="mxfp8" on the fused path: its GPU tests, mok_mx_quant's bandwidth beside a copy, then the
#                benchmark beside bf16 (trained and frozen weights) and the baseline -> $OUT/mxfp8.json
#   router       the routing's forms side by side (benchmarks/router_variants.py): stable top-k by int64 keys or by
#                a stable sort, router GEMM in fp32 or bf16 with fp32 output -> $OUT/router_variants.jsonl
#   ep           the EP = 2 checks under torchrun; with one GPU, its cross-host-mode checks over gloo on that GPU
#   ab           the benchmark alternately with the old tree and this one, AB_REPS times each (default 2),
#                then the table (benchmarks/ab_table.py). The old tree: a source checkout at $OLD_SRC
#                (default build/old_src) with its kernel library at $OLD_KERNELS (default build/old_kernels),
#                prepared where the kernel compiler is, e.g.
#                  mkdir -p build/old_src && git archive <old> mok_nn csrc | tar -x -C build/old_src
#                  (cd build/old_src && PYTHONPATH=$PWD python -m mok_nn.kernels.build --arch sm_90a \
#                       --out ../old_kernels/sm_90a)
#                OLD_COMMIT names it in the records; AB_SHAPES (comma-separated) limits the shapes; AB_ARGS adds
#                arguments of the benchmark for both trees (e.g. AB_ARGS="--precision mxfp8": a table per
#                implementation, trained and frozen, bf16 and MXFP8).
#   pack         every log into $OUT/logs.tgz (the JSON files stay beside it); last
set -u
ROOT=$PWD
export PYTHONPATH=$ROOT MOK_KERNEL_CACHE=$ROOT/build/kernels
COMMIT=${COMMIT:-unknown}
OLD_SRC=${OLD_SRC:-$ROOT/build/old_src} OLD_KERNELS=${OLD_KERNELS:-$ROOT/build/old_kernels}
OLD_COMMIT=${OLD_COMMIT:-old}
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
GPUS=$(nvidia-smi -L | wc -l)

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc $((SECONDS - t0)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

have_old() { [ -d "$OLD_SRC/mok_nn" ] && [ -d "$OLD_KERNELS" ]; }

old_tree() {  # old_tree CMD...: CMD in the old tree's folder, its mok_nn and kernel library first
    (cd "$OLD_SRC" && PYTHONPATH=$OLD_SRC MOK_KERNEL_CACHE=$OLD_KERNELS "$@")
}

ab_bench() {  # ab_bench old|new I: one benchmark run of that tree -> $OUT/ab_<tree>_<i>.json
    local tree=$1 i=$2 src=$ROOT commit=$COMMIT
    [ "$tree" = old ] && src=$OLD_SRC commit=$OLD_COMMIT
    local args=(-m mok_nn.bench --no-check --out "$OUT/ab_${tree}_$i.json") extra=()
    [ -n "${AB_SHAPES:-}" ] && args+=(--shapes "$AB_SHAPES")
    [ -n "${AB_ARGS:-}" ] && read -r -a extra <<< "$AB_ARGS" && args+=("${extra[@]}")
    grep -q -- '"--commit"' "$src/mok_nn/bench.py" && args+=(--commit "$commit")  # older trees read MOK_COMMIT
    if [ "$tree" = old ]; then
        MOK_COMMIT=$commit TAIL=4 old_tree step "ab_old_$i" 300 python "${args[@]}"
    else
        TAIL=4 step "ab_new_$i" 300 python "${args[@]}"
    fi
}

for s in "$@"; do
    case $s in
    tests) step gpu_tests 540 python -m pytest -q -p no:cacheprovider tests/gpu ;;
    bench) TAIL=20 step bench 300 python -m mok_nn.bench --out "$OUT/bench.json" --commit "$COMMIT" ;;
    fingerprint)
        step fingerprint_new 300 python benchmarks/fingerprint.py --out "$OUT/fingerprint_new.json"
        if have_old; then
            old_tree step fingerprint_old 300 python "$ROOT/benchmarks/fingerprint.py" --out "$OUT/fingerprint_old.json"
            TAIL=3 step fingerprint_compare 60 python benchmarks/fingerprint.py \
                --compare "$OUT/fingerprint_old.json" "$OUT/fingerprint_new.json"
        fi ;;
    sanitize)
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 step sanitize_memcheck 240 compute-sanitizer --tool memcheck \
            --error-exitcode 3 python benchmarks/sanitize_layer.py
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=0 step sanitize_planted 120 compute-sanitizer --tool memcheck \
            python benchmarks/sanitize_layer.py --plant-oob
        echo "planted out-of-bounds read: $(grep -c "Invalid __global__ read" "$OUT/sanitize_planted.log") report(s)," \
            "$(grep -c "mok_combine" "$OUT/sanitize_planted.log") line(s) naming mok_combine (both must be > 0)"
        for tool in racecheck synccheck; do
            step "sanitize_$tool" 180 compute-sanitizer --tool "$tool" --error-exitcode 3 \
                python benchmarks/sanitize_layer.py --cases "${SANITIZE_CASES:-small,h-over-4096}"
        done ;;
    sanitize_mx)
        for tool in memcheck racecheck synccheck; do
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=3 step "sanitize_mx_$tool" 180 compute-sanitizer --tool "$tool" \
                --error-exitcode 3 python -m pytest -q -p no:cacheprovider tests/gpu/test_mx_gemm_cuda.py -k extremes
        done ;;
    profile)
        for sh in qwen3-30b-a3b deepseek-v3; do
            TAIL=20 step "profile_layer_$sh" 120 python benchmarks/profile_layer.py --shape "$sh"
        done
        for what in --forward ""; do
            TAIL=30 step "profile_layer_qwen3_whole$what" 120 python benchmarks/profile_layer.py --shape qwen3-30b-a3b \
                --layer $what
        done
        TAIL=60 step ncu_gate_up 180 ncu --launch-skip 2 --launch-count 1 -k regex:GroupedGemm \
            --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
            python benchmarks/ncu_gemm.py --shape deepseek-v3 --gemm gate_up ;;
    stages)
        for sh in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
            TAIL=20 step "stages_$sh" 120 python benchmarks/profile_stages.py --shape "$sh"
        done ;;
    energy) TAIL=6 step energy 300 python benchmarks/energy.py --shapes deepseek-v3 ;;
    portable)
        TAIL=20 step portable_bf16 300 python -m mok_nn.bench --backend torch --layer --commit "$COMMIT" \
            --out "$OUT/portable_bf16.json"
        fp32_shapes=qwen3-30b-a3b,mixtral-8x7b,deepseek-v3  # deepseek-v3: 90 GB of fp32 weights and gradients
        [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] &&
            fp32_shapes=qwen3-30b-a3b,mixtral-8x7b
        TAIL=20 step portable_fp32 300 python -m mok_nn.bench --backend torch --dtype fp32 --iters 10 \
            --shapes "$fp32_shapes" --commit "$COMMIT" --out "$OUT/portable_fp32.json"
        TAIL=20 step portable_mxfp8 300 python -m mok_nn.bench --backend torch --precision mxfp8 --iters 10 \
            --commit "$COMMIT" --out "$OUT/portable_mxfp8.json" ;;
    mxfp8)
        TAIL=20 step mxfp8_tests 300 python -m pytest -q tests/gpu/test_mxfp8_cuda.py
        TAIL=6 step mx_quant_bandwidth 120 python benchmarks/mx_quant_bandwidth.py --out "$OUT/mx_quant_bandwidth.json"
        TAIL=30 step mxfp8_bench 420 python -m mok_nn.bench --precision mxfp8 --commit "$COMMIT" \
            --out "$OUT/mxfp8.json" ;;
    mx_rule)
        for half in "forward gate_up,down" "backward dx,dh"; do
            read -r name gemms <<< "$half"
            TAIL=8 step "mx_rule_$name" 240 python benchmarks/mx_gemm_rule.py --gemms "$gemms" --iters 5 \
                --rows-per-expert 256,512,1024,2048 --out "$OUT/mx_rule_$name.jsonl"
        done ;;
    macrobatch) step macrobatch 300 python benchmarks/macrobatch.py --commit "$COMMIT" ;;
    router)
        TAIL=12 step router_variants 180 python benchmarks/router_variants.py --shapes qwen3-30b-a3b,deepseek-v3
        grep '^{' "$OUT/router_variants.log" > "$OUT/router_variants.jsonl" ;;
    ep)
        if [ "$GPUS" -ge 2 ]; then
            TAIL=30 step ep_checks 300 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py
        else  # one GPU: two ranks on it over gloo, the cross-host mode's checks only
            MOK_EP_CHECK_ONE_GPU=1 TAIL=14 step ep_checks_one_gpu 300 torchrun --nproc_per_node 2 \
                tests/gpu/ep_cuda_check.py
        fi ;;
    ab)
        if ! have_old; then
            echo "=== ab skipped: no old tree at OLD_SRC=$OLD_SRC with its library at OLD_KERNELS=$OLD_KERNELS"
            continue
        fi
        for i in $(seq 1 "${AB_REPS:-2}"); do
            ab_bench old "$i"
            ab_bench new "$i"
        done
        python benchmarks/ab_table.py "$OUT" | tee "$OUT/ab_table.md" ;;
    pack)
        (cd "$OUT" && tar czf logs.tgz -- *.log && rm -f -- *.log) && echo "=== pack: $OUT/logs.tgz" ;;
    *) echo "unknown step $s (see the top of benchmarks/device_run.sh)" ;;
    esac
done
