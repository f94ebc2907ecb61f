"""The passive bandwidth estimate: a link's bytes/s read from the real transfers that completed on it.

``PassiveEstimator`` turns completed transfers into a smoothed bytes/s per destination;
``link_update`` decides when that differs enough from the published figure to publish anew, and
``FlapDamper`` holds back a link whose figure keeps going down and up.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy


def link_update(published_mbps: float, probed_mbps: float, estimate_mbps: Optional[float],
                lower_bound_mbps: Optional[float]) -> Optional[float]:
    """The bandwidth to publish for a link carrying real traffic, or None to leave it as published.

    Only sizeable changes count, since noise would make the groups' digest and the plan flap: a
    drop of the passive estimate to under half of what was published (unless a recent
    latency-bound transfer shows the link at least as fast as that), and a recovery to at least
    twice it (estimate or lower bound), which puts back the probed figure once it is within a
    factor of two of it.
    """
    seen = max(estimate_mbps or 0.0, lower_bound_mbps or 0.0)
    if estimate_mbps is not None and 0 < estimate_mbps < 0.5 * published_mbps and \
            not (lower_bound_mbps and lower_bound_mbps >= published_mbps):
        return min(estimate_mbps, 1e6)
    if published_mbps < probed_mbps and seen >= 2 * published_mbps:
        return probed_mbps if seen >= 0.5 * probed_mbps else seen
    return None


@dataclass
class _BusyPeriod:
    """A run of transfers to one destination with no idle moment between them."""

    start: float
    end: float  # the latest completion so far
    nbytes: int
    latency_s: float  # counted once: the first transfer's
    continued: bool  # cut out of a longer stream (begins with transfers in flight)


class PassiveEstimator:
    """Bytes/s of a link estimated from the real transfers that completed on it.

    ``observe(dst, nbytes, seconds, latency_s)`` after each transfer (``seconds`` from its start to
    its completion, ``latency_s`` the fixed part of it, e.g. the probed RTT). Transfers to one
    destination share its link, and concurrent ones interleave on it, so they are read together:
    a *busy period* is a run of transfers each of which started before the previous ones had all
    completed, and each transfer records the seconds per byte of its busy period so far (bytes
    completed since the period began, over the time since, less one latency). A burst of sends
    that finish together is then neither taken for a slow link (each timed from its own start)
    nor for a fast one (each timed from the previous completion, when they interleaved).

    ``estimate(dst)`` is the rate of a low ``quantile`` (default the 25th percentile) of those
    seconds per byte, each transfer weighted by its bytes and by ``exp(-age / tau_s)``, over the
    last ``window_s`` seconds. A low quantile rather than a mean, because the time of a transfer
    also holds the receiver's moments of being busy (one event loop also runs its compute): those
    make a few transfers slow, never most of them, while a slower link makes every transfer
    slower. A busy period longer than ``4 × tau_s`` is measured on from its latest completion, so
    that a drop in the middle of a long stream shows; such a continuation is only read once it has
    lasted ``2 × tau_s`` (transfers in flight at its start dilute into that). With traffic flowing,
    a 10× drop shows about 2-3.5 ``tau_s`` later (1.2-2.5 s with the default 0.6 s; 1 s took
    2.2-6 s on cee-3region's trace), and with a fifth or even 30 % of transfers stalled 10x, the
    estimate still holds (fake-clock figures). Transfers smaller than ``min_bytes`` are ignored.
    None when nothing recent was seen.

    The last ``min_samples`` transfers weigh at least ``exp(-k / min_samples)`` (the k-th before the
    latest), however old (within ``window_s``). A link with a transfer or two a second would
    otherwise be read from its last one or two, and a short transfer lasts about as long as a busy
    event loop is late: replicas' one 200 KB gradient part a step over 1 Gbit/s (1.6 ms of bytes),
    a few parts in a row 3-7 ms late, read 232-329 Mbit/s at the lowest on four replica links of two
    cee-3region runs (their logged transfers replayed), and peers published drops of 1 Gbit/s links
    to under half, 0-4 a run (2026-12-01).

    ``min_count``: no estimate from fewer transfers than that in the window. A replica link's first
    gradient part of an epoch, one transfer 5 ms long on a 1 Gbit/s link (1.6 ms of bytes), read 322
    Mbit/s and was published as a drop a second into training (cee-3region, 2026-12-02).
    """

    def __init__(self, tau_s: float = 0.6, window_s: float = 10.0, min_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic, max_samples: int = 1024, quantile: float = 0.25,
                 min_samples: int = 6, min_count: int = 1):
        if not (tau_s > 0 and window_s > 0 and min_bytes >= 0 and max_samples > 0 and 0 < quantile <= 1
                and min_samples > 0 and min_count > 0):
            raise ValueError("PassiveEstimator: need tau_s > 0, window_s > 0, min_bytes >= 0, max_samples > 0, "
                             "0 < quantile <= 1, min_samples > 0, min_count > 0")
        self.tau_s, self.window_s, self.min_bytes, self.quantile = tau_s, window_s, min_bytes, quantile
        self.min_samples, self.min_count = min_samples, min_count
        self.clock = clock
        self.max_samples = max_samples
        self._samples: dict[str, deque[tuple[float, int, float]]] = {}  # (when, bytes, seconds per byte)
        self._fast: dict[str, tuple[float, float]] = {}  # dst -> (when, bytes/s) of the last latency-bound period
        self._period: dict[str, _BusyPeriod] = {}  # dst -> its current busy period

    def observe(self, dst: str, nbytes: int, seconds: float, latency_s: float = 0.0, now: Optional[float] = None) -> None:
        """A transfer of ``nbytes`` to ``dst`` completed in ``seconds``. ``latency_s``: the part of
        that time that is not the bytes' (e.g. the link's RTT for a send that waits for its reply).

        A busy period that is mostly latency (bytes' time under a fifth of the total) says little
        about bandwidth: it only gives a lower bound."""
        if nbytes < max(1, self.min_bytes) or not (math.isfinite(seconds) and seconds > 0):
            return
        now = self.clock() if now is None else now
        start = now - seconds
        p = self._period.get(dst)
        if p is None or start >= p.end:  # the link was idle when it started: a new busy period
            p = self._period[dst] = _BusyPeriod(start, now, 0, max(0.0, latency_s), False)
        elif now - p.start > 4 * self.tau_s:  # a long stream: measure on from its latest completion
            p = self._period[dst] = _BusyPeriod(p.end, p.end, 0, 0.0, True)
        p.end = max(p.end, now)
        p.nbytes += int(nbytes)
        busy = p.end - p.start
        if p.continued:
            if busy < 2 * self.tau_s:
                return  # too short yet to outweigh what was in flight when it began
        elif p.latency_s > 0:
            if busy - p.latency_s < 0.2 * busy:
                # the bytes took under a fifth of the time: the link carries at least this much
                self._fast[dst] = (now, p.nbytes / (0.2 * busy))
                return
            busy -= p.latency_s
        if busy <= 0:
            return
        q = self._samples.setdefault(dst, deque(maxlen=self.max_samples))
        q.append((now, int(nbytes), busy / p.nbytes))
        self._expire(q, now)

    def _expire(self, q: deque, now: float) -> None:
        while q and now - q[0][0] > self.window_s:
            q.popleft()

    def estimate(self, dst: str, now: Optional[float] = None) -> Optional[float]:
        """Smoothed bytes/s to ``dst``, or None without recent transfers."""
        q = self._samples.get(dst)
        if not q:
            return None
        now = self.clock() if now is None else now
        self._expire(q, now)
        if len(q) < self.min_count:
            return None
        # (numpy: a link's 10 s of a pipeline's transfers are some 150 samples; the same weights and
        # order in Python took 93 us a call, and /status and the probe loop ask every second)
        when, nbytes, per_byte = numpy.array(q, dtype=numpy.float64).T
        back = numpy.arange(len(q) - 1, -1, -1, dtype=numpy.float64)  # samples after each one
        k = self.min_samples
        w = nbytes * numpy.maximum(numpy.exp(-numpy.maximum(0.0, now - when) / self.tau_s),
                                   numpy.where(back < k, numpy.exp(-back / k), 0.0))
        order = numpy.lexsort((w, per_byte))  # by seconds a byte, then weight
        acc = numpy.cumsum(w[order])
        if not acc[-1] > 0:
            return None
        first = int(numpy.argmax(acc >= self.quantile * acc[-1]))
        pb = float(per_byte[order[first]])
        return 1.0 / pb if pb > 0 else None

    def lower_bound(self, dst: str, max_age_s: float = 3.0, now: Optional[float] = None) -> Optional[float]:
        """Bytes/s the link carries at least, from its last latency-bound transfer (whose bytes took
        under a fifth of its time) if that is recent: evidence of a link too fast for ``estimate``
        to see, e.g. once a degraded link has recovered. None without such a transfer."""
        got = self._fast.get(dst)
        now = self.clock() if now is None else now
        return got[1] if got is not None and now - got[0] <= max_age_s else None

    def estimate_mbps(self, dst: str, now: Optional[float] = None) -> Optional[float]:
        e = self.estimate(dst, now)
        return None if e is None else e * 8 / 1e6

    def destinations(self) -> list[str]:
        return sorted(d for d, q in self._samples.items() if q)


class FlapDamper:
    """Holds back a link's published bandwidth from flapping, as routers damp a flapping route.

    ``link_update``'s factor of two is not enough where the passive estimate itself swings that
    much: four peers on two busy cores read their loopback links at 400-1,400 Mbit/s from one
    turn to the next, and each link went down, back up and down again every 5 s (17 signed
    records in 50 s of training, each read by the planner and the grouping's voters). A change in
    the same direction as the link's last one is let through at once (a link that gets worse must
    show); a reversal waits until ``hold_s`` has passed since the last change, and each reversal
    let through doubles that link's hold (up to ``max_hold_s``). A link left alone for four holds
    is back at ``base_hold_s``. Weather (a drop, later a recovery) passes with one hold's delay at most.
    """

    def __init__(self, base_hold_s: float, max_hold_s: float = 320.0):
        if not 0 < base_hold_s <= max_hold_s:
            raise ValueError("FlapDamper: need 0 < base_hold_s <= max_hold_s")
        self.base_hold_s, self.max_hold_s = base_hold_s, max_hold_s
        self._last: dict[str, tuple[float, int, float]] = {}  # dst -> (when, direction +1/-1, hold in force)

    def allow(self, dst: str, published: float, new: float, now: float) -> bool:
        """Whether ``new`` may replace ``published`` for ``dst`` now; if so, it counts as the link's
        latest change."""
        if new == published:
            return False
        direction = 1 if new > published else -1
        last = self._last.get(dst)
        hold = self.base_hold_s
        if last is not None:
            when, prev, hold = last
            if now - when >= 4 * hold:
                hold = self.base_hold_s
            elif direction != prev:
                if now - when < hold:
                    return False
                hold = min(2 * hold, self.max_hold_s)
        self._last[dst] = (now, direction, hold)
        return True

    def hold_s(self, dst: str) -> float:
        last = self._last.get(dst)
        return last[2] if last is not None else self.base_hold_s
