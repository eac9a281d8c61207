# GPU runs of the twenty-fourth and later sessions (from the repo root on the device machine).
# The cubins travel prebuilt (carry build/cubin-sel and .whl). The twenty-seventh session's set, for
# next1 .. next4 and bench, built on the CPU machine with:
#   MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=abort16,sig_acqrel,pair,hops \
#   MEGAC_PROFILE_VARIANTS=hops MEGAC_PROFILE_TILES=split1_own MEGAC_ORDER_TILES=none \
#   .venv/bin/python -m gpu.megakernel_check --prebuild north-mini-code smollm2-135m nmc-split1_own nmc-kvh \
#     nmc-split1_own_kvh nmc-slice-split1_own nmc-slice-kvh nmc-split1_own_oqkv
#   MEGAC_VARIANTS=hops ... --prebuild tiny-llama; and tiny-llama's hops build for next3's hang check:
#   PYTHONPATH=.:tests .venv/bin/python -c "from gpu import megakernel_scale as s; from megac.spec import \
#     load_spec; print(s.variant_cubin(load_spec('tiny-llama'), s.VARIANTS['hops']))"
# then the cubins they print (but the interleaved / attention-first orders') copied into build/cubin-sel.
# cubins travel as build/cubin-sel (as built) or build/cz/cubins.tar.xz (a carry holds 64 MiB with the
# tree; cubins compress ~18x, twenty-eighth session). Since the forty-second session the tracked profile
# traces (~51 MB) leave no room for that carry: `bash scripts/traces_aside.sh out` before the call,
# `... back` after it.
mkdir -p build/cubin && { cp build/cubin-sel/* build/cubin/ 2>/dev/null; true; }
[ -f build/cz/cubins.tar.xz ] && tar -C build/cubin -xJf build/cz/cubins.tar.xz
source scripts/gpu_env.sh
E=schedules/experiments
run_orders() {  # tiles orders batches vars
  MEGAC_VARIANTS=${4:-default} MEGAC_ORDER_TILES=$1 MEGAC_TILE_BATCHES=$3 MEGAC_TILE_CONTEXTS=8192 MEGAC_VARIANT_ORDERS=$2 \
    timeout ${T:-300} python3 -m gpu.megakernel_check --run order_variants --out $OUT/o_$1.json 2>&1 | grep -v Warning | grep '^{"' 
}
pack_cubins() {  # the cubins a prebuild's log (stdin) names, with their .json, into build/cz-s31 and its archive
  grep -o "/[^ ]*\.cubin" | while read -r c; do cp "$c" "$c.json" build/cz-s31/ 2>/dev/null || cp "$c" build/cz-s31/; done
  rm -f build/cz-s31/log.txt && tar -C build/cz-s31 -cJf build/cz/cubins.tar.xz . && ls -la build/cz
}
prebuild_start() {  # an empty build/cz-s31 for the next set (its log.txt: what pack_cubins packs)
  rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz && : > build/cz-s31/log.txt
}
prebuild_specs() {  # megakernel_check --prebuild of these specs into the log (SKIP_RE: the lines not packed,
                    # by default the interleaved and attention-first orders' builds; PB_VARIANTS: the VARIANTS
                    # built beside, by default the default alone)
  MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=${PB_VARIANTS:-default} MEGAC_ORDER_TILES=none \
    .venv/bin/python -m gpu.megakernel_check --prebuild "$@" 2>&1 | grep -v Warning \
    | grep -v "${SKIP_RE:-(interleaved)\|(attention-first)}" | tee -a build/cz-s31/log.txt
}
prebuild_variants() {  # scripts/prebuild_builds.py's SPEC:VARIANT builds into the log
  PYTHONPATH=.:tests .venv/bin/python scripts/prebuild_builds.py "$@" 2>&1 | grep -v Warning | tee -a build/cz-s31/log.txt
}
prebuild_ceiling() {  # megac bench's ceiling read kernel (megac/gpu/ceiling.py) into the log
  .venv/bin/python -c "from megac.gpu.build import build_cubin; from megac.gpu.ceiling import SOURCE; print(build_cubin(SOURCE))" \
    | tee -a build/cz-s31/log.txt
}
profile_variant() {  # one profiled bs1 8K step of the default and of VARIANTS name $1 on one engine (PT: its
                     # timeout), their traces gzipped into $OUT
  MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_VARIANTS=$1 timeout ${PT:-300} python3 -m gpu.megakernel_check \
    --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"\|Error\|error' | cut -c1-300
  for f in $OUT/*.trace.json; do gzip -q "$f"; done
  rm -f $OUT/profile-north-mini-code-bs1-ctx8192.json $OUT/profile-north-mini-code-bs1-ctx8192-$1.json; ls -la $OUT
}
profile_tiles() {  # one profiled step of North Mini Code at cases $1 ("B:CTX,...") and of TILES sets $2 (PT: its
                  # timeout; MEGAC_PROFILE_ORDER / MEGAC_PROFILE_TILES_ONLY pass through), the traces gzipped into
                  # $OUT, the raw records dropped (a call returns 8 files; the traces hold what megac trace reads)
  MEGAC_PROFILE_CASES=$1 MEGAC_PROFILE_TILES=$2 timeout ${PT:-200} python3 -m gpu.megakernel_check --run profile \
    --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"\|Error\|error' | cut -c1-200
  for f in $OUT/*.trace.json; do gzip -q "$f"; done
  rm -rf $OUT/profile-*.json $OUT/profile.json
}
tiny_variant() {  # the tiny models against the VM under VARIANTS name $1 ("": the headers' default; check
                  # tiny), one line of results
  env ${1:+MEGAC_CHECK_VARIANT=$1} timeout 150 python3 -m gpu.megakernel_check --run tiny --out $OUT/tiny.json \
    > $OUT/tiny.log 2>&1; echo tiny rc $?
  python3 -c "import json; d=json.load(open('$OUT/tiny.json/megakernel_check.json'))['tiny']; print(d['ok'], {m: (r['tokens_equal_vm'], r['adopted_step_bit_identical'], r['repeat_bit_identical'], r['min_cos_vs_vm']) for m, r in d['result'].items()})"
}
tiny_tiles() {  # the tiny models against the VM under TILES set $1 (check tiny, MEGAC_TINY_TILES; $2: its
                # timeout), into $OUT/tiny-$1.json, one line of results
  MEGAC_TINY_TILES=$1 timeout ${2:-150} python3 -m gpu.megakernel_check --run tiny --out $OUT/tiny-$1.json \
    > $OUT/tiny-$1.log 2>&1; echo tiny $1 rc $?
  python3 -c "import json; d=json.load(open('$OUT/tiny-$1.json/megakernel_check.json'))['tiny']; print(d['ok'], {m: (r['tokens_equal_vm'], r['adopted_step_bit_identical'], r['repeat_bit_identical'], r['alone_equals_batch'], r['min_cos_vs_vm'], r['alone_tokens_equal_vm'], r['alone_min_cos_vs_vm']) for m, r in d['result'].items()})" 2>&1 | tail -2
}
grid_128k() {  # megac bench of today's default at bs 1-8 x 128K (the grid's second part; GK: its timeout)
  timeout ${GK:-400} python3 -c "from megac.cli import main; main()" bench north-mini-code --backend cuda --random-weights \
    --batch-size 1,2,4,8 --context 131072 --steps 20 --json $OUT/grid128k.json 2>&1 \
    | grep -v Warning | tee $OUT/grid128k.log | tail -8
}
verify() {  # a build checked as a default would be: $1 its VARIANTS name ("": the headers' default), $2 a tag
  # for the files; then the row counts of the North Mini Code slice against fp32. tiny: the tiny models
  # against the VM; hang: the watchdog on its waits
  local v=$1 tag=$2; shift 2
  env ${v:+MEGAC_CHECK_VARIANT=$v MEGAC_HANG_VARIANT=$v} timeout 200 python3 -m gpu.megakernel_check --run tiny hang \
    --out $OUT/verify.json > $OUT/verify.log 2>&1; echo verify rc $?
  python3 -c "import json; d=json.load(open('$OUT/verify.json/megakernel_check.json')); print({k: (v.get('ok'), str(v)[:300]) for k, v in d.items()})"
  for r in "$@"; do
    env ${v:+MEGAC_CHECK_VARIANT=$v} MEGAC_CHECK_ROWS=$r timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-$tag-$r.json 2>&1 | grep -v Warning | tail -2 | cut -c1-300
  done
}
prebuild_checked() {  # a variant's set: $1 its VARIANTS name under the tiny models and the slice (what verify
                      # checks), its plain NMC build (TILES nmc-$1) beside the default's, and the profiled builds
                      # of the default and of $2 (default: $1)
  prebuild_start
  prebuild_variants tiny-moe:$1 tiny-llama:$1 nmc-slice:$1
  MEGAC_PROFILE_VARIANTS=${2:-$1} SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs \
    tiny-llama tiny-moe nmc-slice north-mini-code nmc-$1
  pack_cubins < build/cz-s31/log.txt
}
ab_vs() {  # VARIANTS name $1 against the default, engines alternating at bs1 ($2 rounds after the first pair)
           # until AB_END s (default $3), if 90 s or more are left
  local t=default,$1 i left
  for i in $(seq 1 $2); do t=$t,default#$i,$1#$i; done
  left=$((${AB_END:-$3} - SECONDS)); echo "ab gets ${left}s"
  [ $left -gt 90 ] && AT=$left TB=1 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60
}
case "${1:-tails}" in
  tails)
    run_orders default tuned,$E/tail-on-oproj.yaml,$E/tail-on-finalize.yaml,tuned 1,8
    run_orders sd8_up128 $E/split-norm-on-finalize.yaml,$E/split-norm-on-oproj.yaml,$E/split-norm-on-finalize.yaml 1 ;;
  oproj)
    run_orders sd8_up128 $E/split-norm-on-finalize.yaml,$E/split-oproj-on-attn.yaml,$E/split-oproj-on-attn-sliding.yaml,$E/split-norm-on-finalize.yaml 1
    run_orders sd8_up128_o256 $E/split-norm-on-finalize.yaml,$E/split-oproj-on-attn.yaml,$E/split-oproj-on-attn-sliding.yaml 1 ;;
  best)
    run_orders sd8_up128_o256 $E/split-oproj-on-attn.yaml 1,2,4,8 attn_prime
    run_orders o256 tuned,$E/tuned-oproj-on-attn.yaml,tuned 1,8
    run_orders sd1_up128_o256 $E/split-oproj-on-attn.yaml 1,2,4,8 ;;
  profile)
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_TILES=${PT:-sd8_up128_o256} MEGAC_PROFILE_ORDER=${PO:-$E/split-oproj-on-attn.yaml} \
      timeout 400 python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-160
    gzip -q $OUT/*.json 2>/dev/null; ls -la $OUT ;;
  ab)  # engines alternating: the default and TILES=$AB, bs1 (TB) 8K; AT: its timeout (s); AB_OUT: the JSON's name
    MEGAC_VARIANTS=default MEGAC_TILES=${TLIST:-$AB,default#1,$AB#1,default#2,$AB#2} MEGAC_TILE_BATCHES=${TB:-1} \
      MEGAC_TILE_CONTEXTS=${TC:-8192} timeout ${AT:-560} python3 -m gpu.megakernel_check --run tiles --out $OUT/${AB_OUT:-ab}.json 2>&1 \
      | grep -v Warning | grep '^{"' ;;
  verify)  # the device changes: tiny and hang, fp32 slices of TILES sets SLICE (ROWS rows)
    timeout 300 python3 -m gpu.megakernel_check --run tiny hang --out $OUT/battery.json 2>&1 | grep -v Warning | tail -6
    for t in $(echo ${SLICE:-split8} | tr , " "); do
      MEGAC_CHECK_TILES=$t MEGAC_CHECK_ROWS=${ROWS:-2} timeout 300 python3 -m gpu.megakernel_check --run nmc_slice \
        --out $OUT/slice-$t.json 2>&1 | grep -v Warning | tail -4
    done ;;
  own)  # the split on its own 128-row up tiles beside the plain 256 (twenty-sixth session, not yet run):
        # fp32 slices at 1 row (split tiles) and 2 (plain tiles over two chunks), then A/B against the default.
        # Prebuild: MEGAC_VARIANTS=default ... --prebuild nmc-slice-split1_own nmc-split1_own north-mini-code
    for r in 1 2; do
      MEGAC_CHECK_TILES=split1_own MEGAC_CHECK_ROWS=$r timeout 200 python3 -m gpu.megakernel_check --run nmc_slice \
        --out $OUT/slice-own-$r.json 2>&1 | grep -v Warning | tail -3 | cut -c1-400
    done
    TLIST=split1_own,default#1,split1_own#1,default#2 TB=${TB:-1,2,8} bash "$0" ab ;;
  kvh)  # the KV pools head-major (twenty-sixth session, not yet run): fp32 slices (tensor copies, then
        # 16-byte pieces), then A/B against the default at bs 1 and 8 (the slow-engine spread: several engines)
        # Prebuild: MEGAC_VARIANTS=default ... --prebuild nmc-slice-kvh nmc-kvh north-mini-code
    for m in 1 0; do
      MEGAC_KV_TMAPS=$m MEGAC_CHECK_TILES=kvh timeout 200 python3 -m gpu.megakernel_check --run nmc_slice \
        --out $OUT/slice-kvh-$m.json 2>&1 | grep -v Warning | tail -3 | cut -c1-400
    done
    TLIST=kvh,default#1,kvh#1,default#2,kvh#2,default#3 TB=${TB:-1,8} bash "$0" ab ;;
  next1)  # the twenty-sixth session's two changes, their fp32 slices in one call (~3 min). Prebuild:
          # MEGAC_VARIANTS=default ... --prebuild nmc-slice-split1_own nmc-slice-kvh nmc-split1_own nmc-kvh north-mini-code
    for r in 1 2; do
      MEGAC_CHECK_TILES=split1_own MEGAC_CHECK_ROWS=$r timeout 200 python3 -m gpu.megakernel_check --run nmc_slice \
        --out $OUT/slice-own-$r.json 2>&1 | grep -v Warning | tail -2 | cut -c1-300
    done
    for m in 1 0; do
      MEGAC_KV_TMAPS=$m MEGAC_CHECK_TILES=kvh timeout 200 python3 -m gpu.megakernel_check --run nmc_slice \
        --out $OUT/slice-kvh-$m.json 2>&1 | grep -v Warning | tail -2 | cut -c1-300
    done ;;
  next2)  # and both against the default, engines alternating (~4 min at bs 1 and 8)
    TLIST=split1_own,kvh,default#1,split1_own#1,kvh#1,default#2 TB=${TB:-1,8} bash "$0" ab ;;
  next3)  # the twenty-seventh session's hop switches (counters.cuh, common.cuh), each build against the
          # default, interleaved, the bits checked (~5 min; NMC bs 1 and 8 at 8K, SmolLM2 bs 1), after
          # the watchdog's check on their build (tiny-llama)
    MEGAC_HANG_VARIANT=hops timeout 120 python3 -m gpu.megakernel_check --run hang --out $OUT/hang-hops.json 2>&1 \
      | grep -v Warning | tail -3 | cut -c1-400
    MEGAC_VARIANTS=${V:-abort16,sig_acqrel,pair,hops} MEGAC_VARIANT_ROUNDS=${R:-2} \
      timeout 560 python3 -m gpu.megakernel_check --run variants --out $OUT/variants.json 2>&1 \
      | grep -v Warning | grep '^{"' ;;
  next4)  # profiled bs1 8K steps with the hand-off marks (8-11, profile_marks.cuh): the default, and
          # with the three hop switches, then the split on its own up tiles (traces under $OUT)
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_VARIANTS=${PV:-hops} timeout 400 python3 -m gpu.megakernel_check \
      --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-600
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_TILES=split1_own timeout 400 python3 -m gpu.megakernel_check \
      --run profile --out $OUT/profile-own.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-600
    gzip -q $OUT/*.json 2>/dev/null; ls -la $OUT ;;
  next5)  # the O-projection over twice the SMs in the split schedule (split1_own_oqkv, its own order
          # file; the cost model predicts +12 %) against the split on its own up tiles, bs1 8K
    TLIST=split1_own_oqkv,split1_own,split1_own_oqkv#1,split1_own#1 TB=1 bash "$0" ab ;;
  next6)  # the twenty-eighth session's GEMM ring cursor (gemm_tc.cuh MEGAC_TC_WALK_POS), with the ranking on
          # two threads a logit and the one-row claimer's placement (ops_moe.cuh MEGAC_ROUTED_ONE_ROW), each
          # against the default, interleaved, bits checked; then profiled bs1 8K steps (default, walkpos_1row).
          # Prebuild: MEGAC_VARIANTS=walkpos,rank_halves,walkpos_rank,walkpos_1row
          #   MEGAC_PROFILE_VARIANTS=walkpos_1row ... --prebuild north-mini-code smollm2-135m
    MEGAC_VARIANTS=${V:-walkpos,rank_halves,walkpos_rank,walkpos_1row} MEGAC_VARIANT_ROUNDS=${R:-3} \
      timeout 400 python3 -m gpu.megakernel_check --run variants --out $OUT/variants.json 2>&1 \
      | grep -v Warning | grep '^{"'
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_VARIANTS=${PV:-walkpos_1row} timeout 200 python3 -m gpu.megakernel_check \
      --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-300
    gzip -q $OUT/*.json 2>/dev/null; ls $OUT ;;
  s28)  # next6 with the rings of more, smaller stages, then the cursor with the tile sets (engines alternating)
    V=walkpos,rank_halves,walkpos_rank,walkpos_1row,walkpos_4x4,walkpos_3x6 bash "$0" next6
    TLIST=wp,wp_up128,wp_split1_own,default#1,wp#1,wp_up128#1,wp_split1_own#1 TB=1,8 bash "$0" ab ;;
  s28b)  # the cursor (its SmolLM2 fix), with the one-row placement, with X by cp.async, interleaved, 4
          # rounds, bits checked; then profiled bs1 8K steps (default, wp_x)
    V=walkpos,walkpos_1row,wp_x,walkpos_x R=4 PV=wp_x bash "$0" next6
    verify wp_x wpx 1 2 ;;  # and the wp_x build checked as a default would be
  s28c)  # s28b shortened (no profile, 3 rounds, the slice at one row): for a short device budget
    MEGAC_VARIANTS=walkpos,walkpos_1row,wp_x,walkpos_x MEGAC_VARIANT_ROUNDS=3 timeout 300 python3 -m gpu.megakernel_check \
      --run variants --out $OUT/variants.json 2>&1 | grep -v Warning | grep '^{"'
    verify wp_x wpx 1 ;;
  s29)  # the down claims' ring primed before their waits (ops_moe.cuh MEGAC_DOWN_PRIME) and 10 KB stages, each
         # against the default and wp_x, interleaved, bits checked; profile of wp_x_dp; wp_x_dp checked as a
         # default would be (tiny against the VM, the watchdog, the fp32 slice at one and two rows)
    V=${V:-walkpos_1row,wp_x,wp_dp,wp_x_dp,wp_st10} R=${R:-3} PV=wp_x_dp bash "$0" next6
    verify wp_x_dp dp 1 2 ;;
  s29b)  # s29's builds interleaved over more rounds (each round's median kept), then wp_x_dp through tiny and hang
    V=${V:-walkpos_1row,wp_x,wp_dp,wp_x_dp,wp_st10} bash "$0" s29b_variants
    verify wp_x_dp dp ;;
  s29v)  # the new default (the cursor per model, the one-row placement, X by cp.async, the down claims primed)
         # checked (tiny against the VM, the watchdog, the fp32 slice at one and two rows), against the
         # twenty-eighth session's default interleaved, then the 128-feature down tiles
    verify "" default 1 2
    V=s28_default R=${R:-8} bash "$0" s29b_variants
    # 128-feature down tiles (TILES dn128) against the default, engines alternating
    TLIST=dn128,default#1,dn128#1,default#2 TB=1,8 bash "$0" ab ;;
  # s31 / s31b's cubins (thirtieth session, no device lent): on the CPU machine, `bash scripts/dev_s24.sh
  # prebuild_s31` (~10 min on 2 cores) writes build/cz/cubins.tar.xz; carry ["build/cz", ".whl"]
  prebuild_s31)
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=dp2,acp,dp2_acp,uds,uds_acp MEGAC_ORDER_TILES=none \
      MEGAC_PROFILE_TILES=cs8 .venv/bin/python -m gpu.megakernel_check --prebuild north-mini-code smollm2-135m \
      tiny-llama tiny-moe nmc-slice nmc-cs8 nmc-cs16 nmc-dn128 2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    grep -v "(interleaved)\|(attention-first)" build/cz-s31/log.txt | pack_cubins ;;
  prebuild_add)  # more cubins into prebuild_s31's archive (thirty-second session): PB="nmc-r8 nmc-up128",
                 # and the default build of the orders PO on North Mini Code (check order_variants)
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_ORDER_TILES=$([ -n "$PO" ] && echo default || echo none) MEGAC_PROFILE_TILES=$PT MEGAC_PROFILE_ORDER=${PRO:-tuned} \
      MEGAC_VARIANT_ORDERS=$PO MEGAC_VARIANTS=default .venv/bin/python -m gpu.megakernel_check \
      --prebuild $PB 2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s33)  # the thirty-third session's set (its batch-1 candidate, then the default, against the default
                 # before it, then TILES s32, now s33 the other way round; the head-major pools kvh, the order
                 # routed-norm-on-finalize; the tiny models and the slice for verify)
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=default \
      MEGAC_VARIANT_ORDERS=tuned,$E/routed-norm-on-finalize.yaml .venv/bin/python -m gpu.megakernel_check \
      --prebuild north-mini-code smollm2-135m tiny-llama tiny-moe nmc-slice nmc-s33 nmc-kvh 2>&1 | grep -v Warning \
      | tee build/cz-s31/log.txt
    grep -v "(interleaved)\|(attention-first)" build/cz-s31/log.txt | pack_cubins ;;
  s33)  # the thirty-third session's batch-1 candidate (router over 8 SMs, the combine over 8 ranges at batch
         # 1, a full layer's up claimers first at batch 1: TILES s33) against the default, engines alternating
         # at bs1 and bs8, then megac bench (as run then, with the candidate as the default: verify "" s33 1
         # first, and the default before it as TILES s32). Prebuild: bash scripts/dev_s24.sh prebuild_s33
    TLIST=${TLIST:-s33,default#1,s33#1,default#2,s33#2,default#3,s33#3} TB=1,8 bash "$0" ab
    BT=${BT:-260} bash "$0" bench ;;
  s33b)  # the norm on the finalize SM at batch 1 (routed-norm-on-finalize) against tuned, an engine each
          # (as run: tuned then held routed-full-up-first's waves and the s33 tiles);
          # the head-major pools (kvh) against the default, engines alternating (the engines' addresses
          # recorded: what the bimodal engines share); profiles of four default engines
    T=200 run_orders default ${SO:-tuned,$E/routed-norm-on-finalize.yaml,tuned,$E/routed-norm-on-finalize.yaml,tuned,$E/routed-norm-on-finalize.yaml} 1
    TLIST=${TLIST:-kvh,default#1,kvh#1,default#2,kvh#2} TB=1 bash "$0" ab
    MEGAC_PROFILE_CASES=${PC:-1:8192,1:8192,1:8192,1:8192} timeout ${PT:-240} python3 -m gpu.megakernel_check --run profile \
      --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-300
    gzip -q $OUT/*.json $OUT/*/*.json 2>/dev/null; ls -la $OUT ;;
  prebuild_bench)  # North Mini Code's default build alone (megac bench), into the carried archive
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=none \
      .venv/bin/python -m gpu.megakernel_check --prebuild north-mini-code 2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    grep -v "(interleaved)\|(attention-first)\|\[profile\]" build/cz-s31/log.txt | pack_cubins ;;
  prebuild_s33c)  # after prebuild_bench: the x_then_ring build (plain and profiled) of NMC and SmolLM2
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=x_then_ring MEGAC_PROFILE_VARIANTS=x_then_ring \
      MEGAC_ORDER_TILES=none .venv/bin/python -m gpu.megakernel_check --prebuild north-mini-code smollm2-135m 2>&1 \
      | grep -v Warning | grep -v "(interleaved)\|(attention-first)" | tee build/cz-s31/log.txt | pack_cubins ;;
  s33c)  # megac bench of the default; then the expert claims' ring issued before their X copies (x_then_ring:
          # the ~1.1 us between a claim's weight span and its ring's first copies, stamps 11 -> 10) against
          # the default, interleaved on one engine (bits checked), and its profiled step beside the default's
    BT=200 bash "$0" bench
    V=${V:-x_then_ring} R=${R:-4} bash "$0" s29b_variants
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_VARIANTS=x_then_ring timeout 200 python3 -m gpu.megakernel_check \
      --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-300
    gzip -q $OUT/*.json 2>/dev/null; ls $OUT ;;
  prebuild_s34)  # the one-row ranking on warp 0 (topk_warp), and with the first claim issued early (topk_warp_fe):
                 # North Mini Code plain and profiled, each build;
                 # the tiny models and the slice with it (verify), the routing battery's two builds
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    PYTHONPATH=.:tests .venv/bin/python scripts/prebuild_builds.py north-mini-code north-mini-code:topk_warp \
      north-mini-code:topk_warp_fe north-mini-code:profile north-mini-code:profile+topk_warp \
      north-mini-code:profile+topk_warp_fe nmc-slice:topk_warp nmc-slice:topk_warp_fe tiny-moe:topk_warp \
      tiny-moe:topk_warp_fe tiny-llama:topk_warp tiny-llama:topk_warp_fe nmc-up128:profile \
      nmc-up128:profile+topk_warp_fe nmc-up128:topk_warp_fe 2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    PYTHONPATH=.:tests .venv/bin/python -c "from megac.gpu import build; from gpu.blocks import moe_routing as m; \
      [print(build.build_cubin(m.SOURCE, defines=d)) for d in m.BUILDS.values()]" | tee -a build/cz-s31/log.txt
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=none \
      .venv/bin/python -m gpu.megakernel_check --prebuild nmc-w nmc-fe nmc-up128_fe nmc-up192_fe nmc-up128 \
      2>&1 | grep -v Warning | tee -a build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  s34up)  # profiled bs1 8K steps: 128-row up tiles (96 claims) with and without topk_warp_fe, beside the
          # default's; then the one-row fp32 slices of topk_warp and topk_warp_fe (their JSON printed)
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_TILES=up128 MEGAC_PROFILE_VARIANTS=topk_warp_fe timeout 300 \
      python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-200
    for v in topk_warp topk_warp_fe; do
      MEGAC_CHECK_VARIANT=$v MEGAC_CHECK_ROWS=1 timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
        --out $OUT/slice-$v.json > /dev/null 2>&1
      python3 -c "import json; print('$v', json.dumps(json.load(open('$OUT/slice-$v.json/megakernel_check.json')))[:600])"
    done
    gzip -q $OUT/*.json 2>/dev/null; rm -rf $OUT/slice-*.json $OUT/profile.json; ls $OUT ;;
  prebuild_s34b)  # one down claim an SM (dc1) with and without topk_warp and the 128-row up tiles, as TILES
                  # sets; the tiny models with dc1 (verify); the default
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    PYTHONPATH=.:tests .venv/bin/python scripts/prebuild_builds.py tiny-moe:dc1 tiny-llama:dc1 \
      2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=none \
      .venv/bin/python -m gpu.megakernel_check --prebuild north-mini-code nmc-dc1 nmc-up128_dc1 nmc-up128_wdc1 \
      nmc-wdc1 nmc-w 2>&1 | grep -v Warning | grep -v "(interleaved)\|(attention-first)\|\[profile\]" \
      | tee -a build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  s34c)  # dc1 checked on the tiny models (against the VM), then the dc1 sets against the default, engines
         # alternating at bs1. Prebuild: prebuild_s34b
    verify dc1 dc1
    TLIST=${TLIST:-up128_wdc1,default,wdc1,up128_dc1,dc1,w,default#1,up128_wdc1#1,wdc1#1,default#2,w#1,dc1#1} \
      TB=${TB:-1} bash "$0" ab ;;
  prebuild_s35)  # LM head tiles of 512 / 1024 rows (TILES lm512, lm1024), a met claim's counter read once
                 # (or, wor with topk_warp), one up claim an SM (uc1, woruc1 with both), the tiny models with
                 # one_read and uc1 for verify, every small gain together (s35), the default; the default
                 # and lm1024 profiled
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    PYTHONPATH=.:tests .venv/bin/python scripts/prebuild_builds.py tiny-moe:one_read tiny-llama:one_read \
      tiny-moe:uc1 tiny-llama:uc1 nmc-lm1024:profile north-mini-code:profile north-mini-code:uc1 \
      north-mini-code:profile+uc1 nmc-lm1024:uc1 nmc-lm1024:profile+uc1 2>&1 | grep -v Warning \
      | tee build/cz-s31/log.txt
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=none \
      .venv/bin/python -m gpu.megakernel_check --prebuild north-mini-code nmc-lm1024 nmc-lm512 nmc-s35 \
      nmc-or nmc-wor nmc-uc1 nmc-woruc1 2>&1 | grep -v Warning | grep -v "(interleaved)\|(attention-first)\|\[profile\]" \
      | tee -a build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  s35)  # one_read and uc1 checked on the tiny models (against the VM) and the watchdog; the s35 sets against
        # the default, engines alternating at bs1 (TB), the SM clock sampled beside (~6 min).
        # Prebuild: prebuild_s35; then s35p
    verify one_read or
    verify uc1 uc1
    # the SM clock, power and throttle reasons every 0.5 s beside it (are the ~2.58 / ~2.67 modes clocks?),
    # each engine's line stamped with the time it printed
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv,noheader -lms 500 > $OUT/smi.csv 2>&1 & SMI=$!
    TLIST=${TLIST:-lm1024,default,s35,uc1,or,woruc1,default#1,s35#1,uc1#1,lm512,default#2,uc1#2,wor,s35#2} \
      TB=${TB:-1} bash "$0" ab | while read -r l; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $l" | cut -c1-140; done
    kill $SMI 2>/dev/null ;;
  s35p)  # profiled bs1 8K steps: the default and lm1024, each plain and with uc1 (does the O-projection
         # behind an up claim, and the late down claims, start ~1 us sooner? the LM head's phase with
         # 4 MB tiles). Prebuild: prebuild_s35
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_TILES=lm1024 MEGAC_PROFILE_VARIANTS=uc1 timeout 500 \
      python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json 2>&1 | grep -v Warning \
      | grep '^{"' | cut -c1-200
    gzip -q $OUT/*.json 2>/dev/null; ls $OUT ;;
  s34ab)  # the tile sets w, fe, up128_fe, up192_fe against the default, engines alternating (bs TB, 8K)
    TLIST=${TLIST:-fe,default#1,w#1,up128_fe,fe#1,default#2,up192_fe,w#2,fe#2,default#3} TB=${TB:-1} bash "$0" ab ;;
  s34)  # topk_warp against the default interleaved on one engine, R rounds at bs1 and bs8 (and one bs1
        # step's logits: the same bits), then the routing battery (both builds, bit-exact against
        # megac/routing.py). Prebuild: prebuild_s34
    MEGAC_VARIANT_MODELS=north-mini-code MEGAC_VARIANT_STEP_BITS=1:8192 V=${V:-topk_warp,topk_warp_fe} R=${R:-6} bash "$0" s29b_variants
    timeout 200 python3 -m gpu.blocks.moe_routing --quick --json $OUT/moe_routing.json > /dev/null 2>&1
    python3 -c "import json; d=json.load(open('$OUT/moe_routing.json')); c=d['checks']; \
      print('battery', len(c), 'checks,', 'failed:', [x['name'] for x in c if not x['ok']][:10]); \
      print([(b['name'], b['time_us']) for b in d['bench']])" ;;
  s34v)  # topk_warp and topk_warp_fe checked as a default would be: the tiny models against the VM, the
         # watchdog, the one-row fp32 slice; then the profiled steps (s34p)
    verify topk_warp warp 1
    verify topk_warp_fe warpfe 1
    bash "$0" s34p ;;
  s34p)  # the profiled steps of the default and topk_warp (bs1 8K): the marks of the up claimers' first claim
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_VARIANTS=${PV:-topk_warp,topk_warp_fe} timeout 250 python3 -m gpu.megakernel_check \
      --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-300
    gzip -q $OUT/*.json 2>/dev/null; ls $OUT ;;
  s32a)  # wave orders SO (default: a full layer's up claimers before its claimed attention,
          # schedules/experiments/full-up-first.yaml, and the thirty-second session's other experiments)
          # against tuned, an engine each, at the batches TB (default 1)
    T=560 run_orders default ${SO:-tuned,$E/full-up-first.yaml,$E/up-first-b.yaml,$E/up-first.yaml,$E/full-up-first-oq.yaml,tuned} ${TB:-1} ;;
  s32b)  # the router over 8 SMs (r8), then 128-row up tiles at batch 1, against the default
    TLIST=r8,default#1,r8#1,default#2 TB=1,8 bash "$0" ab
    TLIST=up128,default#1,up128#1,default#2 TB=1 bash "$0" ab ;;
  s32c)  # the small batch-1 gains together against the default (bs1 and bs8, engines alternating), then
          # the profiled steps of the default and of cs8 under full-up-first. Prebuild: PB="nmc-cs8_fuf
          # nmc-cs8_r8_fuf nmc-cs8" with MEGAC_PROFILE_TILES=cs8 MEGAC_PROFILE_ORDER=$E/full-up-first.yaml
    TLIST=cs8_r8_fuf,cs8_fuf,default#1,cs8_r8_fuf#1,cs8_fuf#1,default#2,cs8_r8_fuf#2,cs8_fuf#2 TB=1,8 bash "$0" ab
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_TILES=cs8 MEGAC_PROFILE_ORDER=$E/full-up-first.yaml timeout 200 \
      python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-200
    gzip -q $OUT/*.json $OUT/*/*.json 2>/dev/null; ls -la $OUT ;;
  s31)  # the next session's battery, in priority order: megac bench of the default (BENCHMARKS.md has none
         # since the twenty-ninth session's change of default), then the drained up claimers stopped before
         # their ranking (uds, thirty-first session), the claimed attention splits primed (acp) and both,
         # against the default on one engine (8 rounds, each round's median, bits checked); then uds checked
         # as a default would be (its tiny-model and slice builds are not in the archive: nvcc there builds
         # them, ~15 s each)
    BT=280 bash "$0" bench
    V=${V:-uds,acp,uds_acp} R=${R:-8} bash "$0" s29b_variants
    verify uds uds 1 ;;
  s31c)  # every down claim primed (dp2) and with acp, against the default; acp checked as a default
    V=${V:-dp2,acp,dp2_acp} R=${R:-8} bash "$0" s29b_variants
    verify acp acp 1 ;;
  s31d)  # a full layer's O-projection tiles before the up claimers (schedules/experiments/full-oproj-first.yaml,
         # thirty-first session) against tuned, bs1 and bs8; then with the drained up claimers stopped (uds)
    run_orders default tuned,$E/full-oproj-first.yaml,tuned,$E/full-oproj-first.yaml 1,8
    run_orders default tuned,$E/full-oproj-first.yaml,tuned 1 uds ;;
  s31e)  # the router over 8 SMs (TILES r8, thirty-first session) against the default, engines alternating;
         # then 128-row up tiles at batch 1 (up128: 96 claims; a full layer's 48 one-per-SM up claims stream
         # alone at ~2.6 TB/s from ~22 to ~36 us): if batch 1 gains, per-batch up tiles are worth building
    TLIST=r8,default#1,r8#1,default#2 TB=1,8 bash "$0" ab
    TLIST=up128,default#1,up128#1,default#2 TB=1 bash "$0" ab ;;
  s31b)  # the combine over 8 and 16 feature ranges and the 128-feature down tiles against the default
         # (engines alternating, bs1 and bs8), then the profiled step of cs8
    TLIST=cs8,dn128,default#1,cs8#1,dn128#1,default#2 TB=1,8 bash "$0" ab
    TLIST=cs16,default#1,cs16#1 TB=1,8 bash "$0" ab
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_TILES=cs8 timeout 200 python3 -m gpu.megakernel_check --run profile \
      --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-300 ;;
  s29b_variants)  # the builds $V interleaved on one engine, $R rounds, each round's median kept
    MEGAC_VARIANT_RAW=1 MEGAC_VARIANTS=$V MEGAC_VARIANT_ROUNDS=${R:-10} timeout 420 python3 -m gpu.megakernel_check \
      --run variants --out $OUT/variants.json 2>&1 | grep -v Warning | grep '^{"' ;;
  prebuild_s36)  # the thirty-sixth session's default (TILES s35 made the default): the tiny models, the
                 # slice, North Mini Code (every order: bench) and the sets old35 (the default before) and lm256
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=none \
      .venv/bin/python -m gpu.megakernel_check --prebuild tiny-llama tiny-moe nmc-slice north-mini-code \
      nmc-old35 nmc-lm256 nmc-r16 nmc-rcs16 2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  s36)  # the new default checked as a default (the tiny models against the VM, the watchdog, the one-row
        # fp32 slice), then against the default before it (old35) and itself with 256-row LM head tiles,
        # engines alternating at bs1 and bs8 (~7 min). Prebuild: prebuild_s36
    verify "" new 1
    TLIST=${TLIST:-default,old35,lm256,r16,default#1,old35#1,rcs16,lm256#1,default#2,old35#2,r16#1,default#3,old35#3,rcs16#1} \
      TB=${TB:-1,8} bash "$0" ab | cut -c1-160 ;;
  s36b)  # s36 with 10 engines, then megac bench of the new default at bs1 and bs8 (one call, ~8 min)
    TLIST=${TLIST:-default,old35,lm256,r16,default#1,old35#1,rcs16,default#2,old35#2,lm256#1} bash "$0" s36
    BS=1,8 BT=${BT:-170} bash "$0" bench ;;
  s37v)  # the default checked as a default, alone (fits an H100): tiny models against the VM, the watchdog,
         # the fp32 slice at one and two rows
    verify "" new 1 2 ;;
  s37)  # the new default in one call of <10 min, most needed first: its checks (s37v), megac bench at bs1
        # and bs8, then engines alternating against the default before it (old35) at bs1 while time is left
    verify "" new 1
    BS=1,8 BT=${BT:-170} bash "$0" bench
    left=$((${AB_END:-570} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TLIST=old35,default#1,old35#1,default#2,old35#2 TB=1 bash "$0" ab | cut -c1-160 ;;
  prebuild_s38)  # the thirty-eighth session's headers: what s37 needs (the default's checks, bench, old35) and
                 # the polled combine (cpoll) for its checks and the A/B (s38)
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    PYTHONPATH=.:tests .venv/bin/python scripts/prebuild_builds.py tiny-moe:cpoll tiny-llama:cpoll nmc-slice:cpoll \
      2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=none \
      .venv/bin/python -m gpu.megakernel_check --prebuild tiny-llama tiny-moe nmc-slice north-mini-code nmc-old35 \
      nmc-cpoll 2>&1 | grep -v Warning | tee -a build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  s38)  # the polled combine (cpoll) checked as a default would be, then against the default, engines
        # alternating at bs1 until AB_END s, then megac bench of the default at bs1 (~9.5 min). Prebuild: prebuild_s38
    verify cpoll cpoll 1
    left=$((${AB_END:-420} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TLIST=${TLIST:-cpoll,default#1,cpoll#1,default#2,cpoll#2,default#3,cpoll#3} TB=${TB:-1} \
      bash "$0" ab | cut -c1-160
    BS=1 BT=$((565 - SECONDS)) bash "$0" bench ;;
  prebuild_s39)  # the thirty-eighth session's final headers: what s39, s39b and s39p need (the default, its
                 # profiled build, old35), the polled combine (cpoll: checked on the H100, so its set alone) and the
                 # paired down claims (dn128p, dn128p16) with the tiny models and the slice for dpair's checks; the
                 # other orders left out (no call runs them; the carry's 64 MiB)
    rm -rf build/cz-s31 && mkdir -p build/cz-s31 build/cz
    PYTHONPATH=.:tests .venv/bin/python scripts/prebuild_builds.py tiny-moe:dpair tiny-llama:dpair nmc-slice:dpair \
      2>&1 | grep -v Warning | tee build/cz-s31/log.txt
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests MEGAC_VARIANTS=default MEGAC_ORDER_TILES=none \
      .venv/bin/python -m gpu.megakernel_check --prebuild tiny-llama tiny-moe nmc-slice north-mini-code nmc-old35 \
      nmc-cpoll nmc-dn128p nmc-dn128p16 nmc-dn128p_oa nmc-dn128p_o256_oa 2>&1 | grep -v Warning \
      | grep -v "(interleaved)\|(attention-first)" | tee -a build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s40)  # the fortieth session's final headers (MEGAC_QKV_L2 added; the default's machine code
                 # unchanged): the default and its profiled build, the tiny models and the slice under qkvl2
                 # for its checks, the qkvl2 / qkvl2e sets, dn128p (the H200 read it -0.9 %)
    prebuild_start
    prebuild_variants tiny-moe:qkvl2 tiny-llama:qkvl2 nmc-slice:qkvl2
    prebuild_specs tiny-llama tiny-moe nmc-slice north-mini-code nmc-qkvl2 nmc-qkvl2e nmc-dn128p
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s41)  # prebuild_s40's set and the O-projection's pull toward L2 beside qkvl2 (MEGAC_OPROJ_AHEAD:
                 # qkvl2_ot in the tail, qkvl2_oh in the routing hole)
    prebuild_start
    prebuild_variants tiny-moe:qkvl2 tiny-llama:qkvl2 nmc-slice:qkvl2
    prebuild_specs tiny-llama tiny-moe nmc-slice north-mini-code nmc-qkvl2 nmc-qkvl2e nmc-qkvl2_ot nmc-qkvl2_oh
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s41b)  # the split on its own up tiles (split1_own: the twenty-eighth session's -1.5 % at bs1, +1.1 %
                  # at bs8) on today's code, its fp32 slice, and dn128p
    prebuild_start
    prebuild_specs tiny-llama tiny-moe nmc-slice north-mini-code nmc-split1_own nmc-slice-split1_own nmc-dn128p nmc-rs8
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s41b)  # (prebuild_s41b, ~6 min) split1_own's fp32 slices at one row (split tiles) and two (plain tiles over
         # 64-row chunks), then default / split1_own / rs8 (dn128p every other round) alternating at bs1 and bs8
    for r in 1 2; do
      MEGAC_CHECK_TILES=split1_own MEGAC_CHECK_ROWS=$r timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
        --out $OUT/slice-own-$r.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    done
    t=default,split1_own,rs8,dn128p; for i in 1 2 3 4 5 6 7; do t=$t,default#$i,split1_own#$i,rs8#$i; [ $((i % 2)) = 0 ] && t=$t,dn128p#$i; done
    left=$((${AB_END:-560} - SECONDS)); echo "ab gets ${left}s"
    AT=$left TB=${TB:-1,8} TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-120 ;;
  grid)  # today's default over the grid (bs 1,2,4,8 x 1K, 8K, 32K; then 128K), one engine, for the
         # cost model's refit (megac calibrate TRACE --steps); GT: the first part's timeout
    timeout ${GT:-330} python3 -c "from megac.cli import main; main()" bench north-mini-code --backend cuda --random-weights \
      --batch-size 1,2,4,8 --context 1024,8192,32768 --steps 30 --json $OUT/grid.json 2>&1 \
      | grep -v Warning | tee $OUT/grid.log | tail -16
    left=$((${GRID_END:-585} - SECONDS)); echo "128K gets ${left}s"
    [ $left -gt 60 ] && GK=$left grid_128k ;;
  s41c)  # (prebuild_s41b) rs8 against the default, engines alternating at bs1 (~2 min), then grid's two benches
    t=default,rs8; for i in 1 2 3 4 5 6; do t=$t,default#$i,rs8#$i; done
    AT=${AT:-170} TB=1 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60
    GT=$((${GRID_A_END:-400} - SECONDS)) GRID_END=$((585 - SECONDS)) bash "$0" grid ;;
  s41d)  # (prebuild_s41b, the walk-set-up stamp in its profiled build) rs8 and split1_own (its engines
          # adopt the default's weights re-interleaved in place) against the default, engines
          # alternating at bs1 (~2 min), one profiled bs1 8K step (s39p: which half of a GEMM tile's ~1 us
          # between its activations staged and its first stage landed is the wait), then, with 250 s left,
          # the grid's corners: bs 1 and 8 at 1K, 8K, 32K, 128K
    t=default,rs8,split1_own; for i in 1 2 3 4; do t=$t,default#$i,rs8#$i,split1_own#$i; done
    AT=${AT:-170} TB=1 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60
    BT=170 bash "$0" s39p
    left=$((585 - SECONDS)); echo "grid gets ${left}s"
    [ $left -gt 250 ] && timeout $left python3 -c "from megac.cli import main; main()" bench north-mini-code \
      --backend cuda --random-weights --batch-size 1,8 --context 1024,8192,32768,131072 --steps 20 \
      --json $OUT/grid.json 2>&1 | grep -v Warning | tee $OUT/grid.log | tail -12 ;;
  prebuild_s41e)  # the GEMM walk's divisions as shifts (p2div), with and without rs8, and the default
    prebuild_start
    SKIP_RE="(interleaved)\|(attention-first)\|\[profile\]" prebuild_specs north-mini-code nmc-p2div nmc-p2div_rs8 nmc-rs8
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s42)  # prebuild_s41e's set and what p2div's checks need (the tiny models and the slice under it)
    prebuild_start
    prebuild_variants tiny-moe:p2div tiny-llama:p2div nmc-slice:p2div
    SKIP_RE="(interleaved)\|(attention-first)\|\[profile\]" prebuild_specs tiny-llama tiny-moe nmc-slice \
      north-mini-code nmc-p2div nmc-p2div_rs8 nmc-rs8
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s42)  # (prebuild_s42, ~9.5 min) p2div checked as a default would be (tiny models against the VM, the
        # watchdog, the one-row fp32 slice), then p2div / p2div_rs8 / rs8 against the default, engines
        # alternating at bs1 until AB_END s
    verify p2div p2div 1
    t=default,p2div,p2div_rs8; for i in 1 2 3 4 5 6 7 8 9; do t=$t,default#$i,p2div#$i; [ $((i % 3)) = 0 ] && t=$t,p2div_rs8#$i,rs8#$i; done
    left=$((${AB_END:-560} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=${TB:-1} TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60 ;;
  sass_div)  # per function of each cubin named: its integer divisions (MUFU.RCP) and instructions
    for c in "${@:2}"; do  # past the entry's name
      echo "== $c"; cuobjdump -sass build/cubin/$c.cubin | awk '/Function :/ {f=$3} /MUFU.RCP/ {r[f]++} /\/\*[0-9a-f]+\*\// {n[f]++}
        END {for (f in n) printf "%6d instr %3d rcp  %s\n", n[f], r[f], substr(f, 1, 90)}' | sort -k1 -n -r | head -12
    done ;;
  s42h)  # (prebuild_s42) an H100: p2div checked as a default would be, the divisions left in its SASS,
         # then p2div against the default, engines alternating at bs1 until AB_END s
    verify p2div p2div 1
    bash "$0" sass_div megakernel-bcee9b0e2ce5ca613d45 megakernel-e001ee485c3e5a24256b megakernel-bfd7c0af619642e2f7af
    t=default,p2div; for i in 1 2 3 4 5 6 7 8 9 10 11 12; do t=$t,default#$i,p2div#$i; done
    left=$((${AB_END:-560} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=${TB:-1} TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60 ;;
  s42g)  # (prebuild_s42; its checks passed on an H100: s42h) the H200: p2div against the default, engines
         # alternating at bs1 (p2div_rs8 and rs8 every fourth round) until AB_END s, then the grid's first
         # part (bs 1-8 x 1K, 8K, 32K) until GRID_A_END s; the 128K part is grid128k's call
    t=default,p2div; for i in $(seq 1 20); do t=$t,default#$i,p2div#$i; [ $((i % 4)) = 0 ] && t=$t,p2div_rs8#$i,rs8#$i; done
    AT=$((${AB_END:-230} - SECONDS)) TB=1 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60
    GT=$((${GRID_A_END:-585} - SECONDS)) GRID_END=0 bash "$0" grid ;;
  grid128k)  # the grid's 128K part alone (GK: its timeout)
    grid_128k ;;
  prebuild_s42p)  # prebuild_s42's set and the profiled builds of the default and p2div (s42p)
    prebuild_start
    prebuild_variants tiny-moe:p2div tiny-llama:p2div nmc-slice:p2div
    MEGAC_PROFILE_VARIANTS=p2div SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs tiny-llama tiny-moe \
      nmc-slice north-mini-code nmc-p2div nmc-p2div_rs8 nmc-rs8
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s42p)  # (prebuild_s42p, ~4 min) one profiled bs1 8K step of the default and of p2div on one engine: did
         # the shifts shorten the stamps from activations staged to walk set up (the 0.6-0.8 us)?
    PT=${PT:-400} profile_variant p2div ;;
  s42any)  # (prebuild_s42p) whichever card came: an H200 runs s42g (p2div A/B, the grid's first part),
           # an H100 s42p (the default and p2div profiled, stamps 12-15 inside prime and tile_bulk)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" s42g; else bash "$0" s42p; fi ;;
  prebuild_s42w)  # the profiled builds of the default and tcwarm (tile_bulk's prologue run before the waits),
                  # tcwarm's plain build (TINY=1: and the tiny models under it), for s42w
    prebuild_start
    [ -n "$TINY" ] && prebuild_variants tiny-moe:tcwarm tiny-llama:tcwarm
    MEGAC_PROFILE_VARIANTS=tcwarm SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs \
      ${TINY:+tiny-llama tiny-moe} north-mini-code nmc-tcwarm
    pack_cubins < build/cz-s31/log.txt ;;
  sass_lines_of)  # where each named cubin's machine code comes from (scripts/sass_lines.py): per source file,
               # per call site in the kernel, per line
    for c in "${@:2}"; do  # past the entry's name
      echo "== $c"; nvdisasm --print-line-info build/cubin/$c.cubin | python3 scripts/sass_lines.py 24 | cut -c1-120
    done ;;
  s43)  # (TINY=1 prebuild_s42w) s42w, then where the default's 400 KB of code comes from
    TINY=$TINY bash "$0" s42w
    bash "$0" sass_lines_of megakernel-8aa9430340f5eb27eee3 > $OUT/sass_lines.txt 2>&1; head -c 3000 $OUT/sass_lines.txt ;;
  prebuild_s43b)  # the profiled builds of the default and of tcbisect (stamps through tile_bulk's prologue)
    prebuild_start
    MEGAC_PROFILE_VARIANTS=tcbisect SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs north-mini-code
    pack_cubins < build/cz-s31/log.txt ;;
  s43b)  # (prebuild_s43b, ~1.5 min) one profiled bs1 8K step of the default and of tcbisect, and the default's
         # SASS (gzipped into $OUT: read here, where no disassembler is)
    cuobjdump -sass build/cubin/megakernel-74ec55d787a27c4f602e.cubin | gzip > $OUT/default.sass.gz
    profile_variant tcbisect ;;
  prebuild_s43c)  # what tcwc's checks need (the tiny models and the slice under it), its plain build beside the
                  # default's, and the profiled builds of the default and of tcwc_bisect
    prebuild_checked tcwc tcwc_bisect ;;
  s43c)  # (prebuild_s43c, ~9 min) tcwc (prime() leaves the walk for tile_bulk) checked as a default would be
         # (tiny models against the VM, the watchdog, the one-row fp32 slice), one profiled bs1 8K step of
         # the default and of tcwc_bisect, then tcwc against the default, engines alternating at bs1 until
         # AB_END s
    verify tcwc tcwc 1
    PT=150 profile_variant tcwc_bisect
    ab_vs tcwc 12 500 ;;
  prebuild_s43h)  # the plain builds of the default and of tcwc, for s43h
    prebuild_start
    SKIP_RE="(interleaved)\|(attention-first)\|\[profile\]" prebuild_specs north-mini-code nmc-tcwc
    pack_cubins < build/cz-s31/log.txt ;;
  s43h)  # (prebuild_s43h; tcwc's checks passed on an H100: s43c) the H200: tcwc against the default,
         # engines alternating at bs1 until AB_END s
    ab_vs tcwc 14 300 ;;
  prebuild_s44p)  # the default's and rowsmem's plain and profiled builds (the attention split's stamps
                  # 12-15), and what rowsmem's checks need (the tiny models and the slice under it), for s44p
    prebuild_checked rowsmem ;;
  s44p)  # (prebuild_s44p, ~9 min, any GPU) rowsmem (the step's per-row words in shared memory) checked as a
         # default would be (tiny models against the VM, the watchdog, the one-row fp32 slice); one profiled
         # bs1 8K step of the default and of rowsmem: where a claimed attention split's 5-10 us before its
         # first chunk go (ATTN_DRAIN / ATTN_DECODE stamps 12-15); then rowsmem against the default, engines
         # alternating at bs1 until AB_END s
    verify rowsmem rowsmem 1
    PT=150 profile_variant rowsmem
    python3 -c "import json; r=json.load(open('$OUT/profile.json/megakernel_check.json'))['profile']['result']
for m in r:
    for k in ('ATTN_DRAIN', 'ATTN_DECODE'): print(m, k, r[m]['inside_tasks'].get(k))"
    ab_vs rowsmem 12 500 ;;
  prebuild_s44r)  # the router that folds the combine (TILES rcomb): the tiny models and the slice under it,
                  # its plain and profiled NMC builds beside the default's
    prebuild_start
    MEGAC_PROFILE_TILES=rcomb SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs \
      tiny-llama-rcomb tiny-moe-rcomb nmc-slice-rcomb north-mini-code nmc-rcomb
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s45q)  # the QKV tiles that add the combine beside the router that does (TILES rcqc): the tiny
                  # models and the slice under rcomb and rcqc, the plain NMC builds of the default, rcomb, rcqc
    prebuild_start
    SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs \
      tiny-llama-rcomb tiny-moe-rcomb tiny-llama-rcqc tiny-moe-rcqc tiny-llama-rcqcfc tiny-moe-rcqcfc nmc-slice-rcqc nmc-slice-rcqcfc \
      north-mini-code nmc-rcomb nmc-rcqc nmc-rcqcfc
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s45b)  # the new default (router_combine, qkv_combine) plain and profiled, the one before (TILES norc), the
                  # bench's ceiling kernel
    prebuild_start
    prebuild_specs north-mini-code nmc-norc
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s45b)  # (prebuild_s45b, ~7 min, any GPU; the H200 for the headline) megac bench of the default (rcqc) at bs1
         # with ENG engines, then it against the one before (norc), engines alternating at bs8 until AB_END s, then
         # one profiled bs1 8K step of it
    BT=${BT:-150} BS=1 ENG=${ENG:-3} bash "$0" bench
    t=default,norc; for i in $(seq 1 ${ROUNDS:-6}); do t=$t,default#$i,norc#$i; done
    left=$((${AB_END:-330} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 60 ] && AT=$left TB=${TB:-8} TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-80
    MEGAC_PROFILE_CASES=1:8192 timeout ${PT:-100} python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json \
      2>&1 | grep -v Warning | grep '^{"\|Error\|error' | cut -c1-300
    for f in $OUT/*.trace.json; do gzip -q "$f"; done
    rm -f $OUT/profile-*ctx8192*.json ;;
  prebuild_s46a)  # the default, the one before (TILES norc) and rbatch (the router's residual form two rows a load,
                  # ops_norm.cuh MEGAC_RESID_BATCH), plain and the default profiled
    prebuild_start
    prebuild_specs north-mini-code nmc-norc nmc-rbatch
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s46b)  # the up claims that fold the norm (TILES uc): the tiny models and the slice under it, the plain
                  # NMC builds of the default and uc; with s46a's set (norc, rbatch) and the bench's ceiling kernel
    prebuild_start
    SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs tiny-llama-uc tiny-moe-uc nmc-slice-uc \
      north-mini-code nmc-uc nmc-norc nmc-rbatch
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s46b)  # (prebuild_s46b, ~9 min, the H200) uc checked (the tiny models against the VM: tokens, a row alone
         # equal to it in a batch, repeat and adopted steps; the one-row NMC slice against fp32), then uc against
         # the default, engines alternating at bs1 until AB_END s
    tiny_tiles uc
    MEGAC_CHECK_TILES=uc MEGAC_CHECK_ROWS=1 timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-uc-1.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    t=default,uc; for i in $(seq 1 ${ROUNDS:-8}); do t=$t,default#$i,uc#$i; done
    left=$((${AB_END:-540} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=1 TLIST=$t bash "$0" ab | cut -c1-80 ;;
  s48a)  # (prebuild_s46c, then prebuild_s47b; any GPU, the H200 first) the two-row NMC slice
         # under rbatch (s46c's file did not come back: a call returns 8 files), then s47b; AB_END=250 PT=120 keeps
         # the call under its 10 minutes (the slice ~1.5 min, the A/B, the profile ~1.5 min)
    MEGAC_CHECK_VARIANT=rbatch MEGAC_CHECK_ROWS=2 timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-rbatch-2.json 2>&1 | grep -v Warning | grep -i "cos\|top\|ok\|error" | head -8 | cut -c1-300
    bash "$0" s47b ;;
  prebuild_s47b)  # (adds to prebuild_s46c's and prebuild_s47a's set) the up-free orders and up-free's profiled build
    prebuild_specs nmc-upfirstb
    MEGAC_PROFILE_TILES=upfree MEGAC_PROFILE_ORDER=schedules/experiments/up-free.yaml prebuild_specs nmc-upfree
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s48b)  # (adds to prebuild_s47b's set) up-free with smaller up claims
    prebuild_specs nmc-upfree_up128 nmc-upfree_up192
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s49)  # (a fresh checkout, ~7 min) what s48c and s49a-e need: the default, fs and the up-free orders' NMC
                 # builds, fs's tiny models and slice, fs's and fsuf's profiled builds, nfin / fs_nfin / tma3 / faf,
                 # the bench's ceiling kernel
    prebuild_start
    SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs north-mini-code tiny-llama-fs tiny-moe-fs nmc-slice-fs \
      nmc-nfin nmc-fs_nfin nmc-tma3 nmc-faf
    MEGAC_PROFILE_TILES=fs MEGAC_PROFILE_ORDER=schedules/experiments/full-static.yaml prebuild_specs nmc-fs
    MEGAC_PROFILE_TILES=upfree MEGAC_PROFILE_ORDER=schedules/experiments/up-free.yaml prebuild_specs nmc-upfree
    MEGAC_PROFILE_TILES=fsuf MEGAC_PROFILE_ORDER=schedules/experiments/up-free-static.yaml prebuild_specs nmc-fsuf
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s50)  # (a fresh checkout, ~4 min) what s50a needs: the default, the paired up claims (TILES up128p,
                 # up128p48, up128p_dn128p), dn128p and up128 for reference, up128p's one-row slice
    prebuild_start
    SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs north-mini-code nmc-up128p nmc-up128p48 \
      nmc-up128p_dn128p nmc-dn128p nmc-up128
    prebuild_variants nmc-slice-up128p:upair
    pack_cubins < build/cz-s31/log.txt ;;
  s50a)  # (prebuild_s50, any GPU, the H200 for the verdict; ~9.5 min) the paired up claims checked (the one-row
         # NMC slice under up128p against fp32), then default / up128p / up128p48 / up128p_dn128p / dn128p at bs1
         # 8K, engines alternating until AB_END s
    MEGAC_CHECK_TILES=up128p MEGAC_CHECK_VARIANT=upair MEGAC_CHECK_ROWS=1 timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-up128p-1.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    SETS=${SETS:-default,up128p,up128p48,up128p_dn128p,dn128p} AB_END=${AB_END:-560} ROUNDS=${ROUNDS:-6} bash "$0" s47a ;;
  prebuild_s50b)  # (~3 min) what s50b needs: the default, the slots-early probe (TILES se) and both profiled
    prebuild_start
    MEGAC_PROFILE_VARIANTS=slots_early prebuild_specs north-mini-code nmc-se
    pack_cubins < build/cz-s31/log.txt ;;
  s50b)  # (prebuild_s50b, any GPU; ~8 min) the slots-early timing probe (norm.cuh MEGAC_SLOTS_EARLY: one L2 round
         # trip off the folds of the QKV and router tiles and off the combine; its reads are unordered, so its
         # logits may differ) against the default, engines alternating at bs1 8K until AB_END s, then one
         # profiled bs1 8K step of each
    SETS=${SETS:-default,se} AB_END=${AB_END:-330} ROUNDS=${ROUNDS:-10} bash "$0" s47a
    [ $((${END:-560} - SECONDS)) -gt 90 ] && PT=$((${END:-560} - SECONDS - 10)) profile_variant slots_early
    true ;;
  prebuild_s52)  # (~6 min) the fold-marks profile build (s52m) beside the default's; the QKV prime probes (s52q)
    prebuild_start
    MEGAC_PROFILE_VARIANTS=fold_marks prebuild_specs north-mini-code nmc-qp1 nmc-qp0
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s52b)  # (~6 min) s52r's set: the router over 16 SMs alone and with qkvp1, r16's one-row slice
    prebuild_start
    prebuild_specs north-mini-code nmc-qp1 nmc-r16 nmc-qp1_r16
    prebuild_variants nmc-slice-r16
    pack_cubins < build/cz-s31/log.txt ;;
  s52r)  # (prebuild_s52b, any GPU; ~6 min) default / qp1 / r16 / qp1_r16 at bs1 8K, engines alternating until
         # AB_END s; then r16's one-row slice against fp32 (another split-K sum of the logits: other bits)
    SETS=${SETS:-default,qp1,r16,qp1_r16} AB_END=${AB_END:-330} ROUNDS=${ROUNDS:-8} bash "$0" s47a
    [ $((${END:-560} - SECONDS)) -gt 60 ] && MEGAC_CHECK_TILES=r16 MEGAC_CHECK_ROWS=1 \
      timeout $((${END:-560} - SECONDS - 10)) python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-r16-1.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    true ;;
  prebuild_s54t)  # (~1 min) the tiny models under router_poll, alone (s54t)
    prebuild_start
    prebuild_variants tiny-moe:router_poll tiny-llama:router_poll
    pack_cubins < build/cz-s31/log.txt ;;
  s54t)  # (prebuild_s54t, any GPU; ~2 min) the tiny models under router_poll against the VM
    tiny_variant router_poll ;;
  prebuild_s54)  # (~5 min) s54's set: router_poll checked as a default would be (the tiny models, the watchdog,
                 # the one-row slice), the tiny models under router_poll_uwe, the NMC builds of TILES rpoll,
                 # rpnn, rpfc, rpfcu, rpfcun beside the default's and the GEMM walk cached by prime() (tcwc, last timed on
                 # an H100), megac bench's ceiling kernel
    prebuild_start
    prebuild_variants tiny-moe:router_poll tiny-llama:router_poll nmc-slice:router_poll tiny-moe:router_poll_uwe \
      tiny-llama:router_poll_uwe
    prebuild_specs north-mini-code nmc-rpoll nmc-rpnn nmc-rpfc nmc-rpfcu nmc-rpfcun nmc-tcwc
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s54)  # (prebuild_s54, the H200; ~9 min) a routed claimer polling the router's partials (common.cuh
        # MEGAC_ROUTER_POLL): checked as a default would be, then default / rpoll / rpnn (its claims not
        # waiting on the norm: a timing probe, common.cuh MEGAC_PROBE_UP_NO_NORM) / rpfcu (router_poll with
        # the norm summing the experts, fused_combine, and the claims' wait on it read while the claimer
        # polls, MEGAC_UP_WAIT_EARLY: rpnn's candidate form; the tiny models under it first) / rpfcun (and
        # the norm on the finalize SM: its QKV tile no longer the last of its KV head's) engines alternating
        # at bs1 8K until AB_END s (the probe last in each round: its logits are wrong). Others built: rpfc (without up_wait_early), tcwc (gemm_tc.cuh
        # MEGAC_TC_WALK_CACHE, ~0.35 us off every GEMM tile's prologue, the router's on the expert chain)
    verify router_poll rpoll 1
    tiny_variant router_poll_uwe
    SETS=${SETS:-default,rpoll,rpfcu,rpfcun,rpnn} AB_END=${AB_END:-540} ROUNDS=${ROUNDS:-14} bash "$0" s47a ;;
  prebuild_s55b)  # (~5 min) s55b's set: the polls in the full-attention layers alone (TILES rpf, rpn2f) beside
                  # the default, the tiny MoE model under router_poll_full (the layer masks' path)
    prebuild_start
    prebuild_variants tiny-moe:router_poll_full
    prebuild_specs north-mini-code nmc-rpf nmc-rpn2f
    pack_cubins < build/cz-s31/log.txt ;;
  prebuild_s56)  # (~5 min) s56's set: the default, rpf, the poll build with no layer polling (TILES rpnone) and
                 # the folds loading half their planes (TILES fh, a timing probe)
    prebuild_start
    prebuild_specs north-mini-code nmc-rpf nmc-rpnone nmc-fh
    pack_cubins < build/cz-s31/log.txt ;;
  s56)  # (prebuild_s56, any GPU; ~9 min) where rpf's +1.09 % comes from: default / rpf / rpnone engines
        # alternating at bs1 8K until AB_END s (rpnone ~ rpf: the poll build's fixed costs, the finalize's
        # write-back or the code's layout; rpnone ~ default: the full layers' polls themselves); fh: what
        # bf16 planes (O-projection partials, expert rows) would take off the folds at both chains' heads
        # (its bits differ: its sums are wrong)
    SETS=${SETS:-default,rpf,rpnone,fh} AB_END=${AB_END:-540} ROUNDS=${ROUNDS:-16} bash "$0" s47a ;;
  prebuild_s57)  # (~6 min) s57's set: the tiny models and the NMC slice under mob16 (the experts' outputs in bf16),
                 # and the NMC builds of the default, rpnone, fh and mob16
    prebuild_start
    prebuild_specs tiny-llama-mob16 tiny-moe-mob16 nmc-slice-mob16
    prebuild_specs north-mini-code nmc-rpnone nmc-fh nmc-mob16 nmc-qnw
    pack_cubins < build/cz-s31/log.txt ;;
  s57)  # (prebuild_s57, any GPU; ~9.5 min) mob16 checked as a default would be (the tiny models against the VM, the
        # one-row NMC slice against fp32), then default / rpnone / fh / mob16 engines alternating at bs1 8K until
        # AB_END s (s56's question, rpnone, beside what bf16 planes would be worth, fh, and the bf16 expert rows
        # themselves, mob16; fh's and mob16's bits differ from the default's)
    tiny_tiles mob16 100
    MEGAC_CHECK_TILES=mob16 MEGAC_CHECK_ROWS=1 timeout 100 python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-mob16-1.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    SETS=${SETS:-default,rpnone,fh,mob16} AB_END=$((${AB_END:-550} - SECONDS)) ROUNDS=${ROUNDS:-16} bash "$0" s47a ;;
  s57b)  # (prebuild_s57, any GPU; ~6 min) default / qnw (the folding QKV tiles skip their waits: a timing probe, its
         # logits wrong) / mob16 engines alternating at bs1 8K until AB_END s: what the attention chain's head is
         # worth at all (qnw ~ default: the expert chain gates the layers)
    SETS=${SETS:-default,qnw,mob16} AB_END=${AB_END:-330} ROUNDS=${ROUNDS:-16} bash "$0" s47a ;;
  prebuild_s55bp)  # (~7 min) prebuild_s55b's set and, in the same archive, s55p's: the profiled default,
                   # router_poll_norm and router_poll_full builds of North Mini Code
    bash "$0" prebuild_s55b > /dev/null
    PB_VARIANTS=router_poll_norm,router_poll_full MEGAC_PROFILE_VARIANTS=router_poll_norm,router_poll_full \
      prebuild_specs north-mini-code
    pack_cubins < build/cz-s31/log.txt ;;
  s55p)  # (prebuild_s55bp, any GPU; ~4 min) one profiled bs1 8K step of the default, router_poll_norm and
         # router_poll_full on one engine, the traces gzipped into $OUT: why rpn2 lost
    PT=${PT:-300} profile_variant ${PV:-router_poll_norm,router_poll_full}
    rm -f $OUT/profile-north-mini-code-bs1-ctx8192-*.json ;;
  s55b)  # (prebuild_s55b, any GPU; ~10 min) common.cuh MEGAC_ROUTER_POLL_FULL: the tiny MoE model under
         # router_poll_full against the VM, then default / rpf / rpn2f engines alternating at bs1 8K until AB_END s
    tiny_variant router_poll_full
    SETS=${SETS:-default,rpf,rpn2f} AB_END=${AB_END:-520} ROUNDS=${ROUNDS:-16} bash "$0" s47a ;;
  prebuild_s55)  # (~4 min) s55's set: router_poll_norm checked as a default would be (the tiny models, the watchdog,
                 # the one-row slice), its NMC build (TILES rpn2) beside the default's and tcwc, megac bench's ceiling
    prebuild_start
    prebuild_variants tiny-moe:router_poll_norm tiny-llama:router_poll_norm nmc-slice:router_poll_norm
    prebuild_specs north-mini-code nmc-rpn2 nmc-tcwc
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s55)  # (prebuild_s55, the H200; ~9 min) the polling claimer that waits on its claims' norm first
        # (common.cuh MEGAC_ROUTER_POLL 2: no polls while the router runs, the claims' wait met before the
        # ranking; checked as a default would be by s55v in the fifty-fourth session, H100): default / rpn2 /
        # tcwc engines alternating at bs1 8K until AB_END s
    SETS=${SETS:-default,rpn2,tcwc} AB_END=${AB_END:-540} ROUNDS=${ROUNDS:-16} bash "$0" s47a ;;
  s55v)  # (prebuild_s55, any GPU; ~2 min) s55's checks alone
    verify router_poll_norm rpn2 1 ;;
  prebuild_s54p)  # (~2 min) s54p's set: North Mini Code's plain and profiled builds of the default, router_poll and
                  # rpoll_nonorm (megac/gpu/profile.py's stamps)
    prebuild_start
    PB_VARIANTS=router_poll,rpoll_nonorm MEGAC_PROFILE_VARIANTS=router_poll,rpoll_nonorm prebuild_specs north-mini-code
    pack_cubins < build/cz-s31/log.txt ;;
  s54p)  # (prebuild_s54p, any GPU; ~4 min) one profiled bs1 8K step of the default, router_poll and rpoll_nonorm on
         # one engine (PT: its timeout), the traces gzipped into $OUT: where the earlier ranking went
    PT=${PT:-300} profile_variant ${PV:-router_poll,rpoll_nonorm}
    rm -f $OUT/profile-north-mini-code-bs1-ctx8192-*.json ;;
  prebuild_s53b)  # (~8 min) s53b's set: the default, waits keeping 2 / 4 polls in flight and polls without the
                  # sleep (TILES pd2 / pd4 / pns0), the tiny models under poll4, megac bench's ceiling kernel
    prebuild_start
    prebuild_specs north-mini-code nmc-pd2 nmc-pd4 nmc-pns0
    prebuild_variants tiny-moe:poll4 tiny-llama:poll4
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s53b)  # (prebuild_s53b, any GPU; ~9 min) how a wait polls (counters.cuh MEGAC_POLL_DEPTH / MEGAC_POLL_SLEEP_NS):
         # the tiny models under poll4 against the VM, then default / pns0 / pd2 / pd4 engines alternating at
         # bs1 8K until AB_END s
    tiny_variant poll4
    SETS=${SETS:-default,pns0,pd2,pd4} AB_END=${AB_END:-560} ROUNDS=${ROUNDS:-10} bash "$0" s47a ;;
  prebuild_s53c)  # (~4 min) s53c's set: the default, polls 200 / 800 ns apart (TILES pns200 / pns800), the
                  # release as fence.acq_rel + a relaxed add (sacq), the attention splits unprimed (anp)
    prebuild_start
    prebuild_specs north-mini-code nmc-pns200 nmc-pns800 nmc-sacq nmc-anp
    pack_cubins < build/cz-s31/log.txt ;;
  s53c)  # (prebuild_s53c, any GPU; ~7 min) the polls' rate against the counter's L2 slice (s53b: 2 / 4 polls in
         # flight +1.1 / +1.6 %), the signal's fence, the splits' prime: default / pns200 / pns800 / sacq / anp
         # engines alternating at bs1 8K until AB_END s
    SETS=${SETS:-default,pns200,pns800,sacq,anp} AB_END=${AB_END:-360} ROUNDS=${ROUNDS:-10} bash "$0" s47a ;;
  prebuild_s53)  # (~5 min) s53's set: today's default (QKV tiles priming one stage a warp), the ring as before
                 # (qpring), megac bench's ceiling kernel
    prebuild_start
    prebuild_specs north-mini-code nmc-qpring nmc-uwe
    prebuild_variants tiny-moe:up_wait_early tiny-llama:up_wait_early
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s53)  # (prebuild_s53; meant for the H200, any GPU runs it; ~9 min) the fifty-second session's default (MEGAC_QKV_PRIME
        # 1, measured on H100s only) against the ring primed as before (qpring) and the up claims' wait read while
        # the claimer ranks (uwe: ops_moe.cuh MEGAC_UP_WAIT_EARLY; the tiny MoE model under it first), engines
        # alternating at bs1 8K until AB_END s; then megac bench of the default at bs1 (ENG engines) for the
        # headline while the call has time (END s)
    tiny_variant up_wait_early
    SETS=${SETS:-default,qpring,uwe} AB_END=${AB_END:-330} ROUNDS=${ROUNDS:-10} bash "$0" s47a
    [ $((${END:-560} - SECONDS)) -gt 120 ] && BS=${BS:-1} ENG=${ENG:-3} BT=$((${END:-560} - SECONDS - 10)) bash "$0" bench
    true ;;
  prebuild_s52c)  # (~4 min) s52d's set: qkvp1 on the tiny models, the default and qp1 at bs1 / bs8
    prebuild_start
    prebuild_variants tiny-moe:qkvp1 tiny-llama:qkvp1
    prebuild_specs north-mini-code nmc-qp1
    pack_cubins < build/cz-s31/log.txt ;;
  s52d)  # (prebuild_s52c, any GPU; ~6 min) qkvp1 as a default would need it: the tiny models against the VM,
         # then default / qp1 engines alternating at bs8 8K (AB8_END s), then at bs1 until AB_END s
    tiny_variant qkvp1
    SETS=default,qp1 AB_END=${AB8_END:-200} ROUNDS=${ROUNDS8:-6} TB=8 AB_OUT=ab-bs8 bash "$0" s47a
    SETS=default,qp1 AB_END=$((${AB_END:-420} - SECONDS)) ROUNDS=${ROUNDS:-8} bash "$0" s47a ;;
  s52m)  # (prebuild_s52, any GPU; ~3 min) one profiled bs1 8K step of the default and of fold_marks (norm.cuh
         # MEGAC_FOLD_MARKS: where a QKV tile's ~2.7 us fold goes, against ~1.5 us for its bytes in one round)
    PT=$((${END:-560} - SECONDS - 10)) profile_variant fold_marks ;;
  s52q)  # (prebuild_s52, any GPU; ~5 min) QKV tiles priming one stage a warp / none before their waits
         # (ops_gemm.cuh MEGAC_QKV_PRIME) against the default, engines alternating at bs1 8K until AB_END s
    SETS=${SETS:-default,qp1,qp0} AB_END=${AB_END:-300} ROUNDS=${ROUNDS:-10} bash "$0" s47a ;;
  prebuild_s51)  # (~5 min) prebuild_s50c's set, qkv128's profiled build (s51p) and the fold block (s51f)
    prebuild_start
    MEGAC_PROFILE_TILES=qkv128 prebuild_specs north-mini-code nmc-qkv128 nmc-dn128p nmc-up128p nmc-up128p_dn128p \
      nmc-p2div
    prebuild_variants nmc-slice-qkv128
    PYTHONPATH=.:tests .venv/bin/python -c "from megac.gpu.build import REPO, build_cubin; \
      print(build_cubin(REPO / 'opcodes/tests/fold_l2_test.cu'))" | tee -a build/cz-s31/log.txt
    pack_cubins < build/cz-s31/log.txt ;;
  s51f)  # (prebuild_s51, any GPU; ~20 s) N SMs sum the same 13 fp32 planes from L2 at once (a QKV tile's norm
         # fold, ~3 us profiled at a layer's head where ~88 tiles fold together): same lines against private copies
    timeout ${FT:-120} python3 -m gpu.blocks.fold_l2 --full --json $OUT/fold_l2.json > $OUT/fold_l2.log 2>&1
    python3 -c "import json; d=json.load(open('$OUT/fold_l2.json')); print([c for c in d['checks'] if not c.get('ok', True)][:3]); [print(l) for l in d['bench']]" ;;
  s51p)  # (prebuild_s51, any GPU; ~3 min) one profiled bs1 8K step of the default and of qkv128 (does a QKV
         # tile's fold end sooner when half as many tiles pull the same ~106 KB from L2 at once?)
    PT=$((${END:-560} - SECONDS - 10)) profile_tiles 1:8192 qkv128 ;;
  prebuild_s50c)  # (~4 min) what s50c needs: the default and whole-head QKV tiles (TILES qkv128); for an H200,
                  # the paired claims (up128p, up128p_dn128p, dn128p) too
    prebuild_start
    prebuild_specs north-mini-code nmc-qkv128 nmc-dn128p nmc-up128p nmc-up128p_dn128p nmc-p2div
    prebuild_variants nmc-slice-qkv128
    pack_cubins < build/cz-s31/log.txt ;;
  s50c)  # (prebuild_s50c, any GPU; ~5 min) whole-head QKV tiles on today's default (40 QKV tiles of 512 KB: 40
         # more SMs hold no task before their up claimer, so every up claim can start as routing ends) against
         # the default, engines alternating at bs1 8K until AB_END s; on an H200 also the sets only it can
         # decide (SETS=default,qkv128,dn128p,up128p_dn128p,p2div)
    SETS=${SETS:-default,qkv128} AB_END=${AB_END:-300} ROUNDS=${ROUNDS:-10} bash "$0" s47a
    # whole-head QKV tiles reduce K in another order than half-head ones (other bits): the one-row slice against
    # fp32, as a default would need, while the call has time (END s)
    [ $((${END:-560} - SECONDS)) -gt 100 ] && MEGAC_CHECK_TILES=qkv128 MEGAC_CHECK_ROWS=1 \
      timeout $((${END:-560} - SECONDS - 10)) python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-qkv128-1.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    true ;;
  s49e)  # (prebuild_s49 + nmc-nfin + nmc-faf) default / faf (a full layer's claimed attention before its up
         # claimers again) / nfin at bs1 8K, engines alternating until AB_END s
    SETS=${SETS:-default,faf,nfin} AB_END=${AB_END:-300} ROUNDS=${ROUNDS:-6} bash "$0" s47a ;;
  s49d)  # (prebuild_s49 + nmc-tma3) tensor-copy rings of 3 chunks a warp (TILES tma3, variant attn_tma3): a
         # batch-1 static split primes 3 of its warps' 4 chunks before its wait (2 by default), in the layer's head
         # where the memory system has room; engines alternating at bs1 and bs8 8K until AB_END s (bits checked
         # where the model fits twice; not on an 80 GB H100)
    TB=${TB:-1,8} SETS=${SETS:-default,tma3} AB_END=${AB_END:-300} ROUNDS=${ROUNDS:-5} bash "$0" s47a ;;
  s49c)  # (prebuild_s49 + nmc-nfin nmc-fs_nfin) default / nfin / fs / fs_nfin at bs1 8K, engines alternating until
         # AB_END s (every MoE layer's norm on its finalize SM, off the next layer's QKV SMs)
    SETS=${SETS:-default,nfin,fs,fs_nfin} AB_END=${AB_END:-420} ROUNDS=${ROUNDS:-6} bash "$0" s47a ;;
  s49b)  # (prebuild_s49) default against fs at bs1 1K and 4K, engines alternating until AB_END s (does a full layer's
         # static attention win where it reads few keys?)
    t=default,fs; for i in 1 2 3 4; do t=$t,default#$i,fs#$i; done
    AT=$((${AB_END:-300} - SECONDS)) TB=1 TC=1024,4096 TLIST=$t bash "$0" ab | cut -c1-90 ;;
  s49a)  # (prebuild_s49 and fs's profiled build, any GPU) default against fs at bs1 32K (until A32_END s) and 128K
         # (until A128_END), engines alternating, then one profiled bs1 8K step of fs (is a full layer's attention
         # slower static where it reads 4-16x the keys?)
    t=default,fs; for i in 1 2 3 4 5; do t=$t,default#$i,fs#$i; done
    AT=$((${A32_END:-230} - SECONDS)) TB=1 TC=32768 TLIST=$t bash "$0" ab | cut -c1-60; mv $OUT/ab.json $OUT/ab32k.json
    AT=$((${A128_END:-420} - SECONDS)) TB=1 TC=131072 TLIST=$t bash "$0" ab | cut -c1-60; mv $OUT/ab.json $OUT/ab128k.json
    [ $((${END:-560} - SECONDS)) -gt 80 ] && PT=$((${END:-560} - SECONDS - 10)) \
      MEGAC_PROFILE_ORDER=schedules/experiments/full-static.yaml MEGAC_PROFILE_TILES_ONLY=1 profile_tiles 1:8192 fs
    true ;;
  prebuild_s48c)  # (adds to prebuild_s48b's set) static full-layer splits (TILES fs, fsuf): the tiny models and
                  # the slice under fs, the NMC builds of fs and fsuf, fsuf's profiled build
    SKIP_RE="(interleaved)\|(attention-first)" prebuild_specs tiny-llama-fs tiny-moe-fs nmc-slice-fs nmc-fs
    MEGAC_PROFILE_TILES=fsuf MEGAC_PROFILE_ORDER=schedules/experiments/up-free-static.yaml prebuild_specs nmc-fsuf
    pack_cubins < build/cz-s31/log.txt ;;
  s48c)  # (prebuild_s48c, any GPU, the H200 for the headline; ~9.5 min) default / upfree / fs / fsuf, engines
         # alternating at bs1 8K until AB_END s (each build's tokens and logits must equal the default's); then, while
         # the call has time (END s), fs checked (the tiny models against the VM, the one-row NMC slice against
         # fp32) and one profiled bs1 8K step of fsuf. SETS, SLICE=0, PROF=0 narrow it
    SETS=${SETS:-default,upfree,fs,fsuf} AB_END=${AB_END:-300} bash "$0" s47a
    [ $((${END:-560} - SECONDS)) -gt 80 ] && tiny_tiles fs 100
    [ "${SLICE:-1}" = 1 ] && [ $((${END:-560} - SECONDS)) -gt 100 ] && MEGAC_CHECK_TILES=fs MEGAC_CHECK_ROWS=1 \
      timeout $((${END:-560} - SECONDS - 10)) python3 -m gpu.megakernel_check --run nmc_slice --out $OUT/slice-fs-1.json \
      2>&1 | grep -v Warning | tail -2 | cut -c1-400
    [ "${PROF:-1}" = 1 ] && [ $((${END:-560} - SECONDS)) -gt 90 ] && PT=$((${END:-560} - SECONDS - 10)) \
      MEGAC_PROFILE_ORDER=schedules/experiments/up-free-static.yaml MEGAC_PROFILE_TILES_ONLY=1 profile_tiles 1:8192 fsuf
    true ;;
  s48b)  # (prebuild_s48b, any GPU) default / upfree / upfirstb / upfree_up128 / upfree_up192, engines
         # alternating at bs1 8K until AB_END s, then one profiled bs1 8K step of upfree, then (SLICE=1) the
         # two-row rbatch slice
    SETS=default,upfree,upfirstb,upfree_up128,upfree_up192 AB_END=${AB_END:-330} bash "$0" s47a
    MEGAC_PROFILE_ORDER=schedules/experiments/up-free.yaml MEGAC_PROFILE_TILES_ONLY=1 profile_tiles 1:8192 upfree
    [ "${SLICE:-0}" = 1 ] && MEGAC_CHECK_VARIANT=rbatch MEGAC_CHECK_ROWS=2 timeout 150 python3 -m gpu.megakernel_check \
      --run nmc_slice --out $OUT/slice-rbatch-2.json 2>&1 | grep -v Warning | grep -i "cos\|top\|ok\|error" | head -8 \
      | cut -c1-300 ;;
  s47b)  # (prebuild_s47b, any GPU) default / upfree / upfirstb, engines alternating at bs1 8K until AB_END s,
         # then one profiled bs1 8K step of upfree
    SETS=default,upfree,upfirstb AB_END=${AB_END:-330} bash "$0" s47a
    MEGAC_PROFILE_ORDER=schedules/experiments/up-free.yaml MEGAC_PROFILE_TILES_ONLY=1 profile_tiles 1:8192 upfree ;;
  prebuild_s47a)  # (after prebuild_s46c, adds to its set) the up and attention tile sets s47a times
    prebuild_specs nmc-up128 nmc-up192 nmc-a256 nmc-up128_a256 nmc-qkv32 nmc-qkv32_up128 nmc-qkv32_rf \
      nmc-qkv32_up128_rf
    MEGAC_PROFILE_TILES=qkv32 prebuild_specs nmc-qkv32
    pack_cubins < build/cz-s31/log.txt ;;
  s47a)  # (prebuild_s46c and prebuild_s47a, the H200) default / up128 / up192 / a256 / up128_a256, engines
         # alternating at bs1 8K until AB_END s (the expert chain's up phase and the attention chain shortened;
         # QKV tiles that fit the primed ring)
    t=${SETS:-default,up128,up192,a256,up128_a256,qkv32,qkv32_up128,qkv32_rf,qkv32_up128_rf}; t0=$t
    for i in $(seq 1 ${ROUNDS:-4}); do t=$t,$(echo $t0 | sed "s/\([^,]*\)/\1#$i/g"); done
    left=$((${AB_END:-560} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 60 ] && AT=$left TB=${TB:-1} TLIST=$t bash "$0" ab | cut -c1-80 ;;
  prebuild_s46c)  # rbatch's checks (the tiny models and the slice under it), the fixed uc's tiny models, the
                  # default and norc profiled (their bs8 steps), the bench's ceiling kernel
    prebuild_start
    prebuild_variants tiny-moe:rbatch tiny-llama:rbatch nmc-slice:rbatch
    MEGAC_PROFILE_TILES=norc prebuild_specs tiny-moe-uc north-mini-code nmc-norc nmc-rbatch
    prebuild_ceiling
    pack_cubins < build/cz-s31/log.txt ;;
  s46c)  # (prebuild_s46c, ~6 min, any GPU) rbatch checked as a default would be (tiny models against the VM,
         # the watchdog, the two-row fp32 slice: the router's residual form runs past one row); the tiny MoE
         # model under uc (its claims' fold on the plain GEMM path); one profiled bs8 8K step of the default
         # and of norc (where the router_combine default's bs8 time goes)
    verify rbatch rbatch 2
    tiny_tiles uc
    profile_tiles ${PCASES:-8:8192} ${PTILES:-norc} ;;
  s46a)  # (prebuild_s46a, ~8 min, the H200) the default, norc and rbatch engines alternating at bs8 until AB_END s
         # (is the router_combine default's +1.6 % at bs8 its residual staging?), then the default against rbatch
         # at bs1 until AB1_END s, then one profiled bs8 8K step of the default
    t=default,norc,rbatch; for i in $(seq 1 ${ROUNDS:-5}); do t=$t,default#$i,norc#$i,rbatch#$i; done
    left=$((${AB_END:-270} - SECONDS)); echo "ab bs8 gets ${left}s"
    [ $left -gt 60 ] && AT=$left TB=8 TLIST=$t bash "$0" ab | cut -c1-80
    mv $OUT/ab.json $OUT/ab8.json
    t=default,rbatch; for i in $(seq 1 ${ROUNDS1:-4}); do t=$t,default#$i,rbatch#$i; done
    left=$((${AB1_END:-400} - SECONDS)); echo "ab bs1 gets ${left}s"
    [ $left -gt 60 ] && AT=$left TB=1 TLIST=$t bash "$0" ab | cut -c1-80
    MEGAC_PROFILE_CASES=8:8192 timeout ${PT:-120} python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json \
      2>&1 | grep -v Warning | grep '^{"\|Error\|error' | cut -c1-300
    for f in $OUT/*.trace.json; do gzip -q "$f"; done ;;
  s45q)  # (prebuild_s45q, ~9.8 min, the H200 if it comes) the tiny models against the VM under rcomb (the
         # batch-invariant form: alone_equals_batch must be true), rcqc and rcqcfc, the one-row fp32 slice under
         # rcqcfc, then default / rcomb / rcqc / rcqcfc, engines alternating at bs1 until AB_END s
    bash "$0" s44t
    for tt in rcqc rcqcfc; do
      tiny_tiles $tt
    done
    MEGAC_CHECK_TILES=rcqcfc MEGAC_CHECK_ROWS=1 timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-rcqcfc-1.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    t=default,rcomb,rcqc,rcqcfc; for i in $(seq 1 ${ROUNDS:-10}); do t=$t,default#$i,rcomb#$i,rcqc#$i,rcqcfc#$i; done
    left=$((${AB_END:-585} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=${TB:-1} TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-80 ;;
  s44r)  # (prebuild_s44r, ~9 min, any GPU) rcomb checked as a default would be (the tiny models against the
         # VM under it, the one-row fp32 slice), one profiled bs1 8K step of the default and of rcomb, then
         # rcomb against the default, engines alternating at bs1 until AB_END s
    MEGAC_TINY_TILES=rcomb timeout 200 python3 -m gpu.megakernel_check --run tiny --out $OUT/tiny.json \
      > $OUT/tiny.log 2>&1; echo tiny rc $?
    python3 -c "import json; d=json.load(open('$OUT/tiny.json/megakernel_check.json'))['tiny']; print(d['ok'], {m: (r['tokens_equal_vm'], r['adopted_step_bit_identical'], r['repeat_bit_identical'], r['alone_equals_batch'], r['min_cos_vs_vm'], r['alone_tokens_equal_vm'], r['alone_min_cos_vs_vm']) for m, r in d['result'].items()})" 2>&1 | tail -2
    MEGAC_CHECK_TILES=rcomb MEGAC_CHECK_ROWS=1 timeout 150 python3 -m gpu.megakernel_check --run nmc_slice \
      --out $OUT/slice-rcomb-1.json 2>&1 | grep -v Warning | tail -2 | cut -c1-400
    MEGAC_PROFILE_CASES=1:8192 MEGAC_PROFILE_TILES=rcomb timeout ${PT:-150} python3 -m gpu.megakernel_check \
      --run profile --out $OUT/profile.json 2>&1 | grep -v Warning | grep '^{"\|Error\|error' | cut -c1-300
    for f in $OUT/*.trace.json; do gzip -q "$f"; done
    rm -f $OUT/profile-*ctx8192*.json
    t=default,rcomb; for i in $(seq 1 ${ROUNDS:-12}); do t=$t,default#$i,rcomb#$i; done
    left=$((${AB_END:-500} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=1 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60 ;;
  s44t)  # (prebuild_s44r, ~1 min, any GPU) the tiny models against the VM under rcomb alone: a row alone
         # and in a batch must give the same bits (the batch-invariant form)
    MEGAC_TINY_TILES=rcomb timeout 150 python3 -m gpu.megakernel_check --run tiny --out $OUT/tiny.json \
      > $OUT/tiny.log 2>&1; echo tiny rc $?
    python3 -c "import json; d=json.load(open('$OUT/tiny.json/megakernel_check.json'))['tiny']; print(d['ok'], {m: (r['tokens_equal_vm'], r['adopted_step_bit_identical'], r['repeat_bit_identical'], r['alone_equals_batch'], r['min_cos_vs_vm'], r['alone_tokens_equal_vm'], r['alone_min_cos_vs_vm']) for m, r in d['result'].items()})" 2>&1 | tail -2 ;;
  s45h)  # (prebuild_s44r, ~9.5 min, the H200) the batch-invariant rcomb's tiny check (alone_equals_batch must be
         # true), then rcomb against the default, engines alternating at bs1 and bs8 until AB_END s, then megac bench
         # of the default at bs1 (the run's ceiling) if BENCH_LEFT s are left
    bash "$0" s44t
    t=default,rcomb; for i in $(seq 1 ${ROUNDS:-8}); do t=$t,default#$i,rcomb#$i; done
    left=$((${AB_END:-420} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=1,8 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-80
    left=$((${BENCH_END:-585} - SECONDS)); echo "bench gets ${left}s"
    [ $left -gt 100 ] && BT=$left BS=1 ENG=3 bash "$0" bench ;;
  s42w)  # (prebuild_s42w, ~2 min) one profiled bs1 8K step of the default and of tcwarm on one engine: does
         # the gap from tile_bulk's call to its walk set up (stamps 15 -> 7, 0.74-0.80 us) shrink when its
         # prologue's code ran before the waits?
    profile_variant tcwarm
    if [ -n "$TINY" ]; then tiny_variant tcwarm; fi ;;
  s41e)  # (prebuild_s41e) p2div, p2div_rs8 and rs8 against the default, engines alternating at bs1 until AB_END s
    t=default,p2div,p2div_rs8; for i in 1 2 3 4 5 6 7 8; do t=$t,default#$i,p2div#$i,p2div_rs8#$i; done
    AT=$((${AB_END:-270} - SECONDS)) TB=1 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-60 ;;
  s41)  # the next H200 call (~9 min; prebuild_s40): the next layer's QKV weights toward L2 in the tail
        # (qkvl2) checked as a default would be (tiny models against the VM, the watchdog, the one-row fp32
        # slice), then qkvl2 / qkvl2e against the default, engines alternating at bs1 until AB_END s, then
        # bs8 for the better one by hand
    verify qkvl2 qkvl2 1
    t=default,qkvl2,qkvl2_ot,qkvl2_oh,qkvl2e; for i in 1 2 3 4 5 6 7; do t=$t,default#$i,qkvl2#$i,qkvl2_ot#$i,qkvl2_oh#$i; done
    left=$((${AB_END:-540} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=1 TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-70 ;;
  s39)  # the H200 queue (~9.5 min; prebuild_s39): the paired down claims (dpair) checked as a default would be
        # (tiny models against the VM, the watchdog, the one-row fp32 slice), then against the default, engines
        # alternating at bs1 until AB_END s: dn128p (128-row down tiles, pairs but the last 26), with a sliding
        # layer's O-projection on its attention SMs (dn128p_oa: two 128-feature tiles each; dn128p_o256_oa: one
        # of 256), cpoll (even on the H100), old35 (the default before); the check's bits: every set's greedy
        # tokens equal the default's
    verify dpair dpair 1
    left=$((${AB_END:-570} - SECONDS)); echo "ab gets ${left}s"
    [ $left -gt 90 ] && AT=$left TB=1 \
      TLIST=${TLIST:-dn128p,dn128p_oa,dn128p_o256_oa,cpoll,default#1,dn128p#1,dn128p_oa#1,old35,dn128p16,default#2} \
      bash "$0" ab | cut -c1-160 ;;
  s39h)  # an H100 (~9 min): the tiny models under dpair (the adopting engine's step now compared before any
         # request), then dn128p against the default, engines alternating on the same laid-out weights
         # (LaidOutWeights), bs1 and bs8, with dn128p16 and dn128p_o256_oa between, until AB_END s
    env MEGAC_CHECK_VARIANT=dpair timeout 150 python3 -m gpu.megakernel_check --run tiny --out $OUT/tiny.json \
      > $OUT/tiny.log 2>&1; echo tiny rc $?
    python3 -c "import json; d=json.load(open('$OUT/tiny.json/megakernel_check.json'))['tiny']; print(d['ok'], {m: (r['adopted_step_bit_identical'], r['repeat_bit_identical'], r['min_cos_vs_vm']) for m, r in d['result'].items()})"
    t=default,dn128p; for i in 1 2 3 4 5 6 7 8 9 10 11; do t=$t,default#$i,dn128p#$i; [ $((i % 3)) = 0 ] && t=$t,dn128p16#$i,dn128p_o256_oa#$i; done
    left=$((${AB_END:-560} - SECONDS)); echo "ab gets ${left}s"
    AT=$left TB=${TB:-1,8} TLIST=${TLIST:-$t} bash "$0" ab | cut -c1-70 ;;
  s39q)  # placement tuning (~8 min): the tiny models against the VM with every engine tuned, then the
         # placement check (engines on the same weights: placements' ms, before/after at bs1 and bs8, bits),
         # then megac bench bs1,8 (its engines tuned, 8 trials)
    MEGAC_PLACEMENT_TRIALS=4 tiny_variant ""
    MEGAC_PLACEMENT_ENGINES=${PE:-8} timeout 300 python3 -m gpu.megakernel_check --run placement \
      --out $OUT/placement.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-330
    python3 -c "import json; d=json.load(open('$OUT/placement.json/megakernel_check.json'))['placement']; r=d.get('result', d); print(d.get('ok'), {k: v for k, v in r.items() if k != 'engines'})"
    BS=1,8 BT=$((580 - SECONDS)) bash "$0" bench ;;
  s39k)  # what the bs1 step's time follows: the timed row's KV block order or the task lists' and buffers'
         # placement (check kvorder, one engine, ~2 min)
    timeout ${BT:-400} python3 -m gpu.megakernel_check --run kvorder --out $OUT/kvorder.json 2>&1 | grep -v Warning \
      | grep '^{"' | cut -c1-200 ;;
  s39t)  # why a tuned placement did not hold (check tunehold, one engine, ~2 min)
    timeout ${BT:-400} python3 -m gpu.megakernel_check --run tunehold --out $OUT/tunehold.json 2>&1 | grep -v Warning \
      | grep '^{"' | cut -c1-400 ;;
  s40)  # the next H200 call (~9.5 min; build/cz from prebuild_s39 serves it): megac bench of the default at
        # bs1 and bs8 over 5 engines (the thirty-sixth session's default never benched on the H200; the median
        # over engines, not one engine's draw), then s40e, 5 engines a side
    BS=1,8 ENG=${ENG:-5} BT=260 bash "$0" bench
    NE=4 AT=$(( (570 - SECONDS) / 2 )) bash "$0" s40e ;;
  s40c)  # megac bench's new ceiling (the read kernel's two shapes beside torch's sum; its GPU test first),
         # then megac bench of the default at bs1 and bs8 over ENG engines against it (~9 min)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ceiling.py 2>&1 | tail -2
    BS=1,8 ENG=${ENG:-5} BT=$((575 - SECONDS)) bash "$0" bench ;;
  s40h)  # the H200 call (~9.5 min): the ceiling's GPU test, megac bench of the default at bs1 and bs8 over 5
         # engines against the new ceiling, then one profiled bs1 8K step of the default (s39p) while time is left
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ceiling.py 2>&1 | tail -2
    BS=1,8 ENG=${ENG:-5} BT=${BT:-300} bash "$0" bench
    grep -i "ceiling\|not used" $OUT/bench.log
    left=$((${END:-570} - SECONDS)); echo "profile gets ${left}s"
    [ $left -gt 150 ] && BT=$left bash "$0" s39p ;;
  s40e)  # the engines' spread under two allocator mappings (perf-notes, thirty-ninth session): NE+1 default
         # engines each at bs1 8K, the caching allocator's segments (every run so far), then expandable
         # segments (cuMemMap in 2 MB granules); AT s each
    t=default; for i in $(seq 1 ${NE:-9}); do t=$t,default#$i; done
    for conf in "" "expandable_segments:True"; do
      echo "allocator: ${conf:-default}"
      env ${conf:+PYTORCH_CUDA_ALLOC_CONF=$conf} AT=${AT:-250} TB=1 TLIST=$t bash "$0" ab | cut -c1-60
    done ;;
  s39b)  # megac bench of the default at bs1 and bs8 (~4 min), then the modes probe while time is left
    BS=1,8 BT=${BT:-260} bash "$0" bench
    left=$((570 - SECONDS)); echo "modes gets ${left}s"
    [ $left -gt 120 ] && BT=$left bash "$0" s37m ;;
  s39p)  # one profiled bs1 8K step of the default, its trace kept: the two tails of a sliding layer
         # (megac trace TRACE --layer 22; perf-notes, thirty-eighth session)
    MEGAC_PROFILE_CASES=1:8192 timeout ${BT:-400} python3 -m gpu.megakernel_check --run profile --out $OUT/profile.json \
      2>&1 | grep -v Warning | grep '^{"' | cut -c1-200
    gzip -q $OUT/*.json 2>/dev/null; ls -la $OUT ;;
  s37m)  # the modes probe: one engine timed unmoved, then after its buffers, KV pools, weights move (~3 min)
    timeout ${BT:-400} python3 -m gpu.megakernel_check --run modes --out $OUT/modes.json 2>&1 | grep -v Warning | grep '^{"' | cut -c1-300
    python3 -c "import json; d=json.load(open('$OUT/modes.json/megakernel_check.json'))['modes']; print(d.get('ok'), str(d)[-400:])" ;;
  bench)
    timeout ${BT:-500} python3 -c "from megac.cli import main; main()" bench north-mini-code --backend cuda --random-weights \
      --batch-size ${BS:-1,2,4,8} --context 8192 --steps 30 --engines ${ENG:-1} --json $OUT/bench.json 2>&1 \
      | grep -v Warning | tee $OUT/bench.log | tail -14 ;;
esac
