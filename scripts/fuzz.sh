#!/usr/bin/env bash
# Issue 17 figure: N hostile messages (mutated frames, handshakes, HTTP requests, DHT values; see
# tests/fuzz_harness.py) against a 2-peer swarm while it trains; the swarm must lose no step and
# keep the losses of single-process training. Usage: scripts/fuzz.sh [MESSAGES] (default 10000)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
SPANTRAIN_FUZZ_MESSAGES="${1:-10000}" exec .venv/bin/python -m pytest -q -p no:cacheprovider -s \
  "tests/test_hostile.py::test_a_training_swarm_survives_forgery_fuzzing_and_stalled_connections"
