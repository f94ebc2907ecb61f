"""A joiner's way from launch to its first stage map in a training swarm of ``n`` peers, simulated
(issue 33: "join to first plan within 30 s at N = 1,000").

The phases are the trainer's own (``train.measuring``, ``train.run_records``, the milestones each
peer reports), each charged what it costs at ``n``; what does not depend on ``n`` (starting the
daemon and joining, building and profiling the model) is taken from a live run
(``scripts/join_path.py --calibrate``), the rest is computed from the code's own rules and sizes:

- **joined**: the live start, then (``--liveness swim``) one member's list with addresses, 100 bytes
  a member, and every member record once (a peer without a stage map watches), down the joiner's link;
- **job**: the job's copies from 2 nodes, one key of ``n / 16`` copies beyond 256 members
  (``run_records.JOB_VOTES`` a key), else all 16 keys, down the link;
- **profiled**: the live build and profile, then its entry stored at its key's nodes (a lookup of
  ``visits`` round trips first);
- **pinged**: ``ping_targets`` members (every one up to 16, else 24, 8 at a time), rounds of one
  ping each as ``net.ping.ping_links`` sends them (short links up to 4 times a round), 10 counted
  rounds and one to connect, at least 0.5 s, at most 10 s; then its entry stored, the entries of the
  peers that measure now read (the joiner's own bucket), and its quiet slot (0.5 s) to ping the
  short links again where it has any;
- **probed**: ``probe_budget`` links, each probed as ``net.prober.probe_link`` does on the pair's
  bandwidth (one ping, bulk transfers growing from 64 KiB until one takes 0.2 s, then that size
  once or twice more);
- **map**: the stage map in force, read (its size at ``n``: a real plan of a synthetic swarm of
  ``n``, with peer ids as long as real ones; over ``run_records.MAX_MAP_BYTES`` it cannot be
  published: inf);
- **planned**: the planner's next check (every ``REPLAN_CHECK_S``), its read of every profile and
  link (every key of both kinds, from 2 of each key's nodes: ``measure.READ_HOLDERS``; beyond 100
  ready peers only the joiner's key of each kind, ``Coordinator._measured_snapshot``), and planning (timed: the real planner on a synthetic swarm of
  ``n``). The new plan moves the joiner in only if it is 15 % faster for 10 s (``decide``); a plan
  that leaves it a spare has still weighed it.

Round trips: the joiner sits in one of ``regions`` regions placed on a map as ``plan.synthetic``
places them (1-5 ms inside a region, 10 ms + the distance between two); its members are spread
over the regions. Everything is plain data and one random generator: ``simulate_join``.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Optional

from ..swarm.probe_plan import PING_MAX, FULL_MESH_MAX_PEERS, probe_budget
from ..swarm.keys import LINKS, PROFILES, buckets_of
from ..train.coordinator import WHOLE_READ_PEERS
from ..swarm.measure import READ_HOLDERS
from ..train.measuring import PING_AT_ONCE, QUIET_SLOT_S, SHORT_RTT_S
from ..train.run_records import JOB_VOTES, MAX_MAP_BYTES
from ..sim.control_plane import spread

__all__ = ["JoinCosts", "JoinWorld", "Sizes", "entry_sizes", "largest_values", "planner_at", "ping_phase_s", "probe_s", "simulate_join"]


@dataclass(frozen=True)
class JoinCosts:
    """What a live joiner spent where ``n`` does not matter (seconds, from its milestones)."""

    start_s: float = 3.0  # launch to joined (its daemon, the DHT, the reachability check)
    job_s: float = 0.5  # joined to measuring, less the job's read (the model handle, the data's first shard)
    profile_s: float = 5.0  # measuring to profiled, less the store (building the layers, profiling them)
    ready_s: float = 0.1  # probed to ready


@dataclass(frozen=True)
class Sizes:
    """Bytes of one entry of each kind as the DHT carries it (signed payload inside the node's signed
    record), from ``entry_sizes``; the defaults are its figures for the built-in transformer of 8
    layers and 10 links a peer."""

    job_copy: int = 2300
    profile: int = 1500
    links: int = 3300
    links_change: int = 330  # the links sent again to a watcher that took the last, one link changed (``swarm.deltas``)
    member_list_entry: int = 100
    stage_map: dict = field(default_factory=dict)  # n -> bytes of its signed stage map


@dataclass(frozen=True)
class JoinWorld:
    regions: int = 10
    link_mbps: float = 100.0  # the joiner's own link (a home's): every transfer's ceiling
    intra_rtt_ms: tuple = (1.0, 5.0)  # a pair's round trip inside a region (``plan.synthetic``)
    intra_mbps: tuple = (500.0, 2000.0)  # and its bandwidth
    inter_mbps: tuple = (50.0, 500.0)  # and between two
    call_s: float = 0.0  # a DHT call's own time beyond its round trip
    visits: int = 5  # round trips of a lookup of a key's nodes
    swim: bool = True


UNARY_MAX = 2 << 20  # the most a hivemind DHT response may carry (its unary payloads)
RECORD_BYTES = 1450  # a member record as stored (``sim.control_plane.Sizes.entry``)


def region_rtts(regions: int, rng: random.Random) -> list[list[float]]:
    """Round trips (s) between region centres on a 150 x 80 map, 10 ms + the distance in ms
    (``plan.synthetic``)."""
    centres = [(rng.uniform(0, 150), rng.uniform(0, 80)) for _ in range(regions)]
    return [[(10.0 + math.dist(a, b)) / 1e3 for b in centres] for a in centres]


def ping_phase_s(rtts: list[float], count: int = 10, gap_s: float = 0.01, min_s: float = 0.5,
                 deadline_s: float = 10.0, overhead_s: float = 0.0006, at_once: int = 1) -> tuple[float, int]:
    """(seconds, rounds) of ``net.ping.ping_links(count=10, gap_s=0.01, min_s=0.5)`` over targets
    with these round trips: rounds of one ping each (up to 4 to a link much shorter than the longest),
    ``at_once`` targets at a time, each ping followed by a baseline ping of ``overhead_s``, until
    ``count`` rounds after the first and ``min_s`` have passed, or ``deadline_s``."""
    if not rtts:
        return 0.0, 0
    longest = max(rtts)

    def each(r: float, repeat: bool) -> float:
        return (r + overhead_s + gap_s) * (min(4, max(1, int(longest / max(r, 1e-4)))) if repeat else 1)

    def one_round(repeat: bool) -> float:  # the slowest of each group pinged at once, groups in turn
        return sum(max(each(r, repeat) for r in rtts[i:i + at_once]) for i in range(0, len(rtts), at_once))

    per_round, first = one_round(True), one_round(False)
    t, rounds = first, 0
    while rounds < 4 * count and t < deadline_s and (rounds < count or t < min_s):
        t += per_round
        rounds += 1
    return min(t, deadline_s), rounds


def probe_s(rtt: float, mbps: float, start: int = 64 << 10, min_bulk_s: float = 0.2, target_s: float = 0.3) -> float:
    """Seconds ``net.prober.probe_link`` takes on a link (given its RTT from the pings): one ping,
    bulk transfers from ``start`` bytes, each at most 16x the last, until one takes ``min_bulk_s``,
    then that size once more (a third time only when two disagree: not modeled)."""
    bps = mbps * 1e6 / 8
    t, size = rtt, start
    while True:
        transfer = size / bps
        t += rtt + transfer
        if transfer >= min_bulk_s or size >= 64 << 20:
            return t + rtt + transfer
        grow = target_s / transfer if transfer > 1e-3 else 16.0
        size = int(min(64 << 20, size * min(16.0, max(2.0, grow))))


def entry_sizes(num_layers: int = 8, links: int = 10) -> Sizes:
    """Each kind's entry as it is stored: its signed payload (``records.sign_payload``) inside the
    storing node's signed record (``validator.SwarmValidator.sign_value``), with real encoders and a
    real key."""
    import msgpack
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    from ..job.spec import JobSpec
    from ..net.prober import LinkMeasurement
    from ..profile.profiler import DeviceProfile
    from ..swarm import keys
    from ..swarm.deltas import Sent
    from ..swarm.identity import Identity
    from ..swarm.records import sign_payload
    from ..swarm.validator import SwarmValidator

    me = Identity.generate()
    v = SwarmValidator("s", me)

    def stored(key: str, payload: dict) -> int:
        inner = msgpack.packb(sign_payload(payload, me, 1 << 20), use_bin_type=True)
        rec = DHTRecord(DHTID.generate(source=key).to_bytes(), msgpack.packb(me.peer_id), inner, time.time() + 60)
        return len(v.sign_value(rec)) + len(me.peer_id) + 16  # the subkey and the expiry beside it

    t = tuple(1e-3 * (i + 1) for i in range(num_layers))
    prof = DeviceProfile(t, t, t, 8 << 30, 12.5)
    ids = [Identity.generate().peer_id for _ in range(links)]
    link = {p: LinkMeasurement(p, "ok", 12.345678, 123.456789, "", 1 << 20, 0.5).to_dict() for p in ids}
    job = JobSpec(steps=1000).finalized()
    sent, mv = Sent(), int(time.time() * 10)
    before = sign_payload({"links": link, "mv": mv}, me, 1 << 20)
    sent.wire("w", keys.LINKS, before)
    sent.acked("w", keys.LINKS, before)
    after = sign_payload({"links": {**link, ids[3]: {**link[ids[3]], "mbps": 98.7654321}}, "mv": mv + 1}, me, 1 << 20)
    return Sizes(
        links_change=len(msgpack.packb(sent.wire("w", keys.LINKS, after), use_bin_type=True)),
        job_copy=stored(keys.job_key_of("s", me.peer_id), job.to_dict()),
        profile=stored(keys.measure_key_of("s", keys.PROFILES, me.peer_id),
                       {"profile": prof.to_dict(), "job": job.job_id, "tflops": 12.5, "provisional": False}),
        links=stored(keys.measure_key_of("s", keys.LINKS, me.peer_id), {"links": link}),
    )


def largest_values(n: int, sizes: Sizes, seed: int = 0) -> dict[str, int]:
    """Bytes of the largest value of each kind with one entry a peer, at ``n`` peers: the fullest of
    its keys (``keys.buckets_of``, by the hash of ``n`` random peer ids) times its entry's size."""
    from ..swarm import keys
    from ..sim.control_plane import Sizes as RecordSizes

    rng = random.Random(seed)
    ids = [f"12D3KooW{rng.getrandbits(200):050x}" for _ in range(n)]
    out = {}
    for kind, entry in (("members", RecordSizes().entry), ("job", sizes.job_copy), (keys.PROFILES, sizes.profile),
                        (keys.LINKS, sizes.links)):
        b = keys.buckets_of(kind)
        counts = [0] * b
        for p in ids:
            counts[keys.bucket_of(p, b)] += 1
        out[kind] = max(counts) * entry
    return out


def planner_at(n: int, regions: int = 10, seed: int = 0) -> tuple[float, int]:
    """(seconds the planner took, bytes of the signed stage map) for a synthetic swarm of ``n``
    (``plan.synthetic``), its peers renamed to ids as long as real ones: the real planner, timed here."""
    from ..plan import planner as pl
    from ..plan import types as pt
    from ..plan.synthetic import synthetic_swarm
    from ..plan.types import default_planning_model
    from ..plan.stagemap import StageMap
    from ..swarm.identity import Identity
    from ..swarm.records import sign_payload

    snap = synthetic_swarm(n, min(regions, n), seed)
    prof = pt.ModelProfile.from_model_config(default_planning_model())
    opts = pl.PlannerOptions(global_batch=2048)
    t0 = time.perf_counter()
    plan = pl.plan(snap, prof, opts).plan
    took = time.perf_counter() - t0
    rid = {p.id: f"12D3KooW{p.id[-5:]:0>44}" for p in snap.peers}  # 52 characters, as an Ed25519 peer id
    stages = tuple(_renamed(st, rid) for st in plan.stages)
    smap = StageMap(1, "j" * 16, stages, 0, tuple((rid[p], f"peer-{i}") for i, p in enumerate(
        q for st in plan.stages for q in st.peers)), schedule=plan.schedule, predicted_step_s=float(plan.step_s))
    return took, len(__import__("msgpack").packb(sign_payload(smap.to_dict(), Identity.generate(), 8 << 20)))


def _renamed(st, rid):
    from dataclasses import replace

    return replace(st, peers=tuple(rid[p] for p in st.peers))


def simulate_join(n: int, costs: JoinCosts = JoinCosts(), sizes: Sizes = Sizes(), world: JoinWorld = JoinWorld(),
                  plan_s: Optional[float] = None, map_bytes: Optional[int] = None, seed: int = 0,
                  samples: int = 200, replan_check_s: float = 5.0, before: bool = False) -> dict:
    """Phase by phase and in all, the seconds from a joiner's launch to each milestone (spread over
    ``samples`` joiners in random regions); ``plan_s``/``map_bytes``: the planner's time and the map's
    size at ``n`` (``planner_at``; None: not charged).

    ``before``: the design as it was until 2026-11-28 (commit b5ce1d1): the joiner read every member
    record (records liveness, the default then), the job's copies in one key from its 5 nodes, pinged
    every member one after another, and the planner read each measurement kind's one key whole from 5
    nodes; a key over ``UNARY_MAX`` cannot be read at all (its milestone: inf)."""
    if n < 2:
        raise ValueError("a joiner needs a swarm of at least 1 peer: n >= 2")
    rng = random.Random(seed)
    link = world.link_mbps * 1e6 / 8
    rows = []
    for _ in range(samples):
        rt = region_rtts(world.regions, rng)
        mine = rng.randrange(world.regions)
        members = [rng.randrange(world.regions) for _ in range(n - 1)]

        def rtt_to(r: int) -> float:
            return rng.uniform(*world.intra_rtt_ms) / 1e3 if r == mine else rt[mine][r] + rng.uniform(0, 10) / 1e3

        near = min(rtt_to(r) for r in members[:8])  # the member it joins through, and asks (one of a few)
        lookup = world.visits * (near + world.call_s)
        ph = {}
        if before:  # every member record (8 keys), from one node each
            ph["joined"] = costs.start_s + lookup + near + n * RECORD_BYTES / link
        else:
            # a member's list, and (a peer without a stage map watches) every member record once
            ph["joined"] = costs.start_s + ((near + (n - 1) * sizes.member_list_entry / link + lookup
                                             + n * RECORD_BYTES / link) if world.swim else 0.0)
        jb = buckets_of("job")  # one key of copies beyond JOB_VOTES a key, else every key at once
        copies = 5 * n if before else 2 * (n / jb if n > JOB_VOTES * jb else n)  # from 2 of its nodes
        ph["job"] = costs.job_s + lookup + near + copies * sizes.job_copy / link
        if before and n * sizes.job_copy > UNARY_MAX:
            ph["job"] = math.inf
        ph["profiled"] = costs.profile_s + lookup + near  # its entry stored at its key's nodes
        k = n - 1 if before else min(n - 1, PING_MAX if n > FULL_MESH_MAX_PEERS else n - 1)
        pinged = rng.sample(members, k)
        rtts = [rtt_to(r) for r in pinged]
        ping_s, _rounds = ping_phase_s(rtts, at_once=1 if before or n <= FULL_MESH_MAX_PEERS else PING_AT_ONCE)
        # its entry stored, the measuring peers' read (its own bucket: n / 8 entries of a few bytes),
        # its quiet slot to ping the short links again (alone: nobody else measures)
        short = any(r < SHORT_RTT_S for r in rtts)
        ph["pinged"] = ping_s + 2 * (near + world.call_s) + (QUIET_SLOT_S if short else 0.0)
        order = sorted(range(k), key=rtts.__getitem__)
        budget = probe_budget(n)
        targets = order[:min(budget, 8 if n > FULL_MESH_MAX_PEERS else budget)]
        far = [rtt_to(rng.randrange(world.regions)) for _ in range(budget - len(targets))]
        probes = 0.0
        for i in targets:
            lo, hi = world.intra_mbps if pinged[i] == mine else world.inter_mbps
            probes += probe_s(rtts[i], min(world.link_mbps, rng.uniform(lo, hi)))
        for r in far:
            probes += probe_s(r, min(world.link_mbps, rng.uniform(*world.inter_mbps)))
        ph["probed"] = probes + near + world.call_s + costs.ready_s  # its links stored
        ph["map"] = 2 * near + (map_bytes or 0) / link
        if (map_bytes or 0) > MAX_MAP_BYTES:  # the planner cannot publish a map that large
            ph["map"] = ph["planned_after"] = math.inf
        # the planner: its next check, every profile and link read (16 keys), the plan
        if before or n <= WHOLE_READ_PEERS:  # every profile and link
            planner_read = (5 if before else READ_HOLDERS) * n * (sizes.profile + sizes.links) / link + 2 * near
        else:  # the joiner's key of each kind (``Coordinator._measured_snapshot``)
            planner_read = READ_HOLDERS * n * (sizes.profile / buckets_of(PROFILES) + sizes.links / buckets_of(LINKS)) / link + 2 * near
        ph["planned"] = rng.uniform(0, replan_check_s) + planner_read + (plan_s or 0.0) + near
        if (before and n * max(sizes.profile, sizes.links) > UNARY_MAX) or ph.pop("planned_after", 0.0) == math.inf:
            ph["planned"] = math.inf
        t, row = 0.0, {}
        for name in ("joined", "job", "profiled", "pinged", "probed", "map"):
            t += ph[name]
            row[name] = t
        row["planned"] = row["probed"] + ph["planned"]
        rows.append({"at": row, "phase": ph})
    return {"n": n, "at": {m: spread([r["at"][m] for r in rows]) for m in rows[0]["at"]},
            "phase": {m: spread([r["phase"][m] for r in rows]) for m in rows[0]["phase"]}}
