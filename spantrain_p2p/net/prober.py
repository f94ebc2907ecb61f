"""Network prober: RTT and bandwidth of links, measured over the data plane like any other traffic.

Server side: register ``handle_probe`` for the message kind ``PROBE_KIND`` ("probe") on the peer's
``DataPlaneServer``. It echoes small pings and swallows bulk payloads, answering with their size.

Client side: ``probe_link(client, url, dst, emulator)`` measures one link:
- RTT: from ``ping_count`` small ping round trips (after one unmeasured warm-up ping), the median of
  the fastest two thirds; or from samples ``ping_link`` took earlier (a swarm pings everybody at
  once in a quiet moment, before the bulk transfers load the CPUs and delay pings);
- bandwidth: a timed bulk transfer, ``bytes / (transfer time − RTT)``; the size starts at
  ``bulk_bytes`` and grows until one transfer takes at least ``min_bulk_s`` (aiming at ``target_s``),
  so fast and slow links are both measured in well under a second or two;
- everything runs under ``deadline_s``: a peer that fails, refuses or hangs gives a measurement with
  status ``"unknown"`` (and the error) when the deadline fires, never a hang.
With ``emulator`` (a ``LinkEmulator``), traffic goes through the emulated link to ``dst``; pass None
once the data-plane client shapes its own traffic. The prober never reads a scenario.

``sparse_probe_plan`` chooses which (src, dst) pairs to probe: the full mesh for small swarms, else
every pair inside each candidate group plus a few samples across groups (about linear in N).
``PassiveEstimator`` turns completed real transfers into a smoothed bytes/s per destination.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from . import framing
from .dataplane import RemoteError

if TYPE_CHECKING:
    from .dataplane import DataPlaneClient
    from .emulator import LinkEmulator

PROBE_KIND = "probe"
PROBE_VERSION = 1
MAX_PING_BYTES = 1024
FULL_MESH_MAX_PEERS = 16
MAX_RTT_MS = 600_000.0
MAX_MBPS = 1e7


# ---------------------------------------------------------------------------------------------
# server side


async def handle_probe(header: dict, buffers: list[memoryview]) -> tuple[dict, list]:
    """Data-plane handler for ``PROBE_KIND``: ``{"op": "ping", "seq": n}`` is echoed with its (small)
    payload; ``{"op": "bulk"}`` is answered with ``{"nbytes": received}`` only."""
    framing.check_fields(header, {"v": int, "op": str})
    if header["v"] != PROBE_VERSION:
        raise framing.FrameError(f"probe version {header['v']} is not {PROBE_VERSION}")
    size = sum(b.nbytes for b in buffers)
    if header["op"] == "ping":
        seq = header.get("seq")
        if size > MAX_PING_BYTES:
            raise framing.FrameError(f"a ping carries at most {MAX_PING_BYTES} bytes, not {size}")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise framing.FrameError("ping needs an int 'seq'")
        return {"v": PROBE_VERSION, "op": "pong", "seq": seq}, [bytes(b) for b in buffers]
    if header["op"] == "bulk":
        return {"v": PROBE_VERSION, "op": "ack", "nbytes": size}, []
    raise framing.FrameError(f"probe op must be 'ping' or 'bulk', not {header['op']!r}")


# ---------------------------------------------------------------------------------------------
# one link


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
        if self.version != PROBE_VERSION:
            raise ValueError(f"link measurement version {self.version!r} is not {PROBE_VERSION}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "dst": self.dst, "status": self.status, "rtt_ms": self.rtt_ms,
                "mbps": self.mbps, "error": self.error, "bulk_bytes": self.bulk_bytes, "seconds": self.seconds}

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


def _robust_rtt(samples: Sequence[float]) -> float:
    """Median of the fastest two thirds of the pings: a busy CPU or a GC pause only ever delays a
    ping, so the slowest third is dropped; the link's own jitter is symmetric and biases this by
    about a sixth of its amplitude."""
    fastest = sorted(samples)[: max(1, (2 * len(samples) + 2) // 3)]
    return statistics.median(fastest)


def paired_rtt(samples: Sequence[float]) -> float:
    """The RTT from ``ping_link(baseline_url=...)`` samples (link ping less baseline ping): their
    median. The differences scatter both ways: a burst of load delays either ping, and the
    baseline's own noise comes out negative."""
    if not samples:
        raise ValueError("paired_rtt: no samples")
    return statistics.median(samples)


async def _ping(send: Callable[[dict, Sequence[Any]], Any], seq: int, clock: Callable[[], float]) -> float:
    t = clock()
    reply = await send({"op": "ping", "seq": seq}, [b"p" * 16])
    dt = clock() - t
    if not reply or reply[0].get("op") != "pong" or reply[0].get("seq") != seq:
        raise ValueError(f"bad ping reply {reply[0] if reply else None!r}")
    return dt


async def _pings(send: Callable[[dict, Sequence[Any]], Any], count: int, into: list[float],
                 clock: Callable[[], float]) -> None:
    """``count`` pings after one warm-up ping, their round trips into ``into``."""
    for seq in range(count + 1):  # the first one sets up the connection and is not counted
        dt = await _ping(send, seq, clock)
        if seq:
            into.append(dt)


def _sender(client: "DataPlaneClient", url: str, link: Any, deadline: float, clock: Callable[[], float],
            compensate: bool = True):
    async def send(header: dict, buffers: Sequence[Any]) -> Any:
        left = deadline - clock()
        if left <= 0:
            raise asyncio.TimeoutError()
        return await client.send(url, PROBE_KIND, {"v": PROBE_VERSION, **header}, buffers, timeout=left, link=link,
                                 compensate=compensate)
    return send


async def ping_link(
    client: "DataPlaneClient",
    url: str,
    dst_name: str,
    emulator: Optional["LinkEmulator"] = None,
    count: int = 9,
    deadline_s: float = 5.0,
    *,
    gap_s: float = 0.0,
    min_s: float = 0.0,
    baseline_url: Optional[str] = None,
    around_emulator: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Only the RTT samples (seconds) of the link to ``dst_name``, for a swarm that pings in a quiet
    moment before anybody's bulk transfers load the CPUs (see ``probe_link(rtt_s=...)``). At least
    ``count`` pings, more (up to 4 x ``count``) until ``min_s`` have passed: short links get more
    samples for free. Whatever was measured before an error or the deadline is returned (possibly
    nothing).

    ``baseline_url``: this peer's own data-plane server, which no link shapes. Each ping of the
    link is followed by one there, and each sample is the link's ping less that baseline ping: the
    round trip through our own HTTP stack (client and server, on a CPU as busy as it is at that
    moment: 0.6 ms when quiet, several when busy on this 2-core box, more than a 1 ms datacenter
    link) is not the link's. (Taking off only what load added to the baseline, its excess over the
    quickest one, read 1 ms links as 1.7-2.5 ms and 5 ms links 6-9 % high on cee-3region.) Such
    differences scatter both ways: read them with ``paired_rtt``, not ``_robust_rtt``. With either
    baseline the emulator keeps the loopback's own round trip in the link's ping (``compensate``),
    or it would be taken off twice (5 ms links read 4.2-4.5 ms). ``around_emulator``: see
    ``ping_links``."""
    found = await ping_links(client, [(dst_name, url)], emulator, count, deadline_s, gap_s=gap_s, min_s=min_s,
                             ping_timeout_s=deadline_s, baseline_url=baseline_url,
                             around_emulator=around_emulator, clock=clock)
    return found[dst_name]


async def ping_links(
    client: "DataPlaneClient",
    targets: Sequence[tuple[str, str]],
    emulator: Optional["LinkEmulator"] = None,
    count: int = 12,
    deadline_s: float = 10.0,
    *,
    gap_s: float = 0.0,
    min_s: float = 0.0,
    ping_timeout_s: float = 2.0,
    baseline_url: Optional[str] = None,
    around_emulator: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """``ping_link`` for several ``(dst_name, url)`` targets at once: rounds of one ping to each
    (up to 4 to a link much shorter than the longest; ``gap_s`` between two pings), at least
    ``count`` rounds, more (up to 4 x ``count``) until ``min_s`` have passed. A whole swarm's pings take about ``count`` times the sum of the RTTs,
    instead of one ``min_s`` per target. A target that fails or does not answer within
    ``ping_timeout_s`` drops out of the rounds with the samples it gave; ``baseline_url`` as in
    ``ping_link``. Returns the samples per target name.

    ``around_emulator`` (with an ``emulator``): the baseline ping goes to the same target around
    the emulator, over the real loopback path the emulated link rides on, instead of to
    ``baseline_url``. Each sample is then the link's ping less the same peer's unshaped ping right
    after it: what the link adds, with both peers' HTTP stacks and the far side's load (which a
    ping to our own server cannot see: a 1 ms link read 1.2-1.5 ms while seven peers pinged at once)
    taken off. On real links (no emulator) there is no such path: use ``baseline_url``."""
    if count < 1 or deadline_s <= 0 or gap_s < 0 or ping_timeout_s <= 0:
        raise ValueError("ping_links: need count >= 1, deadline_s > 0, gap_s >= 0, ping_timeout_s > 0")
    t0 = clock()
    deadline = t0 + deadline_s
    out: dict[str, list[float]] = {name: [] for name, _ in targets}
    base: dict[str, list[float]] = {name: [] for name, _ in targets}
    around = around_emulator and emulator is not None
    base_send = _sender(client, baseline_url, None, deadline, clock) if baseline_url and not around else None
    base_senders = {name: _sender(client, url, None, deadline, clock) for name, url in targets} if around else {}
    paired = around or base_send is not None
    senders = {}
    for name, url in targets:
        link = emulator.link_for(name) if emulator is not None else None
        # with a baseline, the emulator must not also leave out the loopback's own round trip
        senders[name] = _sender(client, url, link, deadline, clock, compensate=not paired)
    live = list(senders)
    seq = -1
    first = True
    while live and clock() < deadline:
        seq += 1
        if seq > count and (seq > 4 * count or clock() - t0 >= min_s):
            break
        # short links are pinged several times a round (up to 4, as many as fit in the longest
        # link's round trip): their relative noise is the largest, and their pings are cheap
        longest = max((min(v) for v in out.values() if v), default=0.0)
        for name in list(live):
            repeat = min(4, max(1, int(longest / max(min(out[name]), 1e-4)))) if out[name] else 1
            for _ in range(repeat):
                if not first and gap_s > 0:
                    await asyncio.sleep(gap_s)
                first = False
                try:
                    left = min(ping_timeout_s, deadline - clock())
                    dt = await asyncio.wait_for(_ping(senders[name], seq, clock), max(0.0, left))
                    if paired:
                        b = await asyncio.wait_for(_ping(base_senders.get(name, base_send), seq, clock),
                                                   max(0.0, left))
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the full probe later says what is wrong with the link
                    live.remove(name)
                    break
                if seq:  # the first round sets up the connections and is not counted
                    out[name].append(dt)
                    if paired:
                        base[name].append(b)
    if paired:
        # each link ping less the baseline ping right after it: a burst of load delays both
        return {name: [r - b for r, b in zip(out[name], base[name])] for name in out}
    return out


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
    deadline = t0 + deadline_s
    st = _Probe()
    send = _sender(client, url, link, deadline, clock)
    pre = rtt_s is not None and math.isfinite(rtt_s) and 0 < rtt_s * 1e3 <= MAX_RTT_MS

    async def run() -> None:
        if pre:
            await _ping(send, 0, clock)  # the link answers (and the connection is open)
            st.rtts.append(float(rtt_s))
        else:
            await _pings(send, ping_count, st.rtts, clock)
        rtt = _robust_rtt(st.rtts)
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
                while len(times) < 3 and clock() + 1.5 * dt < deadline:
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
            if clock() + dt * nxt / size > deadline:  # the next one would not make it: keep this one
                st.mbps, st.bulk_bytes = size * 8 / max(transfer, 1e-6) / 1e6, size
                return
            size = nxt

    error = ""
    try:
        await asyncio.wait_for(run(), max(0.0, deadline - clock()))
    except asyncio.TimeoutError:
        error = f"no answer within the {deadline_s:g} s probe deadline"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a refused, broken or misbehaving peer: the link is unknown, nothing more
        error = f"{type(e).__name__}: {e}"[:500]
    rtt_ms = _robust_rtt(st.rtts) * 1e3 if st.rtts else None
    ok = not error and rtt_ms is not None and st.mbps is not None
    return LinkMeasurement(
        dst=dst_name, status="ok" if ok else "unknown", rtt_ms=rtt_ms if rtt_ms and rtt_ms > 0 else None,
        mbps=st.mbps if st.mbps and math.isfinite(st.mbps) and 0 < st.mbps <= MAX_MBPS else None,
        error=error, bulk_bytes=st.bulk_bytes, seconds=min(86400.0, clock() - t0),
    )


async def probe_links(
    client: "DataPlaneClient",
    targets: Iterable[tuple[str, str]],
    emulator: Optional["LinkEmulator"] = None,
    **kwargs: Any,
) -> list[LinkMeasurement]:
    """Probes ``(dst_name, url)`` targets one after the other (probes of one peer would otherwise
    share its uplink and measure each other)."""
    return [await probe_link(client, url, dst, emulator, **kwargs) for dst, url in targets]


# ---------------------------------------------------------------------------------------------
# which pairs to probe


def _h(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def sparse_probe_plan(
    peer_ids: Sequence[str],
    candidate_groups: Sequence[Sequence[str]] = (),
    samples_across: int = 2,
    full_mesh_max: int = FULL_MESH_MAX_PEERS,
) -> list[tuple[str, str]]:
    """Directed (src, dst) pairs to probe; every peer computes the same plan from the same inputs.

    Up to ``full_mesh_max`` peers: every ordered pair. Beyond: every ordered pair inside each
    candidate group (peers in no group form groups of one), plus, for each peer, ``samples_across``
    destinations in other groups (spread over different groups, picked by a hash of the pair, so
    the choice is deterministic and varies from peer to peer). With groups of bounded size the
    total grows linearly with N. Groups are not split: one huge group costs its size squared.
    """
    peers = sorted(set(peer_ids))
    if len(peers) <= full_mesh_max:
        return [(a, b) for a in peers for b in peers if a != b]
    known = set(peers)
    group_of: dict[str, int] = {}
    groups: list[list[str]] = []
    for g in sorted(sorted({p for p in g if p in known}) for g in candidate_groups):  # order-independent
        members = [p for p in g if p not in group_of]
        if members:
            for p in members:
                group_of[p] = len(groups)
            groups.append(members)
    for p in peers:
        if p not in group_of:
            group_of[p] = len(groups)
            groups.append([p])
    pairs: set[tuple[str, str]] = set()
    for g in groups:
        pairs.update((a, b) for a in g for b in g if a != b)
    if len(groups) > 1 and samples_across > 0:
        for p in peers:
            mine = group_of[p]
            others = sorted((gi for gi in range(len(groups)) if gi != mine), key=lambda gi: _h(p, groups[gi][0]))
            for k in range(samples_across):
                g = groups[others[k % len(others)]]
                taken = {b for a, b in pairs if a == p}
                choices = [q for q in g if q not in taken]
                if choices:
                    pairs.add((p, min(choices, key=lambda q: _h(p, q))))
    return sorted(pairs)


# ---------------------------------------------------------------------------------------------
# passive estimate from real traffic


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
    """

    def __init__(self, tau_s: float = 0.6, window_s: float = 10.0, min_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic, max_samples: int = 1024, quantile: float = 0.25):
        if not (tau_s > 0 and window_s > 0 and min_bytes >= 0 and max_samples > 0 and 0 < quantile <= 1):
            raise ValueError("PassiveEstimator: need tau_s > 0, window_s > 0, min_bytes >= 0, max_samples > 0, "
                             "0 < quantile <= 1")
        self.tau_s, self.window_s, self.min_bytes, self.quantile = tau_s, window_s, min_bytes, quantile
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
        pts = sorted((per_byte, n * math.exp(-max(0.0, now - t) / self.tau_s)) for t, n, per_byte in q)
        total = sum(w for _, w in pts)
        if total <= 0:
            return None
        acc = 0.0
        for per_byte, w in pts:
            acc += w
            if acc >= self.quantile * total:
                return 1.0 / per_byte if per_byte > 0 else None
        return None

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
