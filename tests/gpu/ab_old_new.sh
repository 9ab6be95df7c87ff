# A/B on one machine: old code (build/ab_old, 259934b) vs the checkout, qwen3 EP=2, alternating
KC_NEW=$PWD/build/kernels; KC_OLD=$PWD/build/ab_old_kernels
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then PP=$PWD/build/ab_old KC=$KC_OLD; else PP=$PWD KC=$KC_NEW; fi
    (cd $PP && MOK_KERNEL_CACHE=$KC PYTHONPATH=$PP timeout 120 torchrun --nproc_per_node 2 -m mok_nn.bench --shapes ${AB_SHAPES:-qwen3-30b-a3b} --no-check --out $OUT/ab_${v}_$i.json > $OUT/ab_${v}_$i.log 2>&1)
    echo "== $v $i rc=$?"; grep -A8 "^shape" $OUT/ab_${v}_$i.log | head -9
  done
done
