#!/bin/bash
# Eighteenth session's GPU battery (run on the device machine, from the repo
# root): bash scripts/gpu_session18.sh [orders|battery|variants|tiles|profile]
mkdir -p build/cubin && cp build/cubin-sel/* build/cubin/ && source scripts/gpu_env.sh
what=${1:-orders}
if [ "$what" = orders ]; then
  MEGAC_VARIANTS=${VARS:-default} MEGAC_ORDER_TILES=${OTILES:-default} MEGAC_TILE_BATCHES=${TB:-1,8} \
    MEGAC_TILE_CONTEXTS=${TC:-8192,32768} \
    MEGAC_VARIANT_ORDERS=${ORDERS:-tuned,schedules/experiments/full-attn-half.yaml,tuned} \
    timeout ${T2:-330} python3 -m gpu.megakernel_check --run order_variants --out $OUT/orders.json 2>&1 | grep -v Warning | tail -12
fi
if [ "$what" = battery ]; then
  timeout ${T1:-500} python3 -m gpu.megakernel_check --run ${CHECKS:-tiny hang routed nmc_full} --out $OUT/battery.json 2>&1 \
    | grep -v Warning | tail -${TAIL:-25}
fi
if [ "$what" = variants ]; then
  MEGAC_VARIANT_MODELS=${MODELS:-north-mini-code} MEGAC_VARIANTS=${VARS:-default,prime_inline} \
    MEGAC_VARIANT_CASES=${CASES:-1:8192,8:8192,4:32768,8:32768} timeout ${T1:-300} \
    python3 -m gpu.megakernel_check --run variants --out $OUT/variants.json 2>&1 | grep -v Warning | tail -12
fi
if [ "$what" = tiles ]; then
  MEGAC_VARIANTS=default MEGAC_TILES=${TILES:-fused_combine} MEGAC_TILE_BATCHES=${TB:-1} \
    MEGAC_TILE_CONTEXTS=${TC:-8192,32768} timeout ${T1:-300} \
    python3 -m gpu.megakernel_check --run tiles --out $OUT/tiles.json 2>&1 | grep -v Warning | tail -12
fi
if [ "$what" = profile ]; then
  MEGAC_PROFILE_CASES=${CASES:-1:8192} MEGAC_PROFILE_TILES=${TILES:-} MEGAC_PROFILE_VARIANTS=${VARS:-} \
    timeout ${T1:-400} python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json 2>&1 \
    | grep -v Warning | cut -c1-600 | tail -${TAIL:-8}
fi
