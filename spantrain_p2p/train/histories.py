"""A run's histories as ``/status`` gives them, kept up as the steps come, so that a page costs the
same at step 10 and at step 100,000: the loss rows by step (``StepRows``) and the tokens per second
by group of steps (``Throughput``).

``/status`` used to sort the whole run's loss rows twice and regroup every step's time on each call:
1.7-3.0 ms a call at 1,000 steps, 32-43 ms at 10,000 and 0.40-0.59 s at 100,000 on this box, idle
(2026-11-30 03:10 UTC), while the launcher and the dashboard ask once a second, and each call holds
the event loop (the data plane, the pings) that long. Now 0.2-0.5 ms at each length, the same rows
(``scripts/status_cost.py``).
"""
from __future__ import annotations

import bisect
from collections.abc import MutableMapping
from typing import Any, Iterator

HISTORY_POINTS = 200  # rows of a history a page gets, the whole run thinned


class StepRows(MutableMapping):
    """step -> row (a dict), its steps also kept in order: iteration goes by step, and the last rows
    and an evenly thinned history are looked up, not sorted out of the whole run. A step comes
    after the others but for a redone one (a re-plan goes back a few steps), which only replaces."""

    def __init__(self) -> None:
        self._rows: dict[int, Any] = {}
        self._steps: list[int] = []  # sorted

    def __getitem__(self, step: int) -> Any:
        return self._rows[step]

    def __setitem__(self, step: int, row: Any) -> None:
        if step not in self._rows:
            if self._steps and step < self._steps[-1]:
                bisect.insort(self._steps, step)
            else:
                self._steps.append(step)
        self._rows[step] = row

    def __delitem__(self, step: int) -> None:
        del self._rows[step]
        del self._steps[bisect.bisect_left(self._steps, step)]

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def last(self, n: int) -> list[tuple[int, Any]]:
        """The ``n`` rows of the highest steps, in step order."""
        return [(s, self._rows[s]) for s in self._steps[-n:]] if n > 0 else []

    def thinned(self, most: int = HISTORY_POINTS) -> list[tuple[int, Any]]:
        """At most ``most`` rows, evenly spaced over the run, counted back from the last one."""
        n = len(self._steps)
        if n <= most:
            return [(s, self._rows[s]) for s in self._steps]
        k = -(-n // most)
        return [(self._steps[i], self._rows[self._steps[i]]) for i in reversed(range(n - 1, -1, -k))]


class Throughput:
    """A peer's step times as at most ``most`` groups of consecutive steps: groups of a power of two
    steps cut at its multiples, so that the replicas of a stage (at the same step, give or take one)
    cut them alike and a page can add them up. Two groups become one as the run outgrows them."""

    def __init__(self, most: int = HISTORY_POINTS):
        self.most = most
        self.k = 1  # steps a group
        self.top = -1  # the highest step seen
        self._groups: dict[int, list] = {}  # first step -> [start, end, steps timed]

    def add(self, step: int, start: float, end: float) -> None:
        """A step timed from ``start`` to ``end`` (unix seconds); a redone step counts again."""
        self._fold(self._groups, step, start, end, 1)
        self.top = max(self.top, step)
        while self.top // self.k >= self.most:
            self.k *= 2
            merged: dict[int, list] = {}
            for first, (s, e, n) in self._groups.items():
                self._fold(merged, first, s, e, n)
            self._groups = merged

    def _fold(self, groups: dict[int, list], step: int, start: float, end: float, n: int) -> None:
        """``n`` steps from ``start`` to ``end`` into the group of ``step``."""
        g = groups.setdefault(step // self.k * self.k, [start, end, 0])
        g[0], g[1], g[2] = min(g[0], start), max(g[1], end), g[2] + n

    def rows(self, tokens_per_step: float) -> list[list]:
        """[first step, end (unix s, ms), tokens/s] per group, by step."""
        return [[first, round(e, 3), round(tokens_per_step * n / max(e - s, 1e-6), 3)]
                for first, (s, e, n) in sorted(self._groups.items())]
