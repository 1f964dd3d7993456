#!/usr/bin/env bash
# Step time and state per rank of every sharding granularity at tbf 100mbit, 4 ranks, the
# benchmark transformer, batch 32, with each optimizer: Adam by element slices and by whole
# parameters, Adafactor and Muon + AdamW as chosen (whole parameters; AdamW's part by
# element slices), against DDP and ZeroRedundancyOptimizer with the same optimizers.
# Three launches of each (the noise budget); run from the repository root, as root.
set -euo pipefail
out=benchmarks/results/shard_granularity/${1:-launches_a}
mkdir -p "$out"
for run in 1 2 3; do
  for opt in adam adafactor muon; do
    configs=ddp,zero,shard-optimizer
    [ "$opt" = adam ] && configs=$configs,shard-optimizer/shard_by=parameters
    .venv/bin/python benchmarks/train.py --nprocs 4 --model transformer --optimizer "$opt" \
      --batch-sizes 32 --shape "rate 100mbit" --iters 6 --warmup 4 --rounds 2 \
      --configs "$configs" --json "$out/transformer_100mbit_b32_${opt}_run$run.json" \
      > "$out/transformer_100mbit_b32_${opt}_run$run.txt" 2>&1
  done
done
