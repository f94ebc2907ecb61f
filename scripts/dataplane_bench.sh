#!/usr/bin/env bash
# Issue 6 figure: the data plane moves a 16 MiB tensor between two processes on loopback at what
# fraction of raw asyncio TCP? (Best of 5 rounds of 20 messages each; run on an idle machine.)
# Usage: scripts/dataplane_bench.sh [--mib N] [--reps N] [--rounds N] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
exec .venv/bin/python -m spantrain_p2p.cli.dataplane_bench --rounds 5 "$@"
