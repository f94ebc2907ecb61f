"""How long a peer's event loop was held: the lateness of a short, regular sleep.

Everything a peer answers (``/status``, DHT pings, heartbeats, tensors) runs on one asyncio loop; a
callback that computes for seconds (building a model, hashing weights, tokenizing) holds all of it,
and a joiner whose bootstrap ping goes unanswered gives up. ``LoopLag`` wakes every ``interval_s``
and records how late it woke: ``max_ms`` since start, and the worst of the last minute.
"""
from __future__ import annotations

import asyncio
import collections
import time


class LoopLag:
    def __init__(self, interval_s: float = 0.1, window_s: float = 60.0):
        self.interval_s = interval_s
        self.max_ms = 0.0
        self.max_at_s = 0.0  # seconds after start of the worst lateness
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (monotonic, ms)
        self._window_s = window_s
        self._t0 = time.monotonic()

    def note(self, late_s: float, now: float) -> None:
        ms = max(0.0, late_s) * 1000
        if ms > self.max_ms:
            self.max_ms, self.max_at_s = ms, now - self._t0
        if ms >= 50:  # only what a person would notice is kept for the window
            self._recent.append((now, ms))
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()

    def recent_max_ms(self) -> float:
        return max((ms for _, ms in self._recent), default=0.0)

    async def run(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.note(now - start - self.interval_s, now)

    def status(self) -> dict:
        return {"max_ms": round(self.max_ms, 1), "max_at_s": round(self.max_at_s, 1),
                "last_minute_max_ms": round(self.recent_max_ms(), 1)}
