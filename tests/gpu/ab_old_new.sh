# A/B on one machine: old code (build/ab_old, 259934b) vs the checkout, qwen3 EP=2, alternating
export MOK_KERNEL_CACHE=$PWD/build/kernels
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then PP=$PWD/build/ab_old; else PP=$PWD; fi
    PYTHONPATH=$PP timeout 120 torchrun --nproc_per_node 2 -m mok_nn.bench --shapes ${AB_SHAPES:-qwen3-30b-a3b} --no-check --out $OUT/ab_${v}_$i.json > $OUT/ab_${v}_$i.log 2>&1
    echo "== $v $i rc=$?"; grep -A3 "^shape" $OUT/ab_${v}_$i.log | head -4
  done
done
