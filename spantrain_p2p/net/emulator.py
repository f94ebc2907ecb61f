"""Link emulator: makes loopback data-plane traffic behave like the scenario's wide-area links.

A peer started with ``--emulate SCENARIO:PEER`` owns one ``LinkEmulator``. Every data-plane
message it sends goes through the ``EmulatedLink`` to its destination (``link_for(dst)``):

- **bandwidth**: a token bucket per destination at the link class's bandwidth, times the
  bandwidth trace factor ``[t_seconds, factor]`` in force (t counted from the emulator's start),
  times a run-time factor (``set_factor``, for chaos tests). All outgoing links also pass a second
  token bucket, the peer's uplink cap (``uplink_mbps``), so they share it.
- **one-way delay**: RTT/2 plus a seeded, bounded jitter (uniform in ±``jitter_ms``), added after
  the last byte has passed the bucket, so back-to-back messages pipeline as on a real link.

Ordering and sharing: the propagation delay is FIFO per link (a message is never released before
one sent earlier on the same link, whatever the jitter draws), and the bandwidth is shared fairly
among messages in flight (they take turns in slices of about 4 ms of link time, like concurrent
TCP connections), so a small message is not stuck behind a bulk one on the same link. Messages sent
one after the other therefore arrive in order; concurrent ones finish by size.

How the data plane uses it: one ``Exchange`` per request/reply, three calls.

    ex = emulator.link_for(dst_name).exchange()
    async with session.post(url, data=ex.body(framing.encode(header, buffers)), …) as resp:
        ex.reply_started()                     # at the reply's headers
        … read the reply body (n bytes; 0 for a 204) …
    await ex.reply_done(n)                     # the reply's trip back: delay + n / bandwidth

``ex.body(chunks)`` is the request body, re-sliced and released at the emulated pace (the last byte
after the one-way delay), so the real loopback transfer overlaps the emulated one. ``reply_done``
leaves out the real loopback time the reply already spent (the floor of recent request→reply tails,
at most 2 ms, plus the reply's own read time), so that a 5 ms RTT measures 5 ms, not 5.4.
``DataPlaneClient.send(url, kind, header, buffers, timeout, link=link)`` does exactly that.
``link.transmit(n)`` / ``emulator.transmit(dst, n)`` only sleep as long as ``n`` bytes would take,
for callers that cannot stream; the real transfer then adds to the emulated one, which costs
accuracy at high rates (loopback moves about 1 GB/s here).

Reply path: the reply is shaped on the requester's side at the same link's bandwidth and delay
(its own token bucket per link), without the requester's uplink cap. A run-time factor of 0 is a
partition: transfers on that link wait until the factor is raised again, so the caller's deadline
fires as it would on a real dead link.

Timing: intermediate slices use plain ``asyncio.sleep`` (which wakes up to ~1 ms late); the schedule
is computed from intended times, so that lateness never accumulates. A sender whose event loop was
busy elsewhere (it wakes 30 ms late, say) takes the slices it missed at once, up to a socket send
buffer's worth (``SEND_BUFFER_BYTES``): a real sender's kernel keeps sending meanwhile. With the old
20 ms cap alone, a loop held 30 ms every 100 ms stretched an 8 MiB message at 50 Mbit/s to 1.087x its
time (``scripts/emulator_fidelity.py``), and a 16-peer swarm on this box ran 10 % under its plan. Only the release of a message's
last byte waits precisely: it sleeps until ``spin_s`` before the target, then yields to the loop
(``asyncio.sleep(0)``) until the target, so a 5 ms RTT measures as 5 ms, not 6.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterable, Optional, Sequence, Union

if TYPE_CHECKING:
    from ..scenario import LinkClass, Scenario

BYTES_PER_MBIT = 1e6 / 8
QUANTUM_S = 0.004  # link time of one slice: the granularity of sharing a link between messages
MIN_SLICE_BYTES = 8 << 10
MAX_SLICE_BYTES = 8 << 20
MAX_CATCHUP_S = 0.02  # a flow woken this late may catch up this much link time, no more ...
# ... or as long as a socket's send buffer keeps the link busy (Linux's tcp_wmem ceiling): a real sender
# writes a message into it at once, and its process waking late does not idle the link meanwhile
SEND_BUFFER_BYTES = 4 << 20
# waits not waited: a plain sleep shorter than a millisecond wakes a millisecond late anyway (the
# event loop's poll takes its timeout in whole ms), so an intermediate slice that short goes at once
# (its message's last byte still waits precisely for the slices' end); a precise wait shorter than
# one turn of the event loop (~50 us here) would only spin it. On a LAN-fast link every message
# waited out both, each a few turns of the loop (issue 31: 5 % of a peer's loop on the side-by-side job)
COARSE_MIN_S = 0.001
TURN_S = 5e-5
# bytes/s loopback moves here (~3.5 GB/s raw): an emulated link at least this fast never throttles
LOOPBACK_BYTES_PER_S = 4e9
DOWN_POLL_S = 0.05  # how often a transfer on a partitioned link checks whether it is back

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class TokenBucket:
    """A token bucket of ``rate`` bytes/s and capacity ``burst`` bytes, in virtual-time form (GCRA).

    ``free_at`` is the time at which every byte reserved so far has passed. A reservation of ``n``
    bytes starting no earlier than ``start`` ends ``n / rate`` later; a bucket idle for a while may
    start a reservation up to ``burst / rate`` in the past (its saved tokens). With ``burst=0`` it
    paces exactly. Pure: times come from the caller, so it is tested with a fake clock.
    """

    def __init__(self, rate: float, burst: float = 0.0):
        self.rate = rate
        self.burst = burst
        self.free_at = -math.inf
        self.set_rate(rate)
        if not (math.isfinite(burst) and burst >= 0):
            raise ValueError(f"token bucket burst must be >= 0 bytes, not {burst!r}")

    def set_rate(self, rate: float) -> None:
        """New rate for reservations made from now on; those made already keep their times."""
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"token bucket rate must be a positive number of bytes/s, not {rate!r}")
        self.rate = rate

    def earliest(self, now: float, credit_s: float = 0.0) -> float:
        """Earliest start of a new reservation made at ``now``; ``credit_s`` lets a flow that was
        woken late start where it should have (never before the bytes already reserved)."""
        return max(self.free_at, now - max(self.burst / self.rate, credit_s))

    def take(self, start: float, nbytes: float) -> float:
        """Reserves ``nbytes`` from ``start`` (or when the bucket is free, if later); returns the end."""
        self.free_at = max(start, self.free_at) + nbytes / self.rate
        return self.free_at

    def reserve(self, nbytes: float, now: float) -> float:
        """``take(earliest(now), nbytes)``: when ``nbytes`` sent at ``now`` have passed."""
        return self.take(self.earliest(now), nbytes)


def trace_factor(trace: Sequence[tuple[float, float]], t: float) -> float:
    """The bandwidth factor of a ``[(t_seconds, factor), …]`` step trace at time ``t`` (1.0 before it)."""
    f = 1.0
    for ts, fs in trace:
        if t < ts:
            break
        f = fs
    return f


@dataclass
class LinkStats:
    messages: int = 0
    bytes_sent: int = 0
    replies: int = 0
    bytes_back: int = 0


class EmulatedLink:
    """The emulated link from this peer to one destination. Get it with ``LinkEmulator.link_for``."""

    def __init__(self, emulator: "LinkEmulator", dst: str, link: "LinkClass", trace: Sequence[tuple[float, float]]):
        self.emulator = emulator
        self.dst = dst
        self.link_class = link
        k = emulator.scenario.time_dilation  # a K times slower world: bandwidth / K, delays and traces x K
        self.trace = tuple((t * k, f) for t, f in trace)
        self.base_rate = link.mbps * BYTES_PER_MBIT / k
        self.rtt_s = link.rtt_ms / 1e3 * k
        self.jitter_s = link.jitter_ms / 1e3 * k
        self.factor = 1.0  # run-time factor (set_factor); 0 = partitioned
        self.stats = LinkStats()
        self._rng = random.Random(f"{emulator.seed}:{emulator.self_name}->{dst}")
        self._out = TokenBucket(self.base_rate)
        self._back = TokenBucket(self.base_rate)
        self._released = {True: -math.inf, False: -math.inf}  # last release time, per direction
        self._last: dict[bool, Optional[asyncio.Future]] = {True: None, False: None}  # last message, per direction

    def __repr__(self) -> str:
        return (f"EmulatedLink({self.emulator.self_name}->{self.dst}: {self.link_class.name}, "
                f"{self.link_class.mbps:g} Mbit/s, {self.link_class.rtt_ms:g} ms RTT, factor {self.factor:g})")

    def transparent(self, charge: float = 1.0) -> bool:
        """Whether this link could not slow a message here: at least as fast as loopback for the
        bytes it is charged, a delay and jitter under a turn of the loop, no trace, no run-time factor
        and no shared uplink. Such a message goes straight, counted (``count``) but not paced: the
        pacing's own work was ~60 us of a message's ~370 us of CPU on the side-by-side's 100 Gbit/s
        links (``scripts/pipelining_side_by_side.py``), and delayed nothing."""
        return (not self.trace and self.factor == 1.0 and self.emulator.uplink is None
                and self.base_rate >= LOOPBACK_BYTES_PER_S * charge and self.rtt_s / 2 + self.jitter_s < TURN_S)

    def count(self, nbytes: int, reply_bytes: int) -> None:
        """A message and its reply (0 bytes: none) that went straight (``transparent``), counted as
        ``paced`` and ``after_reply`` count the others."""
        self.stats.messages += 1
        self.stats.bytes_sent += nbytes
        self.stats.replies += 1
        self.stats.bytes_back += reply_bytes

    def bandwidth(self, now: Optional[float] = None) -> float:
        """Bytes/s of this link at ``now`` (trace and run-time factor applied; 0 when partitioned)."""
        now = self.emulator.clock() if now is None else now
        return self.base_rate * trace_factor(self.trace, now - self.emulator.t0) * self.factor

    def one_way_delay(self) -> float:
        """A fresh sample of the one-way delay: RTT/2 plus uniform jitter in ±jitter, never negative."""
        j = self._rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s > 0 else 0.0
        return max(0.0, self.rtt_s / 2 + j)

    async def paced(
        self, chunks: Iterable[Union[bytes, memoryview]], sent_at: Optional[float] = None, charge: float = 1.0,
        on_serialized: Optional[Callable[[float], None]] = None,
    ) -> AsyncIterator[Union[bytes, memoryview]]:
        """The chunks of one message, re-sliced and released at the emulated pace: use it as the
        HTTP body. The last slice comes out after the one-way delay. ``sent_at``: when the caller
        handed the message over (default: the first iteration); the time the client stack took to
        get to the body counts as time on the link (at most ``MAX_CATCHUP_S``). ``charge``: the
        link carries this many emulated bytes per real one (a proxy model's tensor standing for a
        workload's, ``--workload``). ``on_serialized(held_s)`` is called once the last byte has left
        (before its propagation delay), where a stream of messages may send its next one, with the
        seconds the message held the link: from its first byte's start to its last byte's end, as the
        link scheduled them (a start dated back by the credit above counts; this loop waking late after
        the end does not)."""
        if not (math.isfinite(charge) and charge > 0):
            raise ValueError(f"charge must be a positive number, not {charge!r}")
        views = [memoryview(c).cast("B") for c in chunks]
        total = sum(v.nbytes for v in views)
        self.stats.messages += 1
        self.stats.bytes_sent += int(total * charge)
        pieces: list[memoryview] = []
        head = self.emulator.clock() - sent_at if sent_at is not None else 0.0
        engine = _Transfer(self, outgoing=True, head_start_s=head)
        for v in views:
            pos = 0
            while pos < v.nbytes:
                n = min(v.nbytes - pos, max(1, int(engine.slice_bytes() / charge)))
                pieces.append(v[pos : pos + n])
                pos += n
        if not pieces:
            if on_serialized is not None:
                on_serialized(0.0)
            await engine.finish()
            return
        for i, p in enumerate(pieces):
            await engine.send(p.nbytes * charge)
            if i == len(pieces) - 1:
                if on_serialized is not None:
                    on_serialized(engine.held_s())
                await engine.finish()  # the last byte arrives one propagation delay after it left
            yield p

    def exchange(self, compensate: bool = True, charge: float = 1.0,
                 on_serialized: Optional[Callable[[float], None]] = None) -> "Exchange":
        """A request/reply through this link: see ``Exchange`` (``charge``, ``on_serialized``: see ``paced``)."""
        return Exchange(self, compensate, charge, on_serialized)

    async def transmit(self, nbytes: int) -> None:
        """Sleeps as long as sending ``nbytes`` on this link takes (serialization, then the delay)."""
        self.stats.messages += 1
        self.stats.bytes_sent += nbytes
        await _Transfer(self, outgoing=True).run(nbytes)

    async def after_reply(self, nbytes: int, overlap_s: float = 0.0) -> None:
        """Sleeps as long as a reply of ``nbytes`` takes to come back on this link, less ``overlap_s``
        (at most ``MAX_CATCHUP_S``): real transport time the reply has already spent on loopback."""
        self.stats.replies += 1
        self.stats.bytes_back += nbytes
        await _Transfer(self, outgoing=False, head_start_s=overlap_s).run(nbytes)


class Exchange:
    """One request and its reply through an emulated link (see the module docstring)."""

    def __init__(self, link: EmulatedLink, compensate: bool = True, charge: float = 1.0,
                 on_serialized: Optional[Callable[[float], None]] = None):
        self.link = link
        self.charge = charge
        self.on_serialized = on_serialized
        # False: the real loopback time is left out of neither trip (the client's work before the
        # body and the reply's transport both come on top of the emulated delays)
        self.compensate = compensate
        self._created = link.emulator.clock()
        self._released: Optional[float] = None  # when the request's last byte was released
        self._headers: Optional[float] = None  # when the reply's headers arrived
        self._floor = 0.0

    async def body(self, chunks: Iterable[Union[bytes, memoryview]]) -> AsyncIterator[Union[bytes, memoryview]]:
        """The request body, paced (``EmulatedLink.paced``)."""
        async for piece in self.link.paced(chunks, sent_at=self._created if self.compensate else None,
                                           charge=self.charge, on_serialized=self.on_serialized):
            yield piece
        self._released = self.link.emulator.clock()

    def reply_started(self) -> None:
        """Call when the reply's status and headers have arrived."""
        emu = self.link.emulator
        self._headers = emu.clock()
        if self._released is not None:
            self._floor = emu.observe_transport(self._headers - self._released)

    async def reply_done(self, nbytes: int) -> None:
        """Call when the reply (``nbytes``, 0 if none) has been read: waits out its emulated trip back."""
        read_s = self.link.emulator.clock() - self._headers if self._headers is not None else 0.0
        await self.link.after_reply(nbytes, overlap_s=self._floor + read_s if self.compensate else 0.0)


class _Transfer:
    """One message through one direction of a link: reserves slices, waits, then the delay."""

    def __init__(self, link: EmulatedLink, outgoing: bool, head_start_s: float = 0.0):
        self.link = link
        self.emu = link.emulator
        self.outgoing = outgoing
        head = min(MAX_CATCHUP_S, head_start_s) if head_start_s > 0 else 0.0
        # a head start counts as a slice that ended that long ago (the credit a late flow gets)
        self.prev_end: Optional[float] = self.emu.clock() - head if head > 0 else None
        self.first_start: Optional[float] = None  # when its first byte began on the link

    def _buckets(self, now: float) -> list[tuple[TokenBucket, float]]:
        rate = self.link.bandwidth(now)
        out = [(self.link._out if self.outgoing else self.link._back, rate)]
        if self.outgoing and self.emu.uplink is not None:
            out.append((self.emu.uplink, self.emu.uplink_rate))
        return out

    def slice_bytes(self) -> int:
        rates = [r for _, r in self._buckets(self.emu.clock()) if r > 0]
        if not rates:
            return MIN_SLICE_BYTES
        return int(min(MAX_SLICE_BYTES, max(MIN_SLICE_BYTES, min(rates) * QUANTUM_S)))

    async def send(self, nbytes: int) -> None:
        """Reserves ``nbytes`` on the link (and uplink) and waits until they have passed."""
        while True:
            now = self.emu.clock()
            buckets = self._buckets(now)
            if all(r > 0 for _, r in buckets):
                break
            await self.emu._sleep(DOWN_POLL_S)  # partitioned: wait for the link to come back
            self.prev_end = None
        cap = max(MAX_CATCHUP_S, SEND_BUFFER_BYTES / min(r for _, r in buckets))
        credit = 0.0 if self.prev_end is None else min(cap, max(0.0, now - self.prev_end))
        for b, r in buckets:
            b.set_rate(r)
        start = max(b.earliest(now, credit) for b, _ in buckets)
        end = max(b.take(start, nbytes) for b, _ in buckets)
        self.prev_end = end
        if self.first_start is None:
            self.first_start = start
        await self.emu._sleep_until(end, precise=False)

    def held_s(self) -> float:
        """Seconds from its first byte's start on the link to its last byte's end (0 before any)."""
        if self.first_start is None or self.prev_end is None:
            return 0.0
        return self.prev_end - self.first_start

    async def finish(self) -> None:
        """The propagation delay after the last byte; FIFO with earlier messages on this link."""
        end = self.prev_end if self.prev_end is not None else self.emu.clock()
        release = max(end + self.link.one_way_delay(), self.link._released[self.outgoing])
        self.link._released[self.outgoing] = release
        # equal release times would leave the order to the event loop: wait for the one before too
        before = self.link._last[self.outgoing]
        mine = self.link._last[self.outgoing] = asyncio.get_running_loop().create_future()
        try:
            await self.emu._sleep_until(release, precise=True)
            if before is not None and not before.done():
                await asyncio.shield(before)
        finally:
            if not mine.done():
                mine.set_result(None)

    async def run(self, nbytes: int) -> None:
        left = nbytes
        while left > 0:
            n = min(left, self.slice_bytes())
            await self.send(n)
            left -= n
        await self.finish()


class LinkEmulator:
    """The emulated network as seen by one scenario peer (``self_name``). See the module docstring."""

    def __init__(
        self,
        scenario: "Scenario",
        self_name: str,
        clock: Clock = time.monotonic,
        *,
        seed: int = 0,
        t0: Optional[float] = None,
        sleep: Sleep = asyncio.sleep,
        spin_s: float = 0.0012,
    ):
        self.scenario = scenario
        self.self_name = self_name
        self.me = scenario.peer(self_name)  # ScenarioError if unknown
        self.clock = clock
        self.seed = seed
        self.t0 = clock() if t0 is None else t0  # traces count from here
        self.spin_s = spin_s
        self._sleep_fn = sleep
        self.uplink_rate = (self.me.uplink_mbps or 0.0) * BYTES_PER_MBIT / scenario.time_dilation
        self.uplink: Optional[TokenBucket] = TokenBucket(self.uplink_rate) if self.uplink_rate > 0 else None
        self._links: dict[str, EmulatedLink] = {}
        self._tails: deque[float] = deque(maxlen=32)

    def link_for(self, dst_name: str) -> EmulatedLink:
        """The emulated link to scenario peer ``dst_name`` (ScenarioError if there is none)."""
        link = self._links.get(dst_name)
        if link is None:
            if dst_name == self.self_name:
                raise ValueError(f"{self.self_name} has no emulated link to itself")
            cls, trace = self.scenario.link_between(self.self_name, dst_name)
            link = self._links[dst_name] = EmulatedLink(self, dst_name, cls, trace)
        return link

    def links(self) -> list[EmulatedLink]:
        """Every link to the other peers of the scenario."""
        return [self.link_for(p.name) for p in self.scenario.peers if p.name != self.self_name]

    def set_factor(self, target: Union[str, tuple[str, str]], factor: float) -> list[str]:
        """Multiplies the bandwidth of links by ``factor`` from now on (on top of any trace; 1 restores,
        0 partitions). ``target``: a destination peer name, or a pair of regions (every link of this
        peer that joins them). Returns the destinations changed."""
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"link factor must be a number >= 0, not {factor!r}")
        if isinstance(target, str):
            dsts = [self.link_for(target)]
        else:
            ra, rb = target
            mine = self.me.region
            if mine not in (ra, rb):
                return []
            other = rb if mine == ra else ra
            dsts = [l for l in self.links() if self.scenario.peer(l.dst).region == other]
        for link in dsts:
            link.factor = factor
        return [l.dst for l in dsts]

    def paced(self, dst: str, chunks: Iterable[Union[bytes, memoryview]]) -> AsyncIterator[Union[bytes, memoryview]]:
        return self.link_for(dst).paced(chunks)

    async def transmit(self, dst: str, nbytes: int) -> None:
        await self.link_for(dst).transmit(nbytes)

    async def after_reply(self, dst: str, nbytes: int) -> None:
        await self.link_for(dst).after_reply(nbytes)

    def stats(self) -> dict[str, dict]:
        """Traffic so far per destination: link class, messages, bytes sent, replies, bytes back."""
        return {d: {"link": l.link_class.name, **vars(l.stats)} for d, l in sorted(self._links.items())}

    def observe_transport(self, tail_s: float) -> float:
        """Records the real time from the release of a request's last byte to its reply's headers;
        returns the floor of recent ones (the loopback transport's own round trip, capped at 2 ms),
        which the reply's emulated trip then leaves out, so that RTTs measure as configured."""
        if math.isfinite(tail_s) and tail_s >= 0:
            self._tails.append(tail_s)
        return min(min(self._tails, default=0.0), 0.002)

    async def _sleep(self, seconds: float) -> None:
        await self._sleep_fn(seconds)

    async def _sleep_until(self, t: float, precise: bool) -> None:
        d = t - self.clock()
        if d <= (TURN_S if precise else COARSE_MIN_S):
            return
        if not precise or self.spin_s <= 0:
            await self._sleep_fn(d)
            return
        if d > self.spin_s:
            await self._sleep_fn(d - self.spin_s)
        while self.clock() < t:  # the last ~1 ms: yield to the loop rather than oversleep
            await asyncio.sleep(0)
