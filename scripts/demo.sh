#!/usr/bin/env bash
# The main job on a fresh clone: sets itself up if needed, then starts a local emulated swarm
# from a scenario in peers/ and trains a small transformer across its peers, with a progress
# display. SCENARIO, STEPS and extra arguments (passed to `spantrain swarm`) change the run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
scenario="${SCENARIO:-peers/lan-4.toml}"
exec .venv/bin/spantrain swarm --scenario "$scenario" --steps "${STEPS:-300}" "$@"
