"""A proposed control plane for large swarms, simulated (issue 33): not built yet.

``sim.control_plane`` shows where today's design stops: every peer reads every member's record
every second, so a peer's traffic grows with the swarm and the member key's five replicas serve it
all (their uplinks fill near 75 peers on 100 Mbit/s). This simulates the design proposed instead,
with the same sizes (``control_plane.Sizes``, fitted to the live meter), to choose its parameters
before building it:

- **liveness by direct probes** (SWIM): every ``probe_s`` each peer pings one member, in a shuffled
  round-robin order; a ping that gets no ack within ``ack_s`` is retried through ``indirect``
  others; a peer that still does not answer is suspected, and declared dead ``suspect_s`` later
  unless it refutes (a newer incarnation). Membership news (joins, suspicions, deaths, a new planner
  or stage-map epoch) rides on pings and acks (``piggyback`` updates each, every update sent
  ``retransmit_factor * log2(n)`` times by each peer that knows it), and deaths and joins go to the
  planner and its standby directly too;
- **records that live long, in buckets**: a member's signed record (its addresses, device,
  profile) is stored under ``members/<bucket>`` (``buckets`` keys: no value grows past
  ``n / buckets`` records) and refreshed every ``record_s`` straight to the bucket's known
  replicas, with a search for them every ``search_every`` refreshes; records are read on demand
  (a new member's, by the planner), never polled;
- **churn**: each peer joins or leaves ``churn_per_hour`` times an hour: the news piggybacked.

What a peer sends and receives a second, the busiest node's share, and how long a crash and a join
take to reach the planner, by Monte Carlo over the probe rounds (``simulate_swim``). The figures
are the design's, not a measurement: the live control plane is today's (``control_plane``).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .control_plane import ControlFigures, Ledger, Sizes, _ids, _key_id, _nearest

__all__ = ["SwimDesign", "simulate_swim"]


@dataclass(frozen=True)
class SwimDesign:
    name: str = "swim-buckets"
    probe_s: float = 1.0
    ack_s: float = 0.5
    indirect: int = 3
    suspect_s: float = 2.0
    piggyback: int = 6  # updates on one ping or ack, at most
    retransmit_factor: float = 3.0
    ping_bytes: int = 120  # signed ping or ack without news: sender, incarnation, sequence, signature
    update_bytes: int = 110  # one piece of news: peer id, state, incarnation, signed
    buckets: int = 64
    record_s: float = 60.0
    search_every: int = 60  # once an hour, and whenever a replica fails to take a store (not modeled)
    replicas: int = 5
    visits: int = 5
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


def simulate_swim(design: SwimDesign, n: int, seed: int = 0, crashes: int = 200, joins: int = 200) -> ControlFigures:
    if n < 2:
        raise ValueError("a swarm to simulate has at least 2 peers")
    rng = random.Random(seed)
    z, d = design.sizes, design
    ids = _ids(n, rng)
    ledger = Ledger(n)
    call = ledger.call

    # news a second swarm-wide, and how many updates ride on each ping and ack on average
    events_per_s = n * d.churn_per_hour / 3600.0
    sends_per_event = n * d.retransmit_factor * max(1.0, math.log2(n))
    carried = min(2.0 * d.piggyback, events_per_s * sends_per_event / (2.0 * n / d.probe_s))  # per ping + ack pair
    ping = d.ping_bytes + carried / 2 * d.update_bytes
    per_bucket = n / d.buckets
    value = z.value_base + per_bucket * z.entry
    neighbours = min(z.bucket, n - 1) * z.neighbour
    bucket_ids = [_key_id(f"spantrain/sim/members/{b}") for b in range(d.buckets)]
    bucket_replicas = [_nearest(ids, k, d.replicas) for k in bucket_ids]
    search_nodes = [_nearest(ids, k, d.visits + 1) for k in bucket_ids]
    for p in range(n):
        # one probe a round to a random member (its ack back); on average each peer is probed once a round
        other = rng.randrange(n - 1)
        call(p, other + (other >= p), 1.0 / d.probe_s, ping, ping)  # any peer but p itself
        b = rng.randrange(d.buckets)
        for r in bucket_replicas[b]:
            if r != p:
                call(p, r, 1.0 / d.record_s, z.store_request_base + z.entry, z.store_response)
        for r in [i for i in search_nodes[b] if i != p][: d.visits]:
            call(p, r, 1.0 / (d.record_s * d.search_every), z.find_request, neighbours + value)

    # a crash, as the planner sees it: the first probe of the dead peer, its ack and the indirect
    # probes time out, the suspicion runs out, and the confirmer tells the planner directly
    crash = [_first_probe_s(rng, n, d.probe_s) + 2 * d.ack_s + d.suspect_s + d.rtt_s / 2 for _ in range(crashes)]
    # a join: the joiner reads the planner's lease (one search), stores its record and tells the planner
    lease_read = d.visits * (d.rtt_s + (z.find_request + neighbours + 400) / (d.link_mbps * 1e6 / 8))
    join = [lease_read + rng.uniform(0.5, 1.5) * d.rtt_s + d.rtt_s / 2 for _ in range(joins)]

    return ledger.figures(d.name, d.link_mbps, int(value), crash, join, lease_read)
