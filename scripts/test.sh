#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite. Extra arguments go to pytest.
# The tests marked heavy (swarms of peer processes; tests/conftest.py) run two at a time in one
# pytest session while the light ones run one at a time in another, beside them: on this 2-core box
# more than two heavy ones at once slowed each one's timing-sensitive parts several times over, and
# in one session of three workers a worker that drew a heavy test while two ran waited for a slot,
# idle (the last run so: 1,420 s of tests over 3 x 584 s of workers, 2026-12-01). The heavy
# session's lines start with "heavy| ".
# Then the ones marked serial, which measure times, rates or deadlines, run alone. The slowest of
# each part are named at its end.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10)
# a job started with & ignores SIGINT in a script (no job control), and so would pytest and its
# workers: SIGINT is given back its default, so that Ctrl-C (or the trap below) stops them cleanly
sigint=(.venv/bin/python -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])')
"${sigint[@]}" "${pytest[@]}" -n 2 -m "heavy and not serial" "$@" > >(trap '' INT; exec sed -u 's/^/heavy| /') 2>&1 &
heavy_job=$!
trap 'kill -INT "$heavy_job" 2>/dev/null; wait "$heavy_job"; exit 130' INT TERM
"${pytest[@]}" -n 1 -m "not heavy and not serial" "$@"
light=$?
wait "$heavy_job"
heavy=$?
trap - INT TERM
"${pytest[@]}" -m serial "$@"
serial=$?
# 5: no test selected in that part (arguments that pick tests of one kind only)
for rc in "$heavy" "$light" "$serial"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$heavy" -eq 5 ] && [ "$light" -eq 5 ] && [ "$serial" -eq 5 ]; then exit 5; fi
exit 0
