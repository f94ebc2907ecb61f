#!/usr/bin/env bash
# Issue 6 schedule figure: ZB-H1 against 1F1B on lan-4 with 4 stages (one peer each) and 8
# micro-batches, same job and seed, one run after the other. Run on an idle machine.
# Usage: scripts/schedule_figures.sh [STEPS]   (default 40)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
steps="${1:-40}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
for s in 1f1b zb-h1; do
  .venv/bin/spantrain swarm --scenario peers/lan-4.toml --steps "$steps" --plan even --stages 4 --micro-batches 8 \
    --micro-batch-size 8 --model-arg depth=6 --schedule "$s" --seed 0 --json 2>"$out/$s.err" | tail -1 > "$out/$s.json"
done
.venv/bin/python - "$out" <<'PY'
import json, sys
d = {s: json.load(open(f"{sys.argv[1]}/{s}.json")) for s in ("1f1b", "zb-h1")}
for s, r in d.items():
    print(f"{s:>6}: {r['samples_per_s']:.1f} samples/s, median step {r['step_s']:.3f} s, "
          f"predicted {r.get('predicted_step_s')} s, compute utilization {r.get('compute_utilization')}")
print(f"zb-h1 / 1f1b: {d['zb-h1']['samples_per_s'] / d['1f1b']['samples_per_s']:.2f}x samples/s")
PY
