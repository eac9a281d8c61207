#!/usr/bin/env bash
# On the GPU machine: the decode-throughput tables of BENCHMARKS.md (random
# weights), the megakernel and the graphs baseline back to back in one call.
#   bash scripts/gpu_bench_table.sh "$OUT" [table|long|smollm2|ablation|profile ...]
# table:    North Mini Code, batch 1-8 x context 1K, 8K, 32K: cuda, graphs, waves
# pair:     the same, cuda and graphs only
# long:     North Mini Code at 128K, batch 1-8 (one weight copy each: bench's cuda engines give the
#           canonical copy back, graphs never had a second)
# smollm2:  SmolLM2-135M's shape, batch 1-8 x 1K, 4K, both backends
# ablation: the three wave orders, uniform and skewed routing, batch 1 and 8 at 8K
# profile:  one profiled North Mini Code step (bs1, 8K) and its timeline
# profiles: a profiled step per PROFILE_CASES (batch:context), for the cost model's fit
# stepgraph: the cuda rows again with MEGAC_STEP_GRAPH=0 (separate seed and launch, no step graph)
# experiments: tuned and every schedules/experiments/*.yaml order, North Mini Code batch 1 and 8 at 8K
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
out="${1:?output folder}"
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(table long smollm2 ablation profile)
megac() { python3 -c "from megac.cli import main; main()" "$@"; }
bench() {  # name, then megac bench arguments
  local name=$1
  shift
  echo "== $name"
  megac bench "$@" --random-weights --json "$out/bench-$name.json" 2>&1 | grep -v "it/s\]" | tail -22
}
for part in "${parts[@]}"; do
  case $part in
    table)
      for b in cuda graphs waves; do
        bench "nmc-$b" north-mini-code --backend $b --batch-size 1,2,4,8 --context 1024,8192,32768 --steps 30
      done ;;
    pair)  # table's megakernel and graphs rows alone (the ratio table)
      for b in cuda graphs; do
        bench "nmc-$b" north-mini-code --backend $b --batch-size 1,2,4,8 --context 1024,8192,32768 --steps 30
      done ;;
    long)
      for b in cuda graphs; do
        bench "nmc-128k-$b" north-mini-code --backend $b --batch-size 1,2,4,8 --context 131072 --steps 20
      done ;;
    smollm2)
      for b in cuda graphs; do
        bench "smollm2-$b" smollm2-135m --backend $b --batch-size 1,2,4,8 --context 1024,4096 --steps 30
      done ;;
    ablation)
      for r in uniform skewed; do
        bench "nmc-orders-$r" north-mini-code --backend cuda --batch-size 1,8 --context 8192 --order all \
          --routing $r --steps 20 --no-ceiling
      done
      bench "nmc-graphs-skewed" north-mini-code --backend graphs --batch-size 1,8 --context 8192 \
        --routing skewed --steps 20 --no-ceiling ;;
    stepgraph)
      MEGAC_STEP_GRAPH=0 bench "nmc-cuda-nostepgraph" north-mini-code --backend cuda --batch-size 1,2,4,8 \
        --context 1024,8192 --steps 30 ;;
    experiments)
      for o in tuned schedules/experiments/*.yaml; do
        bench "nmc-order-$(basename "$o" .yaml)" north-mini-code --backend cuda --batch-size 1,8 --context 8192 \
          --order "$o" --steps 30 --no-ceiling
      done ;;
    profile)
      echo "== profile"
      megac bench north-mini-code --backend cuda --random-weights --batch-size 1 --context 8192 --steps 10 \
        --profile "$out/profile-nmc-bs1-8k.json" --plot "$out/timeline-nmc-bs1-8k.png" 2>&1 | tail -12 ;;
    profiles)  # PROFILE_CASES="[MODEL:]B:C ..." (default North Mini Code 1:8192 4:1024 4:8192 8:8192)
      for mbc in ${PROFILE_CASES:-1:8192 4:1024 4:8192 8:8192}; do
        IFS=: read -r -a f <<< "$mbc"
        [ ${#f[@]} -eq 2 ] && f=(north-mini-code "${f[@]}")
        m=${f[0]} b=${f[1]} c=${f[2]}
        echo "== profile $m bs$b ctx$c"
        megac bench "$m" --backend cuda --random-weights --batch-size "$b" --context "$c" --steps 10 \
          --profile "$out/profile-$m-bs$b-$c.json" --json "$out/bench-profiled-$m-bs$b-$c.json" 2>&1 \
          | grep -v "it/s\]" | tail -8
        gzip -f "$out/profile-$m-bs$b-$c.json"  # a call brings back only so many files, and smaller
      done ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
