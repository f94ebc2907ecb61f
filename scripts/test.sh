#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite. Extra arguments go to pytest.
# Two tests run at a time (most of them wait on peers and links more than they compute), except
# the ones marked serial, which measure times, rates or deadlines: those run alone, afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
"${pytest[@]}" -n 2 -m "not serial" "$@"
parallel=$?
"${pytest[@]}" -m serial "$@"
serial=$?
# 5: no test selected in that half (arguments that pick tests of one kind only)
for rc in "$parallel" "$serial"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$parallel" -eq 5 ] && [ "$serial" -eq 5 ]; then exit 5; fi
exit 0
