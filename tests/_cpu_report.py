"""Per test, the CPU seconds of the test process's whole tree: what to cut when the suite is slow.

The suite's parallel part is CPU-bound on a 2-core box (``vmstat``: 5.8 % idle on average,
2026-11-30), so a test's wall time says little of what it costs the others: a test that sleeps while
its peers wait for an event costs nobody, one that trains 400 steps costs everyone. With
``SPANTRAIN_TEST_CPU=FILE`` each test process (every xdist worker) appends one JSON line per test to
FILE: ``test``, ``cpu_s`` (CPU of the process, its zygote, its peers, their p2p daemons and any
other descendant, from the test's setup to its teardown), ``wall_s``, ``end_unix`` (when it ended) and
``worker`` (the xdist worker, "" outside xdist); ``scripts/suite_cpu.py
FILE`` sums them up.

A descendant's CPU is read while it runs (``utime + stime``) and, once it has exited and been
waited for, in its parent's ``cutime + cstime``, where the kernel adds a reaped child's own and its
reaped children's. A process that outlives its parent and is adopted by init (a peer's daemon,
when the peer is SIGKILLed) leaves the tree and is not counted from then on.
"""
from __future__ import annotations

import json
import os
import time

from spantrain_p2p.train.cpu_use import children, process_cpu_s


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by process ``root`` and every descendant (see the module's docstring)."""
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += process_cpu_s(pid, reaped=True)
            todo.extend(children(pid))
        except (OSError, ValueError):
            continue  # it ended meanwhile: its parent's cutime has it, or will at the next read
    return total


class CpuReport:
    """The pytest hooks that write the report (registered by ``conftest`` when it is asked for)."""

    def __init__(self, path: str):
        self.path = path
        self._started: dict[str, tuple[float, float]] = {}

    def pytest_runtest_setup(self, item) -> None:
        self._started[item.nodeid] = (tree_cpu_s(os.getpid()), time.monotonic())

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "teardown" or report.nodeid not in self._started:
            return
        cpu0, t0 = self._started.pop(report.nodeid)
        row = {"test": report.nodeid, "cpu_s": round(tree_cpu_s(os.getpid()) - cpu0, 2),
               "wall_s": round(time.monotonic() - t0, 2), "end_unix": round(time.time(), 2),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(self.path, "a") as f:  # one short line a write: the workers' lines do not interleave
            f.write(json.dumps(row) + "\n")
