"""What ``/status``'s histories cost a call as a run grows (``train.histories``): the loss rows (the
last 30 and the whole run thinned to 200) and the tokens per second by group of steps, at 1,000 to
100,000 steps, kept as the steps come against the way before (every call sorted the whole run's loss
rows twice and regrouped every step's time; the code is kept below to compare). The launcher and the
dashboard ask each peer once a second, and a call holds the peer's event loop.

    .venv/bin/python scripts/status_cost.py
"""
from __future__ import annotations

import time

from spantrain_p2p.train.histories import HISTORY_POINTS, StepRows, Throughput

TOKENS = 4096


def before(loss_sums: dict, step_times: list) -> tuple:
    """/status's histories before 2026-11-30: sorted, thinned and regrouped on every call."""
    recent = sorted(loss_sums.items())[-30:]
    rows = [[st, a, n, e] for st, (a, n, e) in sorted(loss_sums.items())]
    if len(rows) > HISTORY_POINTS:
        k = -(-len(rows) // HISTORY_POINTS)
        rows = rows[::-1][::k][::-1]
    k = 1
    while max(st for st, *_ in step_times) // k >= HISTORY_POINTS:
        k *= 2
    groups: dict[int, list] = {}
    for st, s, e, _ in step_times:
        g = groups.setdefault(st // k * k, [s, e, 0])
        g[0], g[1], g[2] = min(g[0], s), max(g[1], e), g[2] + 1
    return recent, rows, [[f, round(e, 3), round(TOKENS * n / max(e - s, 1e-6), 3)] for f, (s, e, n) in sorted(groups.items())]


def after(loss_sums: StepRows, throughput: Throughput) -> tuple:
    return (loss_sums.last(30), [[st, a, n, e] for st, (a, n, e) in loss_sums.thinned()],
            throughput.rows(TOKENS))


def per_call_s(fn, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls


def main() -> None:
    for n in (1_000, 10_000, 100_000):
        plain, rows, tp, times = {}, StepRows(), Throughput(), []
        t = 0.0
        for s in range(n):
            plain[s] = rows[s] = (2.5, 8, 1)
            times.append((s, t, t + 0.1, 1))
            tp.add(s, t, t + 0.1)
            t += 0.1
        old, new = before(plain, times), after(rows, tp)
        assert [list(x) for x in old[0]] == [list(x) for x in new[0]] and old[1:] == new[1:]
        calls = max(3, 100_000 // n)
        b, a = per_call_s(lambda: before(plain, times), calls), per_call_s(lambda: after(rows, tp), 200)
        print(f"{n:>7} steps: {1e3 * b:8.2f} ms a call before, {1e3 * a:6.3f} ms now (the same rows)")


if __name__ == "__main__":
    main()
