#!/usr/bin/env bash
# The main job on a fresh clone: sets itself up if needed, then starts a local emulated swarm
# from a scenario in peers/ (default: cee-3region) and trains a small transformer across its
# peers on the planner's plan, with the plan and a progress display. SCENARIO, STEPS and extra arguments (passed to `spantrain swarm`) change the run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
scenario="${SCENARIO:-peers/cee-3region.toml}"
exec .venv/bin/spantrain swarm --scenario "$scenario" --steps "${STEPS:-200}" "$@"
