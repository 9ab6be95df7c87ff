#!/usr/bin/env bash
# One batched GPU session on the device machine: each step bounded by `timeout`,
# its full log under $OUT, its tail printed. Run from the repo root with the
# kernel library carried in build/kernels (python -m mok_nn.kernels.build ...).
#
#   bash tests/gpu/device_session.sh STEP...     e.g.  tests diag bench ep
#
# Steps: tests (pytest tests/gpu), diag (kernel variant timers), stages
# (per-stage times), bench (python -m mok_nn.bench -> $OUT/$BENCH_NAME.json, default bench),
# ep (torchrun EP=2 checks; needs 2 GPUs), epbench (EP=2 benchmark), epov (EP=2 forward:
# sequential vs overlapped dispatch, comm-SM sweep, kernel timeline), ovdiag (the overlapped
# forward's cold-start diagnosis: one GPU, then EP=2 overlap checks and qwen3 overlap bench),
# profile (kernel table + ncu of one GEMM), epprofile (EP kernel and host
# time on rank 0), eptimeline (EP forward: host issue vs GPU done per stage), ephost (EP host issue time + cProfile), launch (packed launch path: GPU test, host us, ephost with MOK_LAUNCH=ctypes), gatherdiag (gather GEMMs vs their TMA twins), envmodes / epenvmodes (env settings side by side),
# epgather (EP checks with MOK_GEMM_GATHER=1), epcopy (EP row copies v1 vs v2), gather (MOK_GEMM_GATHER tests, timings, layer),
# eppublish (mok_ep_publish: one-GPU tests, publish timings EP=1/EP=2, the EP=2 layer kernel vs torch),
# dact (dgrad of down + activation backward: two kernels vs mok_gemm_dact, call by call),
# actepi (gate/up + SwiGLU with the whole tile in smem: tests, call by call, the layer with MOK_GEMM_ACT fused / split),
# downpush (EP checks with the down GEMM sending its rows itself, then MOK_EP_DOWN_PUSH kernel / gemm side by side),
# epslot / eprank (EP checks with MOK_EP_COMBINE_SUMS=slot / rank), epdispatch (EP checks with
# MOK_EP_DISPATCH=rows, then pull vs rows side by side),
# wgrad (resident clusters per cluster size, weight-gradient GPU tests, variants call by call),
# pingpong (ping-pong GEMM tests, call by call vs the cooperative kernels, the layer side by side),
# macrobatch (MoKConfig.macrobatch_size: GPU tests, passes vs one pass at EP=1 and, with 2 GPUs, EP=2),
# scatter (mok_scatter_rows: tests, call by call, EP checks with it),
# hostdiag (EP=1 host side: qwen3 timeline, single-op and make_schedule host costs, the alternation penalty),
# sweep (MoKConfig's knobs side by side: tests/gpu/sweep_config.py at EP=1, and EP=2 where 2 GPUs),
# clocks (SM clock / power log during the deepseek-v3 benchmark), energy (J per call, mok_nn modes vs baseline),
# tailskip (static vs dynamic tiles, tail skip on / off, call by call: tests/gpu/diag_tail_skip.py),
# tilesab (the default vs MOK_GEMM_TILES=dynamic: benchmarks alternating, energy, sustained GEMM readings),
# sanitize (compute-sanitizer memcheck / racecheck / synccheck, tests/gpu/sanitize_layer.py),
# pack (all logs into $OUT/logs.tgz; last).
set -u
export PYTHONPATH=$PWD MOK_KERNEL_CACHE=$PWD/build/kernels
export MOK_COMMIT=${MOK_COMMIT:-unknown}
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | head -2

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc $((SECONDS - t0)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

for s in "$@"; do
    case $s in
    tests) step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
    diag)
        for f in tests/gpu/bench_gemm_variants.py tests/gpu/bench_wgrad_variants.py tests/gpu/bench_schedule.py; do
            [ -f "$f" ] && TAIL=40 step "$(basename "$f" .py)" 120 python3 "$f"
        done ;;
    stages)
        for sh in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
            step "stages_$sh" 60 python3 tests/gpu/profile_stages.py "$sh" 8192
        done ;;
    bench) TAIL=20 step "${BENCH_NAME:-bench}" 240 python3 -m mok_nn.bench --out "$OUT/${BENCH_NAME:-bench}.json" ;;
    ep) TAIL=30 step ep_checks 240 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py ;;
    epov) TAIL=40 step ep_overlap 180 torchrun --nproc_per_node 2 tests/gpu/bench_ep_overlap.py ;;
    ovdiag)  # the overlapped forward's cold-start deadlock (docs/ep.md): one GPU, then the EP=2 checks
        TAIL=12 step ov_coldstart 150 python3 tests/gpu/diag_ov_coldstart.py
        MOK_EP_CHECK_OVERLAP=1 TAIL=30 step ep_checks_overlap 150 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py
        TAIL=30 step ep_overlap_qwen3 120 torchrun --nproc_per_node 2 tests/gpu/bench_ep_overlap.py \
            --shapes qwen3-30b-a3b --comm 8,16 ;;
    epcopy)  # the EP row copies v1 vs v2 over NVLink (tests/gpu/bench_ep_copy.py)
        TAIL=30 step ep_copy_bench 180 torchrun --nproc_per_node 2 tests/gpu/bench_ep_copy.py ;;
    epbench) TAIL=20 step ep_bench 240 torchrun --nproc_per_node 2 -m mok_nn.bench --out "$OUT/ep_bench.json" ;;
    profile)  # kernels of the deepseek-v3 layer, and ncu of its gate/up GEMM
        for sh in qwen3-30b-a3b deepseek-v3; do
            TAIL=0 step "profile_layer_$sh" 90 python3 tests/gpu/profile_layer.py "$sh"
        done
        TAIL=60 step ncu_gate_up 150 ncu --launch-skip 2 --launch-count 1 \
            -k regex:VarlenMGroupedGemm --section SpeedOfLight --section WarpStateStats \
            --section MemoryWorkloadAnalysis --section Occupancy \
            python3 tests/gpu/ncu_gemm.py deepseek-v3 gate_up ;;
    gather)  # A rows gathered inside the GEMM (MOK_GEMM_GATHER): tests, GEMM timings, the layer with it on
        step gather_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gather_gemm.py
        TAIL=40 step gather_gemms 240 python3 tests/gpu/bench_gemm_variants.py --gemms gate_up,dgrad_down
        MOK_GEMM_GATHER=1 TAIL=0 step profile_layer_deepseek-v3_gather 90 python3 tests/gpu/profile_layer.py deepseek-v3
        MOK_GEMM_GATHER=1 TAIL=20 step bench_gather 240 python3 -m mok_nn.bench --out "$OUT/bench_gather.json" ;;
    epprofile)
        for sh in qwen3-30b-a3b deepseek-v3; do
            TAIL=0 step "profile_ep_$sh" 120 torchrun --nproc_per_node 2 tests/gpu/profile_ep.py "$sh"
        done ;;
    eptimeline)  # the EP forward as the benchmark times it: host issue vs GPU done per stage, every rank
        for sh in qwen3-30b-a3b deepseek-v3; do
            TAIL=40 step "ep_timeline_$sh" 120 torchrun --nproc_per_node 2 tests/gpu/timeline_ep_forward.py "$sh"
        done ;;
    hostdiag)  # EP = 1 host side: the qwen3 timeline (one rank), host cost of single ops and of make_schedule,
        # the benchmark's alternation penalty
        TAIL=25 step ep1_timeline_qwen3 120 torchrun --nproc_per_node 1 tests/gpu/timeline_ep_forward.py qwen3-30b-a3b
        TAIL=25 step host_ops 60 python3 tests/gpu/bench_host_ops.py
        TAIL=10 step schedule_host 60 python3 tests/gpu/diag_schedule_host.py
        TAIL=6 step alternation 120 python3 tests/gpu/diag_bench_alternation.py ;;
    ephost)  # the EP path's host side: issue time vs wall, cProfile of the issuing (rank 0)
        TAIL=60 step ep_host_qwen3 120 torchrun --nproc_per_node 2 tests/gpu/profile_ep_host.py qwen3-30b-a3b ;;
    launch)  # packed kernel launches: same bits as the ctypes path, host us per launch, EP host issue with the old path
        TAIL=20 step launch_packed 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_launch_packed.py
        TAIL=10 step launch_host 60 python3 tests/bench_launch_host.py
        MOK_LAUNCH=ctypes TAIL=60 step ep_host_qwen3_ctypes 120 torchrun --nproc_per_node 2 tests/gpu/profile_ep_host.py qwen3-30b-a3b ;;
    gatherdiag)  # the gather GEMMs (padding rows zero-filled) against their TMA twins
        TAIL=30 step gather_diag 200 python3 tests/gpu/diag_gather.py --shapes deepseek-v3,qwen3-30b-a3b \
            --kernels mok_gemm_bk_gather,mok_gemm_bn_f32_gather --cases real,real_zrows --reps 5 ;;
    pingpong)  # ping-pong GEMMs: their GPU tests, call by call against the cooperative kernels, the layer side by side
        TAIL=6 step pp_tests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_kernels.py \
            -k "grouped_gemm or act_fused or pingpong or experts_vs_reference"
        TAIL=60 step pp_gemms 240 python3 tests/gpu/bench_gemm_variants.py --no-gather
        TAIL=16 step pp_modes 300 python3 tests/gpu/bench_env_modes.py --modes pingpong ;;
    actepi)  # the fused gate/up + SwiGLU with the whole tile in smem (_ef): its tests, call by call, the layer side by side
        TAIL=6 step actepi_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_kernels.py -k "act_fused or act_in_forward"
        TAIL=20 step actepi_gemms 200 python3 tests/gpu/bench_gemm_variants.py --gemms gate_up --no-gather
        TAIL=12 step actepi_modes 300 python3 tests/gpu/bench_env_modes.py --modes act ;;
    downpush)  # the EP down GEMM sending its rows itself (MOK_EP_DOWN_PUSH=gemm): EP checks, then side by side
        TAIL=12 step ep_checks_downpush 240 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py
        TAIL=12 step downpush_modes 300 torchrun --nproc_per_node 2 tests/gpu/bench_env_modes.py --modes "${MODES:-epdownpush}" ;;
    dact)  # the dgrad of down + activation backward: two kernels vs mok_gemm_dact (call by call)
        TAIL=20 step dact_gemms 150 python3 tests/gpu/bench_gemm_variants.py --gemms dgrad_down ;;
    wgrad)  # weight-gradient kernels: resident clusters per cluster size, the wgrad GPU tests, the variants call by call
        TAIL=8 step cluster_occupancy 60 bash -c "nvcc -arch=sm_90a -o /tmp/cluster_occupancy tests/gpu/cluster_occupancy.cu && /tmp/cluster_occupancy"
        TAIL=5 step wgrad_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_kernels.py -k weight_grad
        TAIL=20 step wgrad_clusters 200 python3 tests/gpu/bench_wgrad_variants.py --diag 0 --reps 20 \
            --kernels "${WGRAD_KERNELS:-mok_gemm_wgrad_defer_c2,mok_gemm_wgrad_defer}" ;;
    macrobatch)  # MoKConfig.macrobatch_size: the GPU tests, then passes vs one pass (EP=1; EP=2 where 2 GPUs)
        TAIL=5 step macrobatch_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "macrobatch or accumulates"
        TAIL=12 step macrobatch_ep1 300 python3 tests/gpu/bench_macrobatch.py
        if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
            TAIL=12 step macrobatch_ep2 300 torchrun --nproc_per_node 2 tests/gpu/bench_macrobatch.py
        fi ;;
    envmodes)  # the layer under env settings side by side (tests/gpu/bench_env_modes.py; MODES=gather)
        TAIL=12 step env_modes_ep1 240 python3 tests/gpu/bench_env_modes.py --modes "${MODES:-gather}" ;;
    epenvmodes)
        TAIL=12 step env_modes_ep2 240 torchrun --nproc_per_node 2 tests/gpu/bench_env_modes.py --modes "${MODES:-gather}" ;;
    epdispatch)  # the EP checks with the dispatch as one mok_ep_dispatch_rows launch, then pull vs rows side by side
        MOK_EP_DISPATCH=rows TAIL=8 step ep_checks_dispatch_rows 240 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py
        TAIL=12 step env_modes_epdispatch 240 torchrun --nproc_per_node 2 tests/gpu/bench_env_modes.py --modes epdispatch ;;
    epslot)  # the EP checks with one pushed row per slot everywhere (MOK_EP_COMBINE_SUMS=slot)
        MOK_EP_COMBINE_SUMS=slot TAIL=8 step ep_checks_slot 240 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py ;;
    eprank)  # the EP checks with per-rank partial sums everywhere (MOK_EP_COMBINE_SUMS=rank)
        MOK_EP_COMBINE_SUMS=rank TAIL=8 step ep_checks_rank 240 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py ;;
    epgather)  # the EP checks with the gate/up GEMM gathering from the tokens section
        MOK_GEMM_GATHER=1 TAIL=8 step ep_checks_gather 240 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py ;;
    eppublish)  # step 1 of the EP forward as one launch (MOK_EP_PUBLISH=kernel) vs the torch ops
        TAIL=5 step ep_publish_tests 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ep_publish.py
        TAIL=8 step ep_publish_bench_ep1 120 python3 tests/gpu/bench_ep_publish.py
        TAIL=8 step ep_publish_bench_ep2 150 torchrun --nproc_per_node 2 tests/gpu/bench_ep_publish.py
        TAIL=12 step env_modes_eppublish 240 torchrun --nproc_per_node 2 tests/gpu/bench_env_modes.py --modes eppublish ;;
    scatter)  # mok_scatter_rows (MOK_GATHER_ROWS=scatter): its GPU tests, call by call vs the gather, the EP checks with it
        TAIL=5 step scatter_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_kernels.py \
            tests/gpu/test_cuda_layer.py -k "scatter or gather_rows"
        TAIL=40 step bench_gather_rows 200 python3 tests/gpu/bench_gather_rows.py --ctas-per-sm 4,8
        if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
            MOK_GATHER_ROWS=scatter TAIL=8 step ep_checks_scatter 240 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py
        fi ;;
    sweep)  # MoKConfig's knobs side by side per shape (tests/gpu/sweep_config.py)
        TAIL=16 step sweep_config_ep1 300 python3 tests/gpu/sweep_config.py
        if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
            TAIL=30 step sweep_config_ep2 300 torchrun --nproc_per_node 2 tests/gpu/sweep_config.py
        fi ;;
    clocks)  # SM clock, power and temperature every 100 ms while the deepseek-v3 benchmark runs (mok and baseline
        # alternate): how far the clocks drop, the source of the spread
        # of its backward ratio (v162: the GPU at its 700 W limit, SM clock 1155-1710 MHz)
        nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
            -lms 100 > "$OUT/clocks_deepseek.csv" &
        local_smi=$!
        TAIL=4 step bench_clocks_deepseek 240 python3 -m mok_nn.bench --shapes deepseek-v3 --out "$OUT/bench_clocks_deepseek.json"
        kill $local_smi
        python3 -c "
import statistics, sys
rows = [l.split(', ') for l in open(sys.argv[1]) if l.count(',') == 3]
clk = [float(r[1]) for r in rows]; pw = [float(r[2]) for r in rows]
print(f'{len(rows)} samples: SM clock MHz min {min(clk):.0f} median {statistics.median(clk):.0f} max {max(clk):.0f}; '
      f'power W median {statistics.median(pw):.0f} max {max(pw):.0f}')
" "$OUT/clocks_deepseek.csv" | tee "$OUT/clocks_summary.txt" ;;
    stageenergy)  # per-stage time and energy (profile_stages.py with STAGE_ENERGY=1), deepseek-v3 by default
        for sh in ${SHAPES:-deepseek-v3}; do
            STAGE_ENERGY=1 TAIL=40 step "stage_energy_$sh" 150 python3 tests/gpu/profile_stages.py "$sh" 8192
        done ;;
    energy)  # energy per call (NVML counter), mok_nn modes vs the baseline, back to back (tests/gpu/diag_energy.py)
        TAIL=40 step energy 300 python3 tests/gpu/diag_energy.py --shapes "${SHAPES:-deepseek-v3}" \
            --modes "${ENERGY_MODES:-default}" ;;
    tilesab)  # the default tiles vs MOK_GEMM_TILES=dynamic (the dgrad of gate/up too) in the layer: benchmark processes
        # alternating, energy per call, the GEMMs' sustained time and energy (docs/kernels.md, v181)
        for i in 1 2; do
            TAIL=4 step "bench_tiles_default_$i" 240 python3 -m mok_nn.bench --out "$OUT/bench_tiles_default_$i.json"
            MOK_GEMM_TILES=dynamic TAIL=4 step "bench_tiles_dynamic_$i" 240 python3 -m mok_nn.bench \
                --out "$OUT/bench_tiles_dynamic_$i.json"
        done
        TAIL=12 step energy_tiles 300 python3 tests/gpu/diag_energy.py --shapes deepseek-v3,qwen3-30b-a3b \
            --modes default,MOK_GEMM_TILES=dynamic
        TAIL=20 step tail_skip_energy 300 python3 tests/gpu/diag_tail_skip.py --shapes deepseek-v3,qwen3-30b-a3b \
            --gemms down,dgrad_gate_up,dgrad_down --energy 1.0 ;;
    tailskip)  # the cooperative GEMMs with static / dynamic tiles, with and without the tail skip, call by call
        TAIL=40 step tail_skip 300 python3 tests/gpu/diag_tail_skip.py --shapes "${SHAPES:-deepseek-v3,qwen3-30b-a3b}" ;;
    sanitize)  # compute-sanitizer over small forward+backward passes (tests/gpu/sanitize_layer.py); each tool's
        # own error count in its log's last lines; SANITIZE_CASES limits racecheck / synccheck (slow)
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=8 step sanitize_memcheck 240 compute-sanitizer --tool memcheck \
            --error-exitcode 3 python3 tests/gpu/sanitize_layer.py
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=8 step sanitize_planted 120 compute-sanitizer --tool memcheck \
            python3 tests/gpu/sanitize_layer.py --plant-oob
        echo "planted out-of-bounds read reported in mok_combine_k2: $(grep -c "Invalid __global__ read" \
            "$OUT/sanitize_planted.log") time(s), $(grep -c "mok_combine_k2" "$OUT/sanitize_planted.log") line(s) name it"
        for tool in racecheck synccheck; do
            TAIL=8 step "sanitize_$tool" 150 compute-sanitizer --tool "$tool" --error-exitcode 3 \
                python3 tests/gpu/sanitize_layer.py --cases "${SANITIZE_CASES:-small,h-over-4096}"
        done ;;
    pack)  # the device tool returns few files: one archive of all logs
        tar czf /tmp/logs.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/logs.tgz "$OUT/logs.tgz" ;;
    *) echo "unknown step $s" ;;
    esac
done
