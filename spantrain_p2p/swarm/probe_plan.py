"""Which links of a swarm to probe: the full mesh for small swarms, else a bounded set per peer
(``probe_targets``, what the peers probe: its nearest members by round trip and a few others), or
every pair inside each candidate group plus a few samples across groups (``sparse_probe_plan``).

Pure functions; ``sparse_probe_plan`` of the peer ids and the candidate groups (``grouping``), so
every peer computes the same plan. Probing a link is ``net.prober.probe_link``.
"""
from __future__ import annotations

import hashlib
import math
from typing import Mapping, Sequence

FULL_MESH_MAX_PEERS = 16


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


NEAREST, FAR = 8, 2  # beyond the full mesh, the links one peer probes: its nearest members and a few others
PING_MAX = 24  # beyond the full mesh, the members one peer pings to find its nearest


def ping_targets(me: str, others: Sequence[str], full_mesh_max: int = FULL_MESH_MAX_PEERS,
                 most: int = PING_MAX) -> list[str]:
    """The members ``me`` pings before it probes (``probe_targets`` picks its nearest from them): every
    member up to ``full_mesh_max``, else ``most`` of them picked by a hash of the pair (different for
    every peer). A joiner of a swarm of 1,000 pinged all 1,000 in turn, ten rounds of one ping each:
    minutes on real round trips, where 24 take a few seconds and still find nearby members in a swarm
    of a few regions (the planner needs a peer's region's links, not the nearest of all)."""
    pool = sorted(set(others) - {me})
    if len(pool) + 1 <= full_mesh_max:
        return pool
    return sorted(sorted(pool, key=lambda p: _h(me, p))[:most])


def probe_budget(members: int, full_mesh_max: int = FULL_MESH_MAX_PEERS, nearest: int = NEAREST, far: int = FAR) -> int:
    """How many links a peer of a swarm of ``members`` probes (``probe_targets``)."""
    return members - 1 if members <= full_mesh_max else min(members - 1, nearest + far)


def probe_targets(me: str, others: Sequence[str], rtts: Mapping[str, float], full_mesh_max: int = FULL_MESH_MAX_PEERS,
                  nearest: int = NEAREST, far: int = FAR) -> list[str]:
    """The members ``me`` probes the links to, from its own pings (``rtts``: peer id -> seconds).

    Up to ``full_mesh_max`` members, all of them. Beyond, a bounded set, so that a peer's probing
    (a bulk transfer each, one at a time) does not grow with the swarm: its ``nearest`` members by
    round trip (its region's, where the planner needs each link) and ``far`` others picked by a hash
    of the pair (different for every peer, so that together they measure the links between
    regions). A member it has no ping of counts as far. The planner prices a link nobody probed by
    the median of the measured ones between the same two groups (``plan.layout.LinkTable``), and a
    pair probed one way only by that direction."""
    pool = sorted(set(others) - {me})
    if len(pool) + 1 <= full_mesh_max:
        return pool
    pinged = sorted((p for p in pool if p in rtts and math.isfinite(rtts[p])), key=lambda p: (rtts[p], _h(me, p)))
    near = pinged[:nearest]
    rest = sorted(set(pool) - set(near), key=lambda p: _h(me, p))
    return sorted(near + rest[:far])
