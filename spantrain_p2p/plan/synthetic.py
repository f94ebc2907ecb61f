"""A generated heterogeneous swarm, for planning at a scale no box can run (``--synthetic-peers``).

``synthetic_swarm(n, regions, seed)``: regions placed on a map (RTT between two regions grows
with their distance), uneven region sizes, four device classes from datacenter GPUs to laptops.
Links are sparse, as a prober at scale would measure them: each peer knows ``intra_links``
random peers of its own region (fast: 0.5-2 Gbit/s, 1-5 ms) and ``inter_links`` peers of other
regions (slow: 50-500 Mbit/s, RTT by distance); every other pair is unknown.
"""
from __future__ import annotations

import math
import random

from .types import Link, Network, PeerInfo, Snapshot

# name, effective FLOP/s, memory bytes, weight
DEVICE_MIX = (
    ("dc-gpu", 40e12, 80e9, 0.10),
    ("workstation", 15e12, 24e9, 0.30),
    ("consumer", 6e12, 12e9, 0.40),
    ("laptop", 2e12, 8e9, 0.20),
)


def synthetic_swarm(n: int, regions: int, seed: int = 0, intra_links: int = 8, inter_links: int = 2) -> Snapshot:
    if not 1 <= regions <= n:
        raise ValueError(f"need 1 <= regions <= peers, got {regions} regions for {n} peers")
    if n > 100_000:
        raise ValueError("at most 100000 synthetic peers")
    rng = random.Random(seed)
    centers = [(rng.uniform(0, 150), rng.uniform(0, 80)) for _ in range(regions)]
    weights = [rng.uniform(0.5, 1.5) for _ in range(regions)]
    # every region gets at least one peer, the rest by weight
    region_of = list(range(regions)) + rng.choices(range(regions), weights=weights, k=n - regions)
    rng.shuffle(region_of)
    kinds = rng.choices(DEVICE_MIX, weights=[d[3] for d in DEVICE_MIX], k=n)
    peers = []
    members: list[list[str]] = [[] for _ in range(regions)]
    for i in range(n):
        _name, flops, mem, _w = kinds[i]
        pid = f"peer-{i:05d}"
        peers.append(PeerInfo(pid, flops * rng.uniform(0.9, 1.1), mem, f"region-{region_of[i]}"))
        members[region_of[i]].append(pid)
    rtt_ms = [[10.0 + math.dist(centers[a], centers[b]) for b in range(regions)] for a in range(regions)]
    links: dict[tuple[str, str], Link] = {}
    for i, p in enumerate(peers):
        r = region_of[i]
        own = members[r]
        for q in rng.sample(own, min(intra_links, len(own))):
            if q != p.id and (q, p.id) not in links:
                links[(p.id, q)] = Link(rng.uniform(1, 5) / 1e3, rng.uniform(500, 2000) * 1e6 / 8)
        if regions > 1:
            for _ in range(inter_links):
                other = rng.choice([x for x in range(regions) if x != r])
                q = rng.choice(members[other])
                if (q, p.id) not in links:
                    links[(p.id, q)] = Link((rtt_ms[r][other] + rng.uniform(0, 10)) / 1e3,
                                            rng.uniform(50, 500) * 1e6 / 8)
    return Snapshot(tuple(peers), Network(links))
