#!/usr/bin/env bash
# On the GPU machine: the decode-throughput table of BENCHMARKS.md, the
# megakernel and the graphs baseline back to back in one call (random
# weights), then one profiled North Mini Code step with its timeline:
#   bash scripts/gpu_bench_table.sh "$OUT"
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
out="${1:?output folder}"
megac() { python3 -c "from megac.cli import main; main()" "$@"; }
for model in north-mini-code smollm2-135m; do
  ctx=1024,8192
  [ "$model" = smollm2-135m ] && ctx=1024,4096  # its context ends at 8192
  for backend in cuda graphs; do
    echo "== $model $backend"
    megac bench "$model" --backend "$backend" --random-weights --batch-size 1,2,4,8 --context "$ctx" \
      --steps 30 --json "$out/bench-$model-$backend.json" 2>&1 | grep -v "it/s\]" | tail -14
  done
done
echo "== profile"
megac bench north-mini-code --backend cuda --random-weights --batch-size 1 --context 8192 --steps 10 \
  --profile "$out/profile-nmc-bs1-8k.json" --plot "$out/timeline-nmc-bs1-8k.png" 2>&1 | tail -12
