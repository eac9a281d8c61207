#!/usr/bin/env bash
# Move the profile traces in benchmarks/ (~51 MB, tracked) out of the tree and back, so a device call's
# copy of the working tree plus its carry (build/cz, .whl) stays under the device's 64 MiB:
#   bash scripts/traces_aside.sh out    # before the call
#   bash scripts/traces_aside.sh back   # after it (never commit while they are out)
set -euo pipefail
cd "$(dirname "$0")/.."
aside=${MEGAC_TRACES_ASIDE:-/tmp/megac-traces-aside}
case "${1:-}" in
  out)
    mkdir -p "$aside"
    if compgen -G "$aside/*.trace.json.gz" > /dev/null; then
      echo "traces_aside: $aside already holds traces; run 'back' first" >&2; exit 1
    fi
    mv benchmarks/*.trace.json.gz "$aside/"
    echo "traces_aside: $(ls "$aside" | wc -l) traces moved to $aside" ;;
  back)
    if compgen -G "$aside/*.trace.json.gz" > /dev/null; then mv "$aside"/*.trace.json.gz benchmarks/; fi
    git status --short -- benchmarks | grep -q '^ D' && { echo "traces_aside: traces still missing" >&2; exit 1; }
    echo "traces_aside: traces back in benchmarks/" ;;
  *) echo "usage: bash scripts/traces_aside.sh out|back" >&2; exit 2 ;;
esac
