"""Receive deadlines that follow the swarm's own pace, instead of a constant the user must tune.

A stage waits for activations, gradients and replicas' gradient sums. How long such a wait
normally takes depends on the model, the plan, the links and the weather, so a fixed timeout is
either too long (a dead neighbour stalls everyone) or too short (a slow link looks like a death).
``Deadlines`` keeps the recent waits of each kind of message and gives ``multiple`` × their
``quantile`` (over the last ``window`` waits) as the deadline, never under ``floor_s`` and never
over the caller's cap; until ``min_samples`` waits are known, the cap itself. A wait that passes its
deadline is a question, not a verdict: the trainer then asks the sender whether it is alive, and
only a sender that does not answer fails the step (a slow but live one is waited for, up to the cap).

Pure bookkeeping: no clock, no I/O.
"""
from __future__ import annotations

import math
from collections import deque


class Deadlines:
    def __init__(self, multiple: float = 4.0, quantile: float = 0.95, floor_s: float = 2.0, window: int = 64,
                 min_samples: int = 8):
        if not (multiple >= 1 and 0 < quantile <= 1 and floor_s > 0 and window >= 1 and 1 <= min_samples <= window):
            raise ValueError("Deadlines: need multiple >= 1, 0 < quantile <= 1, floor_s > 0, "
                             "1 <= min_samples <= window")
        self.multiple, self.quantile, self.floor_s = multiple, quantile, floor_s
        self.window, self.min_samples = window, min_samples
        self._waits: dict[str, deque[float]] = {}

    def observe(self, kind: str, seconds: float) -> None:
        """A wait for a ``kind`` message that ended with the message, after ``seconds``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self._waits.setdefault(kind, deque(maxlen=self.window)).append(float(seconds))

    def typical(self, kind: str) -> float | None:
        """The ``quantile`` of the recent waits (None until ``min_samples`` are known)."""
        q = self._waits.get(kind)
        if not q or len(q) < self.min_samples:
            return None
        xs = sorted(q)
        return xs[min(len(xs) - 1, math.ceil(self.quantile * len(xs)) - 1)]

    def deadline(self, kind: str, cap_s: float) -> float:
        """How long to wait for the next ``kind`` message before asking whether its sender lives."""
        t = self.typical(kind)
        if t is None:
            return cap_s
        return min(cap_s, max(self.floor_s, self.multiple * t))
