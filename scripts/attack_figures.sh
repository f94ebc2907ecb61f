#!/usr/bin/env bash
# Issue 29's figures of an open swarm under attack, on loopback: the budget attacks (trickling
# members, idle floods, silent sockets) against a training pair, then every Byzantine attack of
# the harness against 1 of 4 replicas, 1 of 4 islands and 1 of 4 pipeline replicas, defended and
# not, then 1,000 clean steps in fp32 and in bf16 with the defences on (evictions: none expected).
# Usage: scripts/attack_figures.sh [STEPS]   (default 300; ~75 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
py=.venv/bin/python
steps="${1:-300}"
echo "== budget attacks"; $py scripts/budget_figures.py
echo "== Byzantine attacks, $steps steps"; $py scripts/attack_figures.py --steps "$steps"
for p in fp32 bf16; do
  echo "== 1000 clean steps, $p"; $py scripts/attack_figures.py --clean-steps 1000 --precision "$p"
  echo "== 1000 clean pipeline steps, $p"; $py scripts/attack_figures.py --world pipeline --clean-steps 1000 --precision "$p"
done
