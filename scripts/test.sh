#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite. Extra arguments go to pytest.
# Three tests run at a time on this 2-core box (most of them wait on peers and links more than they
# compute: 437 s against 523 s two at a time, 2026-11-26), but no more than two of those marked
# heavy (swarms of peer processes; tests/conftest.py), except the ones marked serial, which measure
# times, rates or deadlines: those run alone, afterwards. The slowest are named at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10)
"${pytest[@]}" -n 3 -m "not serial" "$@"
parallel=$?
"${pytest[@]}" -m serial "$@"
serial=$?
# 5: no test selected in that half (arguments that pick tests of one kind only)
for rc in "$parallel" "$serial"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$parallel" -eq 5 ] && [ "$serial" -eq 5 ]; then exit 5; fi
exit 0
