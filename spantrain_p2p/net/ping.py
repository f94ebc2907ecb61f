"""Pings: the round-trip time of links, from small probe messages (``probe_messages``).

``ping_links`` pings several peers at once in rounds (a swarm pings everybody in a quiet moment,
before the bulk transfers load the CPUs and delay pings), ``ping_link`` one peer; with a baseline
each sample is the link's ping less an unshaped one, read with ``paired_rtt``. ``ping_series``
and ``robust_rtt`` are the bulk probe's own pings and their reading (``prober``).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .probe_messages import probe_sender

if TYPE_CHECKING:
    from .client import DataPlaneClient
    from .emulator import LinkEmulator


def robust_rtt(samples: Sequence[float]) -> float:
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


async def ping_once(send: Callable[[dict, Sequence[Any]], Any], seq: int, clock: Callable[[], float]) -> float:
    """Seconds of one ping round trip through ``send`` (a ``probe_sender``); ValueError on a bad reply."""
    t = clock()
    reply = await send({"op": "ping", "seq": seq}, [b"p" * 16])
    dt = clock() - t
    if not reply or reply[0].get("op") != "pong" or reply[0].get("seq") != seq:
        raise ValueError(f"bad ping reply {reply[0] if reply else None!r}")
    return dt


async def ping_series(send: Callable[[dict, Sequence[Any]], Any], count: int, into: list[float],
                      clock: Callable[[], float]) -> None:
    """``count`` pings after one warm-up ping, their round trips into ``into``."""
    for seq in range(count + 1):  # the first one sets up the connection and is not counted
        dt = await ping_once(send, seq, clock)
        if seq:
            into.append(dt)


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
    differences scatter both ways: read them with ``paired_rtt``, not ``robust_rtt``. With either
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
    at_once: int = 1,
) -> dict[str, list[float]]:
    """``ping_link`` for several ``(dst_name, url)`` targets at once: rounds of one ping to each
    (up to 4 to a link much shorter than the longest; ``gap_s`` between two pings), at least
    ``count`` rounds, more (up to 4 x ``count``) until ``min_s`` have passed. A whole swarm's pings take about ``count`` times the sum of the RTTs,
    instead of one ``min_s`` per target; with ``at_once`` > 1, a round pings that many targets at a
    time (each its own pings in turn): a sample of members across continents pinged one after
    another took the whole deadline. A target that fails or does not answer within
    ``ping_timeout_s`` drops out of the rounds with the samples it gave; ``baseline_url`` as in
    ``ping_link``. Returns the samples per target name.

    ``around_emulator`` (with an ``emulator``): the baseline ping goes to the same target around
    the emulator, over the real loopback path the emulated link rides on, instead of to
    ``baseline_url``. Each sample is then the link's ping less the same peer's unshaped ping right
    after it: what the link adds, with both peers' HTTP stacks and the far side's load (which a
    ping to our own server cannot see: a 1 ms link read 1.2-1.5 ms while seven peers pinged at once)
    taken off. On real links (no emulator) there is no such path: use ``baseline_url``."""
    if count < 1 or deadline_s <= 0 or gap_s < 0 or ping_timeout_s <= 0 or at_once < 1:
        raise ValueError("ping_links: need count >= 1, deadline_s > 0, gap_s >= 0, ping_timeout_s > 0, at_once >= 1")
    t0 = clock()
    deadline = t0 + deadline_s
    out: dict[str, list[float]] = {name: [] for name, _ in targets}
    base: dict[str, list[float]] = {name: [] for name, _ in targets}
    around = around_emulator and emulator is not None
    base_send = probe_sender(client, baseline_url, None, deadline, clock) if baseline_url and not around else None
    base_senders = {name: probe_sender(client, url, None, deadline, clock) for name, url in targets} if around else {}
    paired = around or base_send is not None
    senders = {}
    for name, url in targets:
        link = emulator.link_for(name) if emulator is not None else None
        # with a baseline, the emulator must not also leave out the loopback's own round trip
        senders[name] = probe_sender(client, url, link, deadline, clock, compensate=not paired)
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

        async def pings_to(name: str, seq: int = seq) -> None:
            nonlocal first
            repeat = min(4, max(1, int(longest / max(min(out[name]), 1e-4)))) if out[name] else 1
            for _ in range(repeat):
                if not first and gap_s > 0:
                    await asyncio.sleep(gap_s)
                first = False
                try:
                    left = min(ping_timeout_s, deadline - clock())
                    dt = await asyncio.wait_for(ping_once(senders[name], seq, clock), max(0.0, left))
                    if paired:
                        b = await asyncio.wait_for(ping_once(base_senders.get(name, base_send), seq, clock),
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

        names = list(live)
        for i in range(0, len(names), at_once):
            await asyncio.gather(*(pings_to(name) for name in names[i:i + at_once]))
    if paired:
        # each link ping less the baseline ping right after it: a burst of load delays both
        return {name: [r - b for r, b in zip(out[name], base[name])] for name in out}
    return out
