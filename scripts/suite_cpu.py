"""Where the test suite's CPU goes: the tests, and the files, that cost the most.

    SPANTRAIN_TEST_CPU=/tmp/cpu.jsonl ./scripts/test.sh
    .venv/bin/python scripts/suite_cpu.py /tmp/cpu.jsonl [--top 20] [--timeline 20]

Reads the lines ``tests/_cpu_report.py`` wrote (one per test: the CPU of the test process's whole
tree, peers and daemons included) and prints the suite's CPU and wall seconds, the costliest tests
with their running share of the suite's CPU, and the costliest files. On a box the suite keeps
busy, CPU is what a test takes from the others; its wall time is not. ``--timeline S``: for each S
seconds of the run, how many tests ran at once (of them, tests over 5 s) and the cores their
counted CPU took, a test's CPU spread evenly over its time (from the lines' ``end_unix``).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys


def read(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                rows.append({"test": str(row["test"]), "cpu_s": float(row["cpu_s"]), "wall_s": float(row["wall_s"]),
                             "end_unix": float(row.get("end_unix", "nan"))})
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


def timeline(rows: list[dict], bin_s: float) -> list[dict]:
    """Per ``bin_s`` seconds from the first test's start: ``tests`` (how many ran at once, on
    average), ``long_tests`` (those of them over 5 s) and ``cores`` (their counted CPU over the
    bin). Lines without ``end_unix`` (a report older than it) are left out."""
    rows = [r for r in rows if math.isfinite(r["end_unix"])]
    if not rows or bin_s <= 0:
        return []
    t0 = min(r["end_unix"] - r["wall_s"] for r in rows)
    n = int((max(r["end_unix"] for r in rows) - t0) // bin_s) + 1
    bins = [{"t_s": i * bin_s, "tests": 0.0, "long_tests": 0.0, "cores": 0.0} for i in range(n)]
    for r in rows:
        start, end = r["end_unix"] - r["wall_s"] - t0, r["end_unix"] - t0
        for i in range(int(start // bin_s), min(n - 1, int(end // bin_s)) + 1):
            inside = min(end, (i + 1) * bin_s) - max(start, i * bin_s)
            if inside <= 0:
                continue
            bins[i]["tests"] += inside / bin_s
            bins[i]["long_tests"] += inside / bin_s if r["wall_s"] > 5 else 0.0
            bins[i]["cores"] += r["cpu_s"] * inside / r["wall_s"] / bin_s if r["wall_s"] > 0 else 0.0
    return [{k: round(v, 2) for k, v in b.items()} for b in bins]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report", help="the file SPANTRAIN_TEST_CPU named")
    p.add_argument("--top", type=int, default=20, help="tests and files to list (default 20)")
    p.add_argument("--timeline", type=float, default=0.0, metavar="S",
                   help="also how many tests ran at once and the cores they took, every S seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = p.parse_args()
    rows = read(a.report)
    s = summary(rows, a.top)
    if a.timeline > 0:
        s["timeline"] = timeline(rows, a.timeline)
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
    if s.get("timeline"):
        print(f"{'from s':>7} {'tests':>6} {'> 5 s':>6} {'cores':>6}  (tests running at once, cores their counted CPU took)")
        for b in s["timeline"]:
            print(f"{b['t_s']:7.0f} {b['tests']:6.2f} {b['long_tests']:6.2f} {b['cores']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
