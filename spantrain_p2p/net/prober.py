"""Network prober: RTT and bandwidth of a link, measured over the data plane like any other traffic.

``probe_link(client, url, dst, emulator)`` measures one link into a ``LinkMeasurement``:
- RTT: from ``ping_count`` small ping round trips (after one unmeasured warm-up ping), the median of
  the fastest two thirds; or from samples ``ping.ping_link`` took earlier (a swarm pings everybody at
  once in a quiet moment, before the bulk transfers load the CPUs and delay pings);
- bandwidth: a timed bulk transfer, ``bytes / (transfer time − RTT)``; the size starts at
  ``bulk_bytes`` and grows until one transfer takes at least ``min_bulk_s`` (aiming at ``target_s``),
  so fast and slow links are both measured in well under a second or two;
- everything runs under ``deadline_s``: a peer that fails, refuses or hangs gives a measurement with
  status ``"unknown"`` (and the error) when the deadline fires, never a hang. A peer that answers
  over a slow, long link (a satellite hop, an emulated world slowed down) gets ``STRETCH_RTTS``
  of its first round trip on top (at most ``MAX_STRETCH_S``): the pings and bulk transfers take
  that many round trips.
With ``emulator`` (a ``LinkEmulator``), traffic goes through the emulated link to ``dst``; pass None
once the data-plane client shapes its own traffic. The prober never reads a scenario.

The far side answers with ``probe_messages.handle_probe``.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from . import framing
from .dataplane import RemoteError
from .ping import ping_once, ping_series, robust_rtt
from .probe_messages import PROBE_VERSION, probe_sender

if TYPE_CHECKING:
    from .client import DataPlaneClient
    from .emulator import LinkEmulator

__all__ = ["LinkMeasurement", "MAX_MBPS", "MAX_RTT_MS", "probe_link"]

MAX_RTT_MS = 600_000.0
MAX_MBPS = 1e7
STRETCH_RTTS = 20  # the pings (ping_count + 1) and a few bulk transfers, a round trip each at least
MAX_STRETCH_S = 120.0


@dataclass(frozen=True)
class LinkMeasurement:
    """What a probe of the link to ``dst`` found. ``status`` is "ok" when both RTT and bandwidth were
    measured, else "unknown" with ``error`` saying why (whatever was measured before is kept)."""

    dst: str
    status: str
    rtt_ms: Optional[float] = None
    mbps: Optional[float] = None
    error: str = ""
    bulk_bytes: int = 0  # size of the transfer the bandwidth comes from
    seconds: float = 0.0  # how long the probe took
    version: int = PROBE_VERSION
    via: str = ""  # the peer that relays this pair's traffic (``net.paths``), if any

    def __post_init__(self) -> None:
        if not isinstance(self.dst, str) or not 0 < len(self.dst) <= 256:
            raise ValueError("link measurement dst must be a non-empty string of at most 256 chars")
        if self.status not in ("ok", "unknown"):
            raise ValueError(f"link measurement status must be 'ok' or 'unknown', not {self.status!r}")
        for name, hi in (("rtt_ms", MAX_RTT_MS), ("mbps", MAX_MBPS)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= hi):
                raise ValueError(f"link measurement {name} must be None or in (0, {hi:g}], not {v!r}")
        if self.status == "ok" and (self.rtt_ms is None or self.mbps is None):
            raise ValueError("an 'ok' link measurement needs rtt_ms and mbps")
        if not isinstance(self.error, str) or len(self.error) > 500:
            raise ValueError("link measurement error must be a string of at most 500 chars")
        if isinstance(self.bulk_bytes, bool) or not isinstance(self.bulk_bytes, int) or not 0 <= self.bulk_bytes <= 1 << 40:
            raise ValueError(f"link measurement bulk_bytes must be an int >= 0, not {self.bulk_bytes!r}")
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= 86400:
            raise ValueError(f"link measurement seconds must be in [0, 86400], not {s!r}")
        if not isinstance(self.via, str) or len(self.via) > 128:
            raise ValueError("link measurement via must be a peer id of at most 128 chars")
        if self.version != PROBE_VERSION:
            raise ValueError(f"link measurement version {self.version!r} is not {PROBE_VERSION}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "dst": self.dst, "status": self.status, "rtt_ms": self.rtt_ms,
                "mbps": self.mbps, "error": self.error, "bulk_bytes": self.bulk_bytes, "seconds": self.seconds,
                **({"via": self.via} if self.via else {})}

    @classmethod
    def from_dict(cls, d: Any) -> "LinkMeasurement":
        """From untrusted data (the DHT): every field checked, else ValueError."""
        return framing.strict_from_dict(cls, d, "link measurement", required=("version", "dst", "status"))


class _Probe:
    """State of one probe, so that a deadline keeps what was measured before it fired."""

    def __init__(self) -> None:
        self.rtts: list[float] = []
        self.mbps: Optional[float] = None
        self.bulk_bytes = 0


async def probe_link(
    client: "DataPlaneClient",
    url: str,
    dst_name: str,
    emulator: Optional["LinkEmulator"] = None,
    ping_count: int = 9,
    bulk_bytes: int = 64 << 10,
    deadline_s: float = 10.0,
    *,
    rtt_s: Optional[float] = None,
    min_bulk_s: float = 0.2,
    target_s: float = 0.3,
    max_bulk_bytes: int = 64 << 20,
    clock: Callable[[], float] = time.perf_counter,
) -> LinkMeasurement:
    """Measures the link to ``dst_name`` (served at ``url``); see the module docstring. With ``rtt_s``
    (from ``ping_link``, pinged earlier in a quiet moment) it only pings once, to open the
    connection, and takes that RTT."""
    if ping_count < 1 or bulk_bytes < 1 or deadline_s <= 0 or max_bulk_bytes < bulk_bytes or not 0 < min_bulk_s <= target_s:
        raise ValueError("probe_link: need ping_count >= 1, 0 < bulk_bytes <= max_bulk_bytes, deadline_s > 0, "
                         "0 < min_bulk_s <= target_s")
    link = emulator.link_for(dst_name) if emulator is not None else None
    t0 = clock()
    deadline = [t0 + deadline_s]  # moved once the first answer tells the round trip
    st = _Probe()
    sender = probe_sender(client, url, link, lambda: deadline[0], clock)

    async def send(header, buffers):
        t = clock()
        reply = await sender(header, buffers)
        if deadline[0] == t0 + deadline_s:  # the first answer: room for the round trips to come
            deadline[0] += min(MAX_STRETCH_S, STRETCH_RTTS * (clock() - t))
        return reply
    pre = rtt_s is not None and math.isfinite(rtt_s) and 0 < rtt_s * 1e3 <= MAX_RTT_MS

    async def run() -> None:
        if pre:
            await ping_once(send, 0, clock)  # the link answers (and the connection is open)
            st.rtts.append(float(rtt_s))
        else:
            await ping_series(send, ping_count, st.rtts, clock)
        rtt = robust_rtt(st.rtts)
        size, payload = bulk_bytes, bytearray()
        last: Optional[tuple[int, float]] = None  # (size, transfer seconds) of the previous round
        cap = max_bulk_bytes  # lowered if the peer refuses messages that big
        while True:
            if len(payload) < size:
                payload = bytearray(size)
            t = clock()
            try:
                reply = await send({"op": "bulk"}, [memoryview(payload)[:size]])
            except RemoteError as e:
                if e.status != 413 or last is None:
                    raise
                # the peer takes no message this big: halve the cap, down to the last size that went
                cap = size // 2
                if cap <= last[0]:
                    if last[1] <= 0:
                        raise
                    st.mbps, st.bulk_bytes = last[0] * 8 / last[1] / 1e6, last[0]
                    return
                size = cap
                continue
            dt = clock() - t
            if not reply or reply[0].get("nbytes") != size:
                raise ValueError(f"bulk transfer of {size} bytes acknowledged as {reply[0] if reply else None!r}")
            transfer = dt - rtt  # the bytes' own time on the link
            if transfer >= min_bulk_s or size >= cap:
                if transfer <= 0:
                    raise ValueError(f"bulk transfer of {size} bytes took {dt * 1e3:.2f} ms, less than the RTT")
                st.mbps, st.bulk_bytes = size * 8 / transfer / 1e6, size
                # once more at this size, keeping the fastest: noise (a busy CPU, a GC pause) only
                # ever slows a transfer down, it never speeds one up; a third time when the two
                # disagree by more than 15 % (three probers share 2 cores: one stall can halve a
                # 0.2 s transfer at 1 Gbit/s)
                times = [transfer]
                while len(times) < 3 and clock() + 1.5 * dt < deadline[0]:
                    if len(times) == 2 and max(times) <= 1.15 * min(times):
                        break
                    t = clock()
                    reply = await send({"op": "bulk"}, [memoryview(payload)[:size]])
                    again = clock() - t - rtt
                    if not (reply and reply[0].get("nbytes") == size and again > 0):
                        break
                    times.append(again)
                st.mbps = size * 8 / min(times) / 1e6
                return
            last = (size, transfer)
            grow = target_s / transfer if transfer > 1e-3 else 16.0
            nxt = int(min(cap, size * min(16.0, max(2.0, grow))))
            if clock() + dt * nxt / size > deadline[0]:  # the next one would not make it: keep this one
                st.mbps, st.bulk_bytes = size * 8 / max(transfer, 1e-6) / 1e6, size
                return
            size = nxt

    error = ""
    task = asyncio.ensure_future(run())
    try:
        while not task.done():
            left = deadline[0] - clock()
            if left <= 0:
                raise asyncio.TimeoutError()
            await asyncio.wait({task}, timeout=left)  # the deadline may have moved meanwhile
        task.result()
    except asyncio.TimeoutError:
        error = f"no answer within the {deadline[0] - t0:.3g} s probe deadline"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a refused, broken or misbehaving peer: the link is unknown, nothing more
        error = f"{type(e).__name__}: {e}"[:500]
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    rtt_ms = robust_rtt(st.rtts) * 1e3 if st.rtts else None
    ok = not error and rtt_ms is not None and st.mbps is not None
    return LinkMeasurement(
        dst=dst_name, status="ok" if ok else "unknown", rtt_ms=rtt_ms if rtt_ms and rtt_ms > 0 else None,
        mbps=st.mbps if st.mbps and math.isfinite(st.mbps) and 0 < st.mbps <= MAX_MBPS else None,
        error=error, bulk_bytes=st.bulk_bytes, seconds=min(86400.0, clock() - t0),
    )
