#!/usr/bin/env bash
# Prints the planner's figures (issue 5): speed-up over the baselines on the shipped scenarios,
# cost model against simulator, planner against exhaustive search, planning time at 100/300/1000
# peers. Then the contract command's own JSON for cee-3region. Extra arguments go to the figures
# (e.g. --instances 100 --seed 3).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
.venv/bin/python -m spantrain_p2p.cli.plan_figures "$@"
echo
echo "== python -m spantrain_p2p.cli.plan --scenario peers/cee-3region.toml --json (spantrain plan)"
.venv/bin/python -m spantrain_p2p.cli.plan --scenario peers/cee-3region.toml --json | tail -1
