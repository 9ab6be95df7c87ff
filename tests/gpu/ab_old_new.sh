# Benchmark A/B of an older commit against the checkout on one machine, alternating (old, new) AB_REPS times
# (default 2), EP = AB_NPROC ranks (default 2; 1 runs the EP = 1 path under torchrun).
# Prepare here (the device has no DSL; carry build):
#   git archive <commit> mok_nn csrc | tar -x -C build/ab_old
#   (cd build/ab_old && PYTHONPATH=$PWD python -m mok_nn.kernels.build --arch sm_90a --out ../ab_old_kernels/sm_90a)
# (where the kernels' sources are the same in both, the checkout's library serves both: AB_SAME_KERNELS=1)
# then on the device: AB_SHAPES=qwen3-30b-a3b,deepseek-v3 bash tests/gpu/ab_old_new.sh
# AB_HOST=1: also, per variant, the host time per forward (tests/gpu/profile_host.py, EP = 1) and the timeline
# of one forward from an idle GPU (tests/gpu/timeline_ep_forward.py), for the first shape.
# Each variant runs from its own folder (python -m puts the working directory first on sys.path).
KC_NEW=$PWD/build/kernels; KC_OLD=$PWD/build/ab_old_kernels
[ "${AB_SAME_KERNELS:-0}" = 1 ] && KC_OLD=$KC_NEW
NPROC=${AB_NPROC:-2}; SHAPES=${AB_SHAPES:-qwen3-30b-a3b}; FIRST=${SHAPES%%,*}; GPU_DIR=$PWD/tests/gpu
for i in $(seq 1 "${AB_REPS:-2}"); do
  for v in old new; do
    if [ $v = old ]; then PP=$PWD/build/ab_old KC=$KC_OLD; else PP=$PWD KC=$KC_NEW; fi
    (cd $PP && MOK_KERNEL_CACHE=$KC PYTHONPATH=$PP timeout 150 torchrun --nproc_per_node $NPROC -m mok_nn.bench --shapes $SHAPES --no-check --out $OUT/ab_${v}_$i.json > $OUT/ab_${v}_$i.log 2>&1)
    echo "== $v $i rc=$?"; grep -A8 "^shape" $OUT/ab_${v}_$i.log | head -9
    if [ "${AB_HOST:-0}" = 1 ]; then
      (cd $PP && MOK_KERNEL_CACHE=$KC PYTHONPATH=$PP:$GPU_DIR timeout 120 python3 $GPU_DIR/profile_host.py $FIRST 8192 2>&1 | head -2)
      (cd $PP && MOK_KERNEL_CACHE=$KC PYTHONPATH=$PP:$GPU_DIR timeout 120 torchrun --nproc_per_node 1 $GPU_DIR/timeline_ep_forward.py $FIRST 2>&1 | grep -E "kernel launch|GEMM|combine|schedule|call" | head -12)
    fi
  done
done
