"""A simulator of the swarm's control plane (issue 33): DHT calls and their bytes per peer, the load on
the busiest node, and how long a joiner and a crash take to be seen, for any swarm size.

What it models, and nothing more, one virtual clock, plain data:

- ``n`` peers with hivemind DHT ids (``DHTID.generate``); every key of the swarm is stored on the
  ``replicas`` nodes nearest to its id (XOR distance), as hivemind's ``num_replicas`` places it;
- each peer stores its member record every ``heartbeat_s`` (a search of the key's nearest nodes,
  then a store on each replica), reads the member key every ``poll_s`` (the same search), and,
  while no member shows a job, reads the job key every ``job_poll_s``; phases are random;
- a search visits ``visits`` nodes (the key's nearest other than the caller, at most ``n - 1``); a
  node that holds the key (a replica, or, with ``caches``, any node that read it before) answers a
  find with the whole dictionary, the others with their nearest neighbours only; ``refresh``
  re-reads a key in the background after each read (hivemind's cache refresh before expiry);
- sizes are per entry and per call (``Sizes``, calibrated against the live meter:
  ``scripts/control_plane_live.py``); a call costs its request and its response, counted as sent by
  one peer and received by the other, as the live meter counts them;
- a record expires ``ttl_heartbeats`` heartbeats after it was stored: a crashed peer is out of an
  observer's view at the observer's first read after its last record expired; a joiner is in it at
  the first read after its first store (a search takes ``call_s`` per visited node, one after
  another, plus its answers' bytes over the reader's link of ``link_mbps``: a large dictionary read
  from five nodes is slow on a home link). With ``watchers``, only that many peers (the planner and
  its standby) read every poll and the others seldom (``membership.read_interval``); the times are
  then the planner's, which re-plans on them. With ``buckets``, the member records are split over
  that many keys by peer id (``keys.MEMBER_BUCKETS``), each on its own nodes (``_simulate_buckets``).

``simulate(design, n)`` returns ``ControlFigures``; the script ``scripts/control_plane_sim.py``
prints them against N beside the live runs.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Optional

from ..swarm.membership import read_interval

__all__ = ["ControlFigures", "DESIGNS", "Design", "Sizes", "plot_traffic", "simulate", "spread"]


@dataclass(frozen=True)
class Sizes:
    """Bytes of the protobuf messages (what the live meter counts), fitted to the live runs."""

    entry: int = 1450  # one member record in a dictionary value (signed record, subkey, expiration)
    value_base: int = 60  # a dictionary value's own framing
    find_request: int = 110  # keys + the caller's node info
    neighbour: int = 62  # one (node id, peer id) pair in a find's answer
    bucket: int = 20  # neighbours a find answers with (hivemind's bucket size)
    store_request_base: int = 150  # store of one entry: key, subkey, expiration, node info
    store_response: int = 60


@dataclass(frozen=True)
class Design:
    name: str
    heartbeat_s: float = 2.0
    ttl_heartbeats: int = 3
    poll_s: float = 1.0  # member reads
    job_poll_s: Optional[float] = 5.0  # an idle peer's job reads (None: none)
    replicas: int = 5
    visits: int = 5  # nodes a read's search visits (the beam)
    store_visits: Optional[int] = None  # nodes a store's search visits (None: as a read's)
    caches: bool = False  # every reader keeps (and serves) a copy of what it read
    direct_lookup_s: Optional[float] = None  # reads and stores go straight to the key's replicas, one call
    # each, found by a search this often (``GuardedDHT``'s holders); None: every read and store searches
    refresh: bool = False  # every read is followed by a background re-read
    # peers that read the member key every poll (the planner and its standby); the others space their
    # reads by the swarm's size (``membership.read_interval``). None: every peer reads every poll
    watchers: Optional[int] = None
    seldom_holders: int = 5  # how many of the key's nodes a peer that does not watch asks a read (at random)
    watch_holders: int = 5  # and a watcher (``membership.WATCH_HOLDERS``)
    lookup_value: bool = True  # a lookup of a key's holders brings the key's value from each (searched
    # for the key's own id; False: for an id beside it, which nobody holds)
    # member records split over this many keys by peer id (``keys.MEMBER_BUCKETS``): a read of them all
    # asks each node it picks once for every key it holds (``holders.pick``, ``direct_lookup_s`` only)
    buckets: int = 1
    key_bytes: int = 22  # one more key id in a find request
    values_only: bool = False  # a read at the buckets' nodes is answered without neighbours (``find_values``)
    job_holders: int = 5  # of the job key's nodes, how many an idle peer's job poll asks (at random)
    call_s: float = 0.002  # one find or store, request to response, besides its bytes (loopback here)
    link_mbps: float = 100.0  # a peer's link: a search's answers all come down it
    sizes: Sizes = field(default_factory=Sizes)


DESIGNS = {
    # hivemind's defaults, as the peers used them before issue 33: 20-node searches, caches on, a
    # background re-read of each key after its use, idle peers reading the job key every 0.5 s
    "hivemind-defaults": Design("hivemind-defaults", job_poll_s=0.5, visits=20, caches=True, refresh=True),
    # after issue 33's first changes: reads search 5 nodes, no background re-reads, no copies pushed
    # after reads, job reads only once one shows; stores still search 20 nodes and every reader
    # keeps (and serves) its copy
    "today": Design("today", caches=True, store_visits=20),
    # also without the node's caches and with 5-node store searches: measured live on 2026-11-26 at
    # 17:23 UTC, then put back (without the cache, busy suites saw partial reads)
    "no-caches": Design("no-caches"),
    # as shipped since 2026-11-26 21:00 UTC: reads of the latest value and stores ask the key's 5
    # nearest nodes directly (one call each), found by a search every 30 s (GuardedDHT._holders_of)
    "direct": Design("direct", direct_lookup_s=30.0),
    # from 2026-11-27: as "direct", but only the planner and its standby read the members every
    # poll, the others about 8 records a poll, and the holders are looked up without their value
    "watchers": Design("watchers", direct_lookup_s=30.0, watchers=2, lookup_value=False),
    # and each read of a peer that does not watch asks one of the key's nodes, not all five
    "watchers-1": Design("watchers-1", direct_lookup_s=30.0, watchers=2, lookup_value=False, seldom_holders=1),
    # and a watcher's asks two of them (as shipped since 2026-11-27 12:45 UTC)
    "watchers-2-1": Design("watchers-2-1", direct_lookup_s=30.0, watchers=2, lookup_value=False, seldom_holders=1,
                           watch_holders=2),
    # and the member records in 8 keys by peer id, read together (commit a974bcb, measured live)
    "buckets-8": Design("buckets-8", direct_lookup_s=30.0, watchers=2, lookup_value=False, seldom_holders=1,
                        watch_holders=2, buckets=8),
    # and a watcher asks one node a key, the reads answered without neighbours, holders looked up
    # every 60 s, an idle peer's job poll asks one of the job key's nodes (as shipped since
    # 2026-11-27 16:30 UTC)
    "buckets-lean": Design("buckets-lean", direct_lookup_s=60.0, watchers=2, lookup_value=False, seldom_holders=1,
                           watch_holders=1, buckets=8, values_only=True, job_holders=1),
}


@dataclass(frozen=True)
class ControlFigures:
    n: int
    design: str
    bytes_per_s: dict  # per peer, sent + received: mean, p50, p99, max
    calls_per_s: dict  # per peer, made: mean, p99
    served_per_s: dict  # per node, answered: mean, max
    busiest_over_mean: float  # the busiest node's answered bytes against the mean node's
    largest_value: int  # bytes of the member key's dictionary
    crash_to_noticed_s: dict  # over observers and crashes: p50, p95, max
    join_to_visible_s: dict
    search_s: float  # one read of the member key, on the design's link
    link_load: dict  # per peer, the busier direction's control bytes over its link's capacity (> 1: cannot keep up)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def plot_traffic(ax_bytes, ax_busiest, rows_by_design: dict, what: str) -> None:
    """Onto two matplotlib axes, each design's rows (``ControlFigures.to_dict()`` against N): a peer's
    mean and p99 bytes a second, and the busiest node against the mean, with issue 33's bounds (4 KB/s
    mean, 10x); ``what`` names the swarm in the titles. The scripts' figures share these panels."""
    kb = 1024
    for name, rows in rows_by_design.items():
        ns = [r["n"] for r in rows]
        ax_bytes.loglog(ns, [r["bytes_per_s"]["mean"] / kb for r in rows], "o-", label=f"{name}, mean")
        ax_bytes.loglog(ns, [r["bytes_per_s"]["p99"] / kb for r in rows], "s--", label=f"{name}, p99")
        ax_busiest.loglog(ns, [r["busiest_over_mean"] for r in rows], "o-", label=name)
    ax_bytes.axhline(4, color="grey", lw=0.8)
    ax_bytes.set(xlabel="peers", ylabel="KB/s per peer (up + down)", title=f"control traffic per peer ({what})")
    ax_busiest.axhline(10, color="grey", lw=0.8)
    ax_busiest.set(xlabel="peers", ylabel="busiest node / mean", title=f"load on the busiest node ({what})")


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.getrandbits(160) for _ in range(n)]


def _key_id(name: str) -> int:
    from hivemind.dht.routing import DHTID

    return int(DHTID.generate(source=name))


def _nearest(ids: list[int], key: int, k: int) -> list[int]:
    """Indices of the ``k`` ids nearest to ``key`` (XOR)."""
    return sorted(range(len(ids)), key=lambda i: ids[i] ^ key)[:k]


def spread(xs: list[float]) -> dict:
    """Mean, median, 95th and 99th percentile (the value at the rounded rank) and maximum of ``xs``."""
    s = sorted(xs)
    if not s:
        return {"mean": math.nan, "p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"mean": statistics.fmean(s), "p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "max": s[-1]}


class Ledger:
    """Calls a second between ``n`` peers, as the live meter counts them: a call's request is sent by
    its caller and received by the node it asks, its response the other way; both simulators
    (``simulate``, ``control_swim.simulate_swim``) charge their calls here."""

    def __init__(self, n: int):
        self.sent = [0.0] * n  # bytes a second
        self.received = [0.0] * n
        self.calls = [0.0] * n  # made
        self.served = [0.0] * n  # answered
        self.served_bytes = [0.0] * n
        self.served_what: dict[int, dict[str, float]] = {}  # node -> what it answered (labelled calls), bytes/s

    def call(self, src: int, dst: int, rate: float, req: float, resp: float, what: str = "") -> None:
        if what:
            parts = self.served_what.setdefault(dst, {})
            parts[what] = parts.get(what, 0.0) + rate * (req + resp)
        self.calls[src] += rate
        self.served[dst] += rate
        self.sent[src] += rate * req
        self.received[dst] += rate * req
        self.sent[dst] += rate * resp
        self.received[src] += rate * resp
        self.served_bytes[dst] += rate * (req + resp)

    def busiest(self) -> dict:
        """The node answering the most bytes: its index, bytes/s, and what they are (the labelled
        calls; the rest, SWIM's among them, as "other")."""
        i = max(range(len(self.served_bytes)), key=self.served_bytes.__getitem__)
        parts = dict(self.served_what.get(i, {}))
        parts["other"] = self.served_bytes[i] - sum(parts.values())
        return {"node": i, "bytes_per_s": self.served_bytes[i], "parts": parts}

    def figures(self, design: str, link_mbps: float, largest_value: int, crash: list[float],
                join: list[float], search_s: float) -> ControlFigures:
        mean_served = statistics.fmean(self.served_bytes)
        link = link_mbps * 1e6 / 8
        return ControlFigures(
            n=len(self.sent), design=design,
            bytes_per_s=spread([s + r for s, r in zip(self.sent, self.received)]),
            calls_per_s=spread(self.calls), served_per_s=spread(self.served),
            busiest_over_mean=max(self.served_bytes) / mean_served if mean_served > 0 else math.nan,
            largest_value=largest_value, crash_to_noticed_s=spread(crash), join_to_visible_s=spread(join),
            search_s=search_s, link_load=spread([max(s, r) / link for s, r in zip(self.sent, self.received)]),
        )


def simulate(design: Design, n: int, seed: int = 0, crashes: int = 20, joins: int = 20) -> ControlFigures:
    """One idle swarm of ``n`` peers (no job) under ``design``, in steady state; see the module."""
    if n < 2:
        raise ValueError("a swarm to simulate has at least 2 peers")
    rng = random.Random(seed)
    ids = _ids(n, rng)
    z = design.sizes
    members = _key_id("spantrain/sim/members")
    job = _key_id("spantrain/sim/job")
    replicas = set(_nearest(ids, members, design.replicas))
    job_replicas = set(_nearest(ids, job, design.replicas))
    value = z.value_base + n * z.entry
    neighbours = min(z.bucket, n - 1) * z.neighbour

    ledger = Ledger(n)
    call = ledger.call
    if design.buckets > 1:
        if not design.direct_lookup_s:
            raise ValueError("member buckets are read straight at their nodes: set direct_lookup_s")
        return _simulate_buckets(design, n, rng, ids, ledger, job, job_replicas, neighbours, crashes, joins)

    def search(src: int, key: int, holders: set, rate: float, key_value: int, visits: int = design.visits) -> None:
        """One search per 1/rate seconds: the nearest nodes to ``key`` but ``src``."""
        visited = _nearest_cached(src, key, visits)
        for dst in visited:
            holds = dst in holders or design.caches
            call(src, dst, rate, z.find_request, neighbours + (key_value if holds and key_value else 0))

    cache: dict[tuple[int, int], list[int]] = {}

    def _nearest_cached(src: int, key: int, visits: int) -> list[int]:
        # the key's nearest nodes once, then the caller left out (a search never asks itself)
        base = cache.get((key, visits))
        if base is None:
            base = cache[(key, visits)] = _nearest(ids, key, visits + 1)
        return [i for i in base if i != src][:visits]

    reads = 1.0 / design.poll_s * (2 if design.refresh else 1)
    beats = 1.0 / design.heartbeat_s
    watching = set(range(n) if design.watchers is None else sorted(range(n), key=ids.__getitem__)[:design.watchers])
    seldom = 1.0 / read_interval(n, design.poll_s, False)
    for p in range(n) if design.direct_lookup_s else ():
        lookups = 1.0 / design.direct_lookup_s
        search(p, members, replicas, lookups, value if design.lookup_value else 0)  # the holders, found
        others = replicas - {p}
        for r in others:  # a seldom reader's reads spread over the nodes it picks from at random
            rate = (reads * min(1.0, design.watch_holders / len(others)) if p in watching
                    else seldom * min(1.0, design.seldom_holders / len(others)))
            call(p, r, rate, z.find_request, neighbours + value)
            call(p, r, beats, z.store_request_base + z.entry, z.store_response)
        if design.job_poll_s:
            search(p, job, job_replicas, lookups, 0)
            for r in job_replicas - {p}:
                call(p, r, 1.0 / design.job_poll_s, z.find_request, neighbours)
    for p in range(n) if not design.direct_lookup_s else ():
        search(p, members, replicas, reads, value)
        search(p, members, replicas, beats, value, design.store_visits or design.visits)  # a store's search
        for r in replicas - {p}:
            call(p, r, beats, z.store_request_base + z.entry, z.store_response)
        if design.job_poll_s:
            search(p, job, job_replicas, 1.0 / design.job_poll_s, 0)

    # membership times, from the phases of heartbeats and reads (a search takes visits x call_s)
    visits = min(design.visits, n - 1)
    answers = visits * (neighbours + (value if design.caches else min(visits, design.replicas) * value / visits))
    search_s = visits * design.call_s + answers / (design.link_mbps * 1e6 / 8)
    if design.direct_lookup_s:  # the replicas asked at once: one call's time, all answers down the link
        search_s = design.call_s + visits * (neighbours + value) / (design.link_mbps * 1e6 / 8)
    stored = search_s + (design.replicas * design.call_s)  # the joiner's first store lands
    if design.direct_lookup_s:  # its first store: a search for the holders, then one call to each at once
        stored = visits * design.call_s + design.call_s
    crash, join = _membership_times(design, n, rng, search_s, stored, crashes, joins)
    return ledger.figures(design.name, design.link_mbps, value, crash, join, search_s)


def _membership_times(design: Design, n: int, rng: random.Random, search_s: float, stored: float, crashes: int,
                      joins: int) -> tuple[list[float], list[float]]:
    """(crash to noticed, join to visible) in seconds, over ``crashes`` and ``joins`` and up to 8
    observers each: a crashed peer's record expires ``ttl_heartbeats`` after its last heartbeat (at a
    random phase), a joiner's first record lands ``stored`` after it starts; an observer sees either
    at its first read after, which takes ``search_s``."""
    ttl = design.heartbeat_s * design.ttl_heartbeats
    crash, join = [], []
    for _ in range(crashes):
        beat_phase = rng.uniform(0, design.heartbeat_s)  # time since its last stored heartbeat at the crash
        expires = ttl - beat_phase
        for _obs in range(min(8, n - 1)):
            read_phase = rng.uniform(0, design.poll_s)  # when the observer reads next
            k = math.ceil(max(0.0, expires - read_phase) / design.poll_s)
            crash.append(read_phase + k * design.poll_s + search_s)
    for _ in range(joins):
        for _obs in range(min(8, n - 1)):
            read_phase = rng.uniform(0, design.poll_s)
            k = math.ceil(max(0.0, stored - read_phase) / design.poll_s)
            join.append(read_phase + k * design.poll_s + search_s)
    return crash, join


def _simulate_buckets(design: Design, n: int, rng: random.Random, ids: list[int], ledger: Ledger, job: int,
                      job_replicas: set, neighbours: int, crashes: int, joins: int, reads_sampled: int = 8) -> ControlFigures:
    """``simulate`` with the member records split over ``design.buckets`` keys: each peer's heartbeat
    goes to its own bucket's nodes; a read of all buckets asks the nodes ``holders.pick`` chooses,
    each once for all its keys (``reads_sampled`` picks per reader, averaged); the holders of every
    bucket are looked up in one search every ``direct_lookup_s``."""
    from ..swarm.holders import pick

    z, d, call = design.sizes, design, ledger.call
    bucket_ids = [_key_id(f"spantrain/sim/members.{b:02d}") for b in range(d.buckets)]
    near = [_nearest(ids, k, d.replicas + 1) for k in bucket_ids]  # the key's nearest, the caller left out later
    of = [rng.randrange(d.buckets) for _ in range(n)]
    count = [of.count(b) for b in range(d.buckets)]
    values = [z.value_base + c * z.entry for c in count]
    watching = set(sorted(range(n), key=ids.__getitem__)[:d.watchers or n])
    reads, beats, lookups = 1.0 / d.poll_s, 1.0 / d.heartbeat_s, 1.0 / d.direct_lookup_s
    seldom = 1.0 / read_interval(n, d.poll_s, False)
    for p in range(n):
        held = {b: [i for i in near[b] if i != p][:d.replicas] for b in range(d.buckets)}
        # the lookup: one search for every bucket, each visited node asked once for the ids it is near
        visited: dict[int, int] = {}
        for b in range(d.buckets):
            for dst in held[b]:
                visited[dst] = visited.get(dst, 0) + 1
        for dst, q in visited.items():
            call(p, dst, lookups, z.find_request + (q - 1) * d.key_bytes, q * neighbours)
        rate = reads if p in watching else seldom
        ask = d.watch_holders if p in watching else d.seldom_holders
        near_bytes = 0 if d.values_only else neighbours
        for _ in range(reads_sampled):
            for dst, bs in pick(held, ask, rng, whole_below=d.replicas).items():
                call(p, dst, rate / reads_sampled, z.find_request + (len(bs) - 1) * d.key_bytes,
                     sum(near_bytes + values[b] for b in bs))
        for r in near[of[p]][:d.replicas]:  # the bucket's nearest nodes, this one stored locally where among them
            if r != p:
                call(p, r, beats, z.store_request_base + z.entry, z.store_response)
        if d.job_poll_s:
            others = job_replicas - {p}
            for r in others:
                call(p, r, lookups, z.find_request, neighbours)  # its holders, looked up
                call(p, r, min(1.0, d.job_holders / len(others)) / d.job_poll_s, z.find_request, near_bytes)
    # the times: as one key's (a watcher reads every bucket every poll, all at once), the answers
    # (each bucket from ``watch_holders`` nodes) down the reader's link
    link = d.link_mbps * 1e6 / 8
    search_s = d.call_s + d.watch_holders * (d.buckets * (0 if d.values_only else neighbours) + sum(values)) / link
    crash, join = _membership_times(d, n, rng, search_s, min(d.visits, n - 1) * d.call_s + d.call_s, crashes, joins)
    return ledger.figures(design.name, d.link_mbps, max(values), crash, join, search_s)
