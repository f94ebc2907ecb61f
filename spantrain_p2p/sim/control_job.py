"""The control plane of a training swarm, simulated (issue 33): what ``sim.control_swim`` charges an
idle swarm, and what a job adds, by the code's rules, one rate per action, plain data.

A training swarm of ``n`` peers runs one stage map; besides SWIM and the member records of the idle
swarm (``control_swim.charge_swim``, its job polls off: the job is in sight), each second it has:

- **the stage map**: every peer reads the key (every ``map_read_s`` from ``map_holders`` of its
  nodes, each answering with the ``maps_held`` maps in it), or with ``map_check_peer`` asks one
  member at random whether it has a newer one (a ping's bytes each way); the planner re-stores it
  every ``map_keep_s`` (None: never);
- **the planner's lease**: the planner stores it every ``lease_s`` at the key's nodes; the planner
  and the ``close`` candidates after it read it every ``lease_s`` from all of its nodes, the others
  every ``far_lease_s`` from ``far_holders``;
- **records of steps**: every peer stores its record every ``step_record_s`` (its step changed);
  where ``step_told`` also sends it to the ``watchers`` and tells it on the pings (news);
- **the job's copies**: every peer re-stores its copy every ``job_copy_s``; its measurements every
  ``measure_keep_s`` (None: never);
- **weather**: each peer publishes new links every ``weather_s`` (the code's bound: its most
  often); with ``versions``, its record says so and goes to the planner, its standby and the
  grouping's ``voters``, with the entry where ``pushed`` (as the change to the last where
  ``link_deltas``), else they read that peer's links key
  from one node; without, the readers read every
  profile and link from two nodes each every ``whole_read_s`` (what they did before);
- **accusations**: the planner reads the accusation keys every second (empty: no attack, and
  nobody holds them: one search for them all, ``accuse_searched``; else two nodes of each).

Each epoch (a new map) adds a burst, reported apart (``per_epoch``): every peer reads the new map
(``news_holders`` of the key's nodes), or with ``map_push`` takes it down the tree of ``map_tree``
(one copy in, ``map_fanout`` out at most: about one out a peer), changes its state twice (stored, sent to the planner and its standby),
and, where ``map_members_read``, reads every member key from all their nodes; the planner tells every
peer of the map (with ``map_push``: hands it to ``map_fanout``) and asks each ready peer whether it
lives (``alive_bytes`` each way). ``epoch_max_bytes``: the most one node moves in the burst.

Sizes come in ``JobSizes`` (real encoders: ``cli.control_job``). ``simulate_job`` returns the
steady state's ``ControlFigures`` and the epoch's bytes per peer (mean and the planner's).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Optional

from .control_plane import ControlFigures, Ledger, _ids
from .control_swim import SwimDesign, charge_swim

__all__ = ["JobDesign", "JobSizes", "simulate_job"]


@dataclass(frozen=True)
class JobSizes:
    """The job's own entries; a member record, a find's and a store's framing are the calibrated
    ``control_plane.Sizes`` of the design's SWIM (``JobDesign.swim.sizes``), a ping its ``ping_bytes``."""
    link_entry: int = 3300  # one peer's links (10 probed) as stored
    link_change: int = 330  # its links sent again as the change to the last (``swarm.deltas``), one link changed
    profile_entry: int = 1500
    job_copy: int = 2300
    lease_entry: int = 700
    map_bytes: int = 2400  # the signed stage map of this swarm
    status_bytes_per_peer: int = 200  # ``/status`` grows with the member view
    mapnews: int = 150


@dataclass(frozen=True)
class JobDesign:
    name: str
    map_read_s: float = 2.0
    map_holders: int = 5
    maps_held: int = 1
    map_keep_s: Optional[float] = None
    news_holders: int = 5  # of the map key's nodes, how many a read on news asks
    lease_s: float = 1.0
    close: int = 3
    far_lease_s: float = 1.0
    far_holders: int = 5
    step_record_s: float = 30.0
    step_told: bool = True
    watchers: int = 2
    voters: int = 16
    job_copy_s: float = 150.0
    measure_keep_s: Optional[float] = None
    weather_s: float = 5.0
    versions: bool = False
    pushed: bool = False  # with versions: the new entry goes with the record (else each reader reads its key)
    link_deltas: bool = False  # pushed: as the change to the entry the reader took last
    whole_read_s: float = 5.0
    accuse_keys: int = 8
    accuse_searched: bool = True  # the keys empty (no attack): one search for them all, of ``swim.visits`` nodes
    map_members_read: bool = True
    alive_by_status: bool = True
    map_push: bool = False
    map_check_peer: bool = False
    map_fanout: int = 8
    member_buckets: int = 8
    links_buckets: int = 32
    profiles_buckets: int = 16
    record_news: bool = True  # a changed record (a state, a measurement version) is news on the pings
    news_per_s: float = 0.0  # changed records swarm-wide a second beside the weather's (a live run's epochs)
    swim: SwimDesign = field(default_factory=lambda: SwimDesign(job_poll_s=None, head_bytes=24))


def simulate_job(design: JobDesign, n: int, sizes: JobSizes = JobSizes(), seed: int = 0) -> tuple[ControlFigures, dict]:
    """(the steady state's figures, the burst of one epoch: bytes per peer, mean and the planner's)."""
    if n < 2:
        raise ValueError("a swarm to simulate has at least 2 peers")
    d, z = design, sizes
    dht, ping = d.swim.sizes, d.swim.ping_bytes  # the calibrated message sizes
    rng = random.Random(seed)
    ids = _ids(n, rng)
    ledger = Ledger(n)
    call = ledger.call
    order = sorted(range(n), key=ids.__getitem__)  # rank: the planner first, then its standby
    planner, lead = order[0], order[:d.watchers]
    readers = order[:max(d.watchers, d.voters)]  # the planner, its standby and the voters
    close = set(order[:1 + d.close])
    # a told record is news on the pings, a piece each, spread as every other piece: its step, its
    # links' new version (weather), a state (a live run's epochs)
    record_news = (n / d.step_record_s if d.step_told else 0.0) + (n / d.weather_s if d.versions else 0.0) + d.news_per_s
    charge_swim(replace(d.swim, replicas=5), n, rng, ids, ledger, extra_events_per_s=record_news if d.record_news else 0.0)

    def holders(key_seed: int, k: int, me: int) -> list[int]:
        r = random.Random(key_seed)
        return [i for i in r.sample(range(n), min(n, 6)) if i != me][:k]

    map_key, lease_key, accuse_base = 1, 2, 100
    member_key = [200 + b for b in range(d.member_buckets)]
    links_key = [300 + b for b in range(d.links_buckets)]
    profiles_key = [400 + b for b in range(d.profiles_buckets)]
    job_key = [500 + b for b in range(16)]
    kinds = [(1, "stage map"), (2, "lease"), (100, "accusations"), (200, "members"), (300, "links"),
             (400, "profiles"), (500, "job")]
    kind = lambda key: next(name for base, name in reversed(kinds) if key >= base)  # noqa: E731
    links_value = (n / d.links_buckets) * z.link_entry
    profiles_value = (n / d.profiles_buckets) * z.profile_entry

    def store(p: int, key: int, rate: float, entry: int) -> None:
        for h in holders(key, 5, p):
            call(p, h, rate, dht.store_request_base + entry, dht.store_response, f"{kind(key)} stored")

    def read(p: int, key: int, rate: float, value: float, k: int) -> None:
        hs = holders(key, 5, p)  # ``k`` of them, a reader's own pick (``holders.pick``: at random)
        for h in rng.sample(hs, min(k, len(hs))):
            call(p, h, rate, dht.find_request, value, f"{kind(key)} read")

    for p in range(n):
        # the stage map
        if d.map_check_peer:
            call(p, (p + 1 + rng.randrange(n - 1)) % n, 1.0 / d.map_read_s, ping, ping, "stage map asked")
        else:
            read(p, map_key, 1.0 / d.map_read_s, d.maps_held * z.map_bytes, d.map_holders)
        # the lease
        if p in close:
            read(p, lease_key, 1.0 / d.lease_s, z.lease_entry, 5)
        else:
            read(p, lease_key, 1.0 / d.far_lease_s, z.lease_entry, d.far_holders)
        # its record, its step changed
        mine = member_key[rng.randrange(d.member_buckets)]
        store(p, mine, 1.0 / d.step_record_s, dht.entry)
        if d.step_told:
            for w in lead:
                if w != p:
                    call(p, w, 1.0 / d.step_record_s, ping + dht.entry, ping, "steps told")
        # its job copy, its measurements kept
        store(p, job_key[rng.randrange(16)], 1.0 / d.job_copy_s, z.job_copy)
        lk, pk = links_key[rng.randrange(d.links_buckets)], profiles_key[rng.randrange(d.profiles_buckets)]
        if d.measure_keep_s:
            store(p, lk, 1.0 / d.measure_keep_s, z.link_entry)
            store(p, pk, 1.0 / d.measure_keep_s, z.profile_entry)
        # weather: its links re-published, and read by whom they concern
        w = 1.0 / d.weather_s
        store(p, lk, w, z.link_entry)
        if d.versions:
            store(p, mine, w, dht.entry)
            for r in readers:
                if r != p:
                    if d.pushed:  # told, the entry with the record
                        call(p, r, w, ping + dht.entry + (z.link_change if d.link_deltas else z.link_entry), ping,
                             "links pushed")
                    else:  # told, and its key read by each of them
                        call(p, r, w, ping + dht.entry, ping, "records told")
                        read(r, lk, w, links_value, 1)
    # readers without versions: every profile and link from two nodes of each key, every whole_read_s,
    # each node asked once for all the keys it is picked for (``GuardedDHT.get_many``)
    if not d.versions:
        for r in readers:
            asked: dict[int, float] = {}
            for key, value in [*((k, links_value) for k in links_key), *((k, profiles_value) for k in profiles_key)]:
                hs = holders(key, 5, r)
                for h in rng.sample(hs, min(2, len(hs))):
                    asked[h] = asked.get(h, 0.0) + value
            for h, value in asked.items():
                call(r, h, 1.0 / d.whole_read_s, dht.find_request, value, "measurements read")
    # the planner's own: the lease, the map kept, the accusations
    store(planner, lease_key, 1.0 / d.lease_s, z.lease_entry)
    if d.map_keep_s:
        store(planner, map_key, 1.0 / d.map_keep_s, z.map_bytes)
    if d.accuse_searched:  # nobody holds them: ``GuardedDHT.get_many`` searches for them all at once
        for h in rng.sample([i for i in range(n) if i != planner], min(n - 1, d.swim.visits)):
            call(planner, h, 1.0, dht.find_request, dht.value_base, "accusations read")
    else:
        for b in range(d.accuse_keys):
            read(planner, accuse_base + b, 1.0, 0, 2)

    # one epoch's burst, per peer (bytes up + down)
    member_read = sum(5 * (dht.find_request + (n / d.member_buckets) * dht.entry) for _ in member_key)
    got_map = 2 * (ping + z.map_bytes) if d.map_push else d.news_holders * (dht.find_request + d.maps_held * z.map_bytes)
    peer_epoch = (got_map
                  + 2 * 5 * (dht.store_request_base + dht.entry) + 2 * len(lead) * (2 * ping + dht.entry)
                  + (member_read if d.map_members_read else 0.0) + z.mapnews)
    peer_epoch_calls = (1 if d.map_push else d.news_holders) + 2 * 5 + 2 * len(lead) + (5 * d.member_buckets if d.map_members_read else 0)
    alive = (z.status_bytes_per_peer * n) if d.alive_by_status else 2 * ping
    told = d.map_fanout * (ping + z.map_bytes) if d.map_push else n * z.mapnews
    planner_epoch = peer_epoch + told + n * (dht.find_request + alive) + 2 * n * (2 * ping + dht.entry)
    # the busiest node of the burst: the planner, or a node of the map key answering its share of the reads
    key_node = 0.0 if d.map_push else n * d.news_holders / 5 * (dht.find_request + d.maps_held * z.map_bytes)
    inner = (1 + d.map_fanout) * (ping + z.map_bytes) if d.map_push else 0.0
    figs = ledger.figures(d.name, d.swim.link_mbps, int(max(d.maps_held * z.map_bytes, links_value, profiles_value)),
                          [], [], 0.0)
    per_epoch = {"peer_bytes": peer_epoch, "peer_calls": peer_epoch_calls, "planner_bytes": planner_epoch,
                 "max_bytes": max(planner_epoch, peer_epoch + key_node, peer_epoch + inner),
                 "planner": {"bytes_per_s": ledger.sent[planner] + ledger.received[planner]},
                 "busiest": {**(b := ledger.busiest()), "rank": order.index(b["node"]), "reader": b["node"] in readers}}
    return figs, per_epoch
