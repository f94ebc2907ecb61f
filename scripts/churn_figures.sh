#!/usr/bin/env bash
# Issue 7 churn figures on cee-3region (compression none, seed 0): a fault-free run, then the same
# run with a non-planner stage peer and then the planner SIGKILLed at step 20; for each kill: steps,
# lost steps, recovery time, and the worst relative deviation of its losses from the fault-free
# run's and from a single-process run's. Usage: scripts/churn_figures.sh [STEPS]  (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
steps="${1:-60}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
common=(--scenario peers/cee-3region.toml --steps "$steps" --compression none --seed 0 --json)
.venv/bin/spantrain swarm "${common[@]}" 2>"$out/clean.err" | tail -1 > "$out/clean.json"
for victim in worker planner; do
  .venv/bin/spantrain swarm "${common[@]}" --chaos "kill:$victim@step=20" 2>"$out/$victim.err" | tail -1 > "$out/$victim.json"
done
.venv/bin/python - "$out" "$steps" <<'PY'
import json, sys
from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.job.reference import reference_run
out, steps = sys.argv[1], int(sys.argv[2])
ref, _ = reference_run(JobSpec(steps=steps, seed=0), steps)
clean = json.load(open(f"{out}/clean.json"))
dev = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))
print(f"fault-free: {len(clean['losses'])} steps, {clean['samples_per_s']} samples/s, "
      f"worst deviation from one process {dev(clean['losses'], ref):.1e}")
for victim in ("worker", "planner"):
    d = json.load(open(f"{out}/{victim}.json"))
    ev = next(e for e in d["events"] if e["kind"] == "kill")
    terms = [p["term"] for p in d["plans"]]
    print(f"kill {victim} ({ev['target']}) at step {ev['step']}: {len(d['losses'])}/{steps} steps, "
          f"lost {d['lost_steps']}, recovery {ev.get('recovery_s')} s, {d['replans']} re-plan(s), terms {terms}; "
          f"worst loss deviation from the fault-free run {dev(d['losses'], clean['losses']):.1e}, "
          f"from one process {dev(d['losses'], ref):.1e}")
PY
