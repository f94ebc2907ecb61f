"""Where the test suite's CPU goes: the tests, and the files, that cost the most.

    SPANTRAIN_TEST_CPU=/tmp/cpu.jsonl ./scripts/test.sh
    .venv/bin/python scripts/suite_cpu.py /tmp/cpu.jsonl [--top 20]

Reads the lines ``tests/_cpu_report.py`` wrote (one per test: the CPU of the test process's whole
tree, peers and daemons included) and prints the suite's CPU and wall seconds, the costliest tests
with their running share of the suite's CPU, and the costliest files. On a box the suite keeps
busy, CPU is what a test takes from the others; its wall time is not.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys


def read(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                rows.append({"test": str(row["test"]), "cpu_s": float(row["cpu_s"]), "wall_s": float(row["wall_s"])})
            except (ValueError, KeyError, TypeError) as e:
                print(f"{path}:{n}: skipped ({e.__class__.__name__})", file=sys.stderr)
    return rows


def summary(rows: list[dict], top: int) -> dict:
    cpu = sum(r["cpu_s"] for r in rows)
    by_file: dict[str, float] = collections.Counter()
    for r in rows:
        by_file[r["test"].split("::")[0]] += r["cpu_s"]
    tests, running = [], 0.0
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        running += r["cpu_s"]
        tests.append({**r, "running_share": round(running / cpu, 3) if cpu else None})
    return {"tests_run": len(rows), "cpu_s": round(cpu, 1), "wall_s": round(sum(r["wall_s"] for r in rows), 1),
            "costliest": tests, "files": [{"file": f, "cpu_s": round(c, 1)} for f, c in by_file.most_common(top)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report", help="the file SPANTRAIN_TEST_CPU named")
    p.add_argument("--top", type=int, default=20, help="tests and files to list (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = p.parse_args()
    s = summary(read(a.report), a.top)
    if a.json:
        print(json.dumps(s))
        return 0
    print(f"{s['tests_run']} tests: {s['cpu_s']:.0f} CPU-seconds (their processes and descendants), "
          f"{s['wall_s']:.0f} s of test time")
    print(f"{'CPU s':>7} {'wall s':>7} {'share':>6}  costliest tests (share: running, of the suite's CPU)")
    for r in s["costliest"]:
        print(f"{r['cpu_s']:7.1f} {r['wall_s']:7.1f} {r['running_share'] * 100:5.1f}%  {r['test']}")
    print(f"{'CPU s':>7}  costliest files")
    for f in s["files"]:
        print(f"{f['cpu_s']:7.1f}  {f['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
