"""The control plane of ``--liveness swim`` (``peer.swim_loop``), simulated (issue 33).

``sim.control_plane`` shows where the record design stops: every peer proves it lives by a DHT
record every 2 s and the planner reads every record every second, so a peer's traffic grows with the
swarm. This simulates the design built instead (first simulated here, then built and calibrated
against the live meter), with the record design's sizes (``control_plane.Sizes``) and its own:

- **liveness by direct probes** (SWIM): every ``probe_s`` each peer pings one member (a shuffled
  round-robin); a ping with no ack within ``ack_s`` is retried through ``indirect`` others; a peer
  still silent is suspected, and dead ``suspect_s`` later unless it refutes. News (joins, deaths,
  new records, refutations) rides on pings and acks (``piggyback`` pieces each, each piece sent
  ``retransmit_factor * log2(n)`` times by each peer that knows it); deaths go to the watchers
  (the planner and its standby) directly too;
- **records stored when they change, else every ``record_s``**, straight to their member key's
  ``replicas`` nodes (``buckets`` keys by peer id, as the record design), which each peer looks up
  every ``lookup_s``; a peer's new record goes signed to the watchers in a message; nobody polls a
  member key: a joiner reads one (enough members in it) and asks one of those members for its list
  of members with their addresses, the others read a record when they need it (a stage map's peer:
  not in an idle swarm; a peer that begins to watch reads every key once: not modeled, rare);
- an idle peer (no job) reads the job key every ``job_poll_s`` at one of its nodes, as in the record
  design; **churn**: each peer joins or leaves ``churn_per_hour`` times an hour.

What a peer sends and receives a second (as the live meter counts it: DHT protobuf sizes and the
swim messages' frame sizes), the busiest node's share, and how long a crash takes to reach the
planner, by Monte Carlo over the probe rounds (``simulate_swim``).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional

from .control_plane import ControlFigures, Ledger, Sizes, _ids, _key_id, _nearest

__all__ = ["SwimDesign", "simulate_swim"]


@dataclass(frozen=True)
class SwimDesign:
    name: str = "swim"
    probe_s: float = 1.0
    ack_s: float = 0.5
    indirect: int = 3
    suspect_s: float = 2.0
    piggyback: int = 6  # pieces of news on one ping or ack, at most
    retransmit_factor: float = 3.0
    ping_bytes: int = 96  # a ping or an ack without news: its frame (version, op, incarnation, life, record seq, address)
    update_bytes: int = 62  # one piece of news: peer id, state code, incarnation, life, record seq (measured)
    url_bytes: int = 72  # the address beside a piece of news of a live member (``urls``, a hint; measured)
    address_sends: int = 2  # ...with its first sends by each peer (``SwimParams.address_sends``)
    head_bytes: int = 0  # on every message, the head of the stage map its sender follows (a job's: 24)
    list_entry_bytes: int = 100  # one member in the list a joiner asks a member for (news and its address)
    buckets: int = 8  # member keys (``keys.MEMBER_BUCKETS``)
    record_s: float = 300.0
    lookup_s: float = 600.0  # a key's nodes looked up again after this long (``swim_loop.HOLDERS_TTL_S``)
    replicas: int = 5
    visits: int = 5
    watchers: int = 2
    job_poll_s: Optional[float] = 5.0  # an idle peer's reads of the job key, at one of its nodes, and
    job_reads_per_s: float = 20.0  # no more of them swarm-wide (``run_records.JOB_IDLE_READS_PER_S``)
    churn_per_hour: float = 1.0
    rtt_s: float = 0.05  # between peers (a region); a direct message to the planner takes one
    link_mbps: float = 100.0
    sizes: Sizes = field(default_factory=Sizes)


def _first_probe_s(rng: random.Random, n: int, probe_s: float) -> float:
    """When the first of the ``n - 1`` others probes a given peer: each probes it once every ``n - 1``
    rounds (a shuffled round robin) at a uniformly placed moment of its cycle; the earliest of
    ``m`` uniform draws is ``1 - U ** (1 / m)`` of the cycle."""
    m = n - 1
    return probe_s * m * (1.0 - rng.random() ** (1.0 / m))


def charge_swim(d: SwimDesign, n: int, rng: random.Random, ids: list[int], ledger: Ledger,
                extra_events_per_s: float = 0.0) -> tuple[list[int], list[int]]:
    """Charges ``ledger`` with a second of SWIM and the member records (``simulate_swim``; a training
    swarm's too: ``control_job``), ``extra_events_per_s`` pieces of news swarm-wide beside the churn's.
    Returns (each member key's value bytes, the watchers)."""
    z, call = d.sizes, ledger.call
    # news a second swarm-wide, and how many pieces ride on each ping and ack on average
    events_per_s = n * d.churn_per_hour / 3600.0 + extra_events_per_s
    sends_per_event = n * d.retransmit_factor * max(1.0, math.log2(n))
    wanted = events_per_s * sends_per_event / (2.0 * n / d.probe_s)  # per ping + ack pair
    carried = min(2.0 * d.piggyback, wanted)
    # a piece's address goes with its first ``address_sends`` sends by each peer of its ``3 log2 n``;
    # where news outruns the pings, the least-sent go first: fresher pieces, more of them addressed
    addressed = min(1.0, d.address_sends * max(1.0, wanted / (2.0 * d.piggyback))
                    / math.ceil(d.retransmit_factor * math.log2(n + 2)))
    ping = d.ping_bytes + d.head_bytes + carried / 2 * (d.update_bytes + addressed * d.url_bytes)
    of = [rng.randrange(d.buckets) for _ in range(n)]
    values = [z.value_base + of.count(b) * z.entry for b in range(d.buckets)]
    neighbours = min(z.bucket, n - 1) * z.neighbour
    bucket_ids = [_key_id(f"spantrain/sim/members.{b:02d}") for b in range(d.buckets)]
    near = [_nearest(ids, k, d.replicas + 1) for k in bucket_ids]  # the caller left out below
    job_near = _nearest(ids, _key_id("spantrain/sim/job"), d.replicas + 1)
    watchers = sorted(range(n), key=ids.__getitem__)[:d.watchers]
    joins_per_s = d.churn_per_hour / 2 / 3600.0  # of each peer: half its churn is joining
    for p in range(n):
        # one probe a round to a random member (its ack back); on average each peer is probed once a round
        other = rng.randrange(n - 1)
        call(p, other + (other >= p), 1.0 / d.probe_s, ping, ping, "swim pings")  # any peer but p itself
        mine = [i for i in near[of[p]] if i != p][:d.replicas]
        for r in mine:  # its record, re-stored; its key's nodes, looked up (a search beside the key: no value)
            call(p, r, 1.0 / d.record_s, z.store_request_base + z.entry, z.store_response, "members stored")
            call(p, r, 1.0 / d.lookup_s, z.find_request, neighbours, "key nodes looked up")
        if d.job_poll_s:
            job = [i for i in job_near if i != p][:d.replicas]
            for r in job:
                call(p, r, 1.0 / d.lookup_s, z.find_request, neighbours)
                call(p, r, 1.0 / max(d.job_poll_s, n / d.job_reads_per_s) / len(job), z.find_request, 0)
        # joining: one member key read at one of its nodes (enough members in it: a large swarm's),
        # the member list from one of them, its record to the watchers
        b = rng.randrange(d.buckets)
        call(p, rng.choice([i for i in near[b] if i != p][:d.replicas]), joins_per_s, z.find_request, values[b])
        other = rng.randrange(n - 1)
        call(p, other + (other >= p), joins_per_s, d.ping_bytes, d.ping_bytes + (n - 1) * d.list_entry_bytes)
        for w in watchers:
            if w != p:
                call(p, w, joins_per_s, d.ping_bytes + z.entry, d.ping_bytes)

    return values, watchers


def simulate_swim(design: SwimDesign, n: int, seed: int = 0, crashes: int = 200, joins: int = 200) -> ControlFigures:
    if n < 2:
        raise ValueError("a swarm to simulate has at least 2 peers")
    rng = random.Random(seed)
    d = design
    ids = _ids(n, rng)
    ledger = Ledger(n)
    values, _watchers = charge_swim(d, n, rng, ids, ledger)

    # a crash, as the planner sees it: the first probe of the dead peer, its ack (``ack_s``) and the
    # indirect probes' (``2 ack_s + 0.5``) time out, the suspicion runs out and is found so at the
    # prober's next round (within ``probe_s``), and the prober tells the planner directly
    crash = [_first_probe_s(rng, n, d.probe_s) + 3 * d.ack_s + 0.5 + d.suspect_s + rng.uniform(0, d.probe_s)
             + d.rtt_s / 2 for _ in range(crashes)]
    # a join: the joiner stores its record (its key's nodes looked up first) and sends it to the planner
    lookup = d.visits * d.rtt_s
    join = [lookup + rng.uniform(0.5, 1.5) * d.rtt_s + d.rtt_s / 2 for _ in range(joins)]

    return ledger.figures(d.name, d.link_mbps, int(max(values)), crash, join, lookup)
