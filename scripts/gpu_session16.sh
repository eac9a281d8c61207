#!/bin/bash
# Sixteenth session's GPU battery: the down claims' L2 prefetch variants,
# the attention-share orders and the MoE combine inside the norm (run on the
# device machine, from the repo root): bash scripts/gpu_session16.sh [all|variants|orders|tiles]
mkdir -p build/cubin && cp build/cubin-sel/* build/cubin/ && source scripts/gpu_env.sh
what=${1:-all}
if [ "$what" = all ] || [ "$what" = variants ]; then
  MEGAC_VARIANT_MODELS=north-mini-code MEGAC_VARIANTS=${VARS:-default,down_l2,down_l2_last} \
    MEGAC_VARIANT_CASES=${CASES:-1:8192,8:8192,4:32768} timeout ${T1:-260} \
    python3 -m gpu.megakernel_check --run variants --out $OUT/variants.json 2>&1 | grep -v Warning | tail -12
fi
if [ "$what" = all ] || [ "$what" = orders ]; then
  MEGAC_VARIANTS=default MEGAC_TILE_BATCHES=1,8 MEGAC_TILE_CONTEXTS=8192,32768 \
    MEGAC_VARIANT_ORDERS=${ORDERS:-tuned,schedules/experiments/attn-half.yaml,schedules/experiments/attn-half-oproj.yaml,tuned} \
    timeout ${T2:-320} python3 -m gpu.megakernel_check --run order_variants --out $OUT/orders.json 2>&1 | grep -v Warning | tail -12
fi
if [ "$what" = tiles ]; then
  MEGAC_TILES=${TILES:-default,fused_combine} MEGAC_TILE_BATCHES=${TB:-1} MEGAC_TILE_CONTEXTS=${TC:-8192,32768} \
    timeout ${T3:-400} python3 -m gpu.megakernel_check --run tiles --out $OUT/tiles.json 2>&1 | grep -v Warning | tail -12
fi
