#!/usr/bin/env bash
# Issue 7 weather figures on cee-3region, with a job (6 blocks, 8 micro-batches of 8 samples) for
# which the planner runs the first layers on the end and edge servers and the rest in the cloud,
# and for which a 10x slower cloud<->edge link makes that plan clearly worse (by its cost model):
#   1. cloud<->edge cut to 1/10 at t=20 s of training: the re-plan's delay, and samples/s after it
#      against the new plan's prediction;
#   2. 5-second blips (1/10) every 15 s: the stage moves they caused (want none).
# Usage: scripts/weather_figures.sh [STEPS]   (default 220; run on an idle machine, ~4 min a run)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
steps="${1:-220}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
common=(--scenario peers/cee-3region.toml --steps "$steps" --model-arg depth=6 --micro-batch-size 8 --micro-batches 8
        --schedule auto --seed 0 --json)
.venv/bin/spantrain swarm "${common[@]}" --chaos "degrade:cloud-edge:0.1@t=20" \
  2>"$out/degrade.err" | tail -1 > "$out/degrade.json"
blips=()
for t in 15 30 45 60 75 90 105 120; do
  blips+=(--chaos "degrade:cloud-edge:0.1@t=$t" --chaos "restore:cloud-edge@t=$((t + 5))")
done
.venv/bin/spantrain swarm "${common[@]}" "${blips[@]}" 2>"$out/blips.err" | tail -1 > "$out/blips.json"
.venv/bin/python - "$out" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/degrade.json"))
ev = next(e for e in d["events"] if e["kind"] == "degrade")
print(f"degrade cloud-edge x0.1 at t={ev['t_train_s']}s of training: re-plan after {ev.get('replan_s')} s "
      f"(epoch {ev.get('epoch_after')}), {d['replans']} re-plan(s), {d['stage_moves']} stage move(s), "
      f"{d['lost_steps']} lost step(s)")
for e in d["epochs"]:
    print(f"  epoch {e['epoch']}: {e['steps']} steps from step {e['first_step']}, {e['samples_per_s']} samples/s "
          f"measured vs {e['predicted_samples_per_s']} predicted (ratio {e['ratio']})")
for p in d["plans"]:
    print(f"  plan epoch {p['epoch']}: " + "; ".join(f"{s['layers']} on {','.join(s['peers'])}" for s in p["stages"]))
b = json.load(open(f"{sys.argv[1]}/blips.json"))
n = sum(1 for e in b["events"] if e["kind"] == "degrade")
print(f"blips: {n} 5-second cuts to 1/10 every 15 s: {b['replans']} re-plan(s), {b['stage_moves']} stage move(s), "
      f"{b['lost_steps']} lost step(s), {b['samples_per_s']} samples/s")
PY
