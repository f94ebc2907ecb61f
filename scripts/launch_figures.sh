#!/usr/bin/env bash
# Issue 2 figure: seconds from launch until every peer of a scenario is ready, with peers forked
# from the zygote and (SPANTRAIN_ZYGOTE=0) started as fresh processes, alternating. Idle machine.
# Usage: scripts/launch_figures.sh [SCENARIO] [ROUNDS]   (default peers/cee-3region.toml, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
scenario="${1:-peers/cee-3region.toml}"
rounds="${2:-2}"
for _ in $(seq "$rounds"); do
  for z in 1 0; do
    SPANTRAIN_ZYGOTE=$z .venv/bin/python - "$scenario" <<'PY'
import sys, tempfile, time
t0 = time.monotonic()
from spantrain_p2p.launch import zygote
zygote.prestart()
from spantrain_p2p.launch import launch_scenario
procs = launch_scenario(sys.argv[1], tempfile.mkdtemp(prefix="spantrain-launch-"))
ready = time.monotonic() - t0
for p in procs:
    p.stop()
print(f"{sys.argv[1]}: {len(procs)} peers ready {ready:.1f} s after launch "
      f"({'forked from the zygote' if zygote.enabled() else 'fresh processes'})", flush=True)
PY
  done
done
