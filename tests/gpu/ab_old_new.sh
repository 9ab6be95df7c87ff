# EP=2 benchmark A/B of an older commit against the checkout on one machine, alternating (old, new) twice.
# Prepare here (the device has no DSL; carry build):
#   git archive <commit> mok_nn csrc | tar -x -C build/ab_old
#   (cd build/ab_old && PYTHONPATH=$PWD python -m mok_nn.kernels.build --arch sm_90a --out ../ab_old_kernels/sm_90a)
# then on the device: AB_SHAPES=qwen3-30b-a3b,deepseek-v3 bash tests/gpu/ab_old_new.sh
# Each variant runs from its own folder (python -m puts the working directory first on sys.path).
KC_NEW=$PWD/build/kernels; KC_OLD=$PWD/build/ab_old_kernels
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then PP=$PWD/build/ab_old KC=$KC_OLD; else PP=$PWD KC=$KC_NEW; fi
    (cd $PP && MOK_KERNEL_CACHE=$KC PYTHONPATH=$PP timeout 120 torchrun --nproc_per_node 2 -m mok_nn.bench --shapes ${AB_SHAPES:-qwen3-30b-a3b} --no-check --out $OUT/ab_${v}_$i.json > $OUT/ab_${v}_$i.log 2>&1)
    echo "== $v $i rc=$?"; grep -A8 "^shape" $OUT/ab_${v}_$i.log | head -9
  done
done
