#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
