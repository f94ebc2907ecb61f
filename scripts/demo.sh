#!/usr/bin/env bash
# The main job on a fresh clone: sets itself up if needed, then starts a local emulated swarm
# from a scenario in peers/ and shows it working. Extra arguments go to `spantrain swarm`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
scenario="${SCENARIO:-peers/lan-4.toml}"
exec .venv/bin/spantrain swarm --scenario "$scenario" --duration "${DURATION:-5}" "$@"
