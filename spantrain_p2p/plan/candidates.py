"""What the planner's search chooses from: units, segments, orders of groups, layer splits.

A stage is always a *segment* of one network group: a run of its *units* in speed order (a unit
is one peer in a small group, a compute class in a large one), by default inside one compute
class. Groups are chained in a handful of *orders*; ``compositions`` are every layer split.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from .search import Search

Units = list[list[tuple[tuple[str, ...], int]]]  # per group: (peer ids, compute class) in speed order


@dataclass
class Segment:
    group: int
    u0: int  # first unit (index within the group)
    u1: int  # last unit, inclusive
    peers: tuple[str, ...]
    shares: tuple[float, ...]


def units(ctx: Search) -> Units:
    """Per group, its units in speed order, each with the index of its compute class."""
    peers, opts = ctx.peers, ctx.opts
    out = []
    for g in ctx.grouping.groups:
        row = []
        fine = len(g.peers) <= opts.fine_group_size
        for ci, c in enumerate(g.classes):
            cs = sorted(c, key=lambda x: (-peers[x].flops, x))
            if fine:
                row.extend(((pid,), ci) for pid in cs)
                continue
            k = max(1, min(opts.chunks_per_class, len(cs)))
            size = len(cs) / k
            for i in range(k):
                chunk = tuple(cs[int(round(i * size)):int(round((i + 1) * size))])
                if chunk:
                    row.append((chunk, ci))
        out.append(row)
    return out


def segments(ctx: Search, units: Units) -> list[Segment]:
    """Stages the search may form: runs of consecutive units of one compute class. Replicas of a
    stage are then within 1.5x of each other's speed: a much slower replica would hold up the
    micro-batches it owns, and with them every later one (they flow in index order)."""
    peers, single_class, ratio = ctx.peers, ctx.opts.single_class_stages, ctx.opts.replica_speed_ratio
    segs = []
    for gi, us in enumerate(units):
        for a in range(len(us)):
            for b in range(a, len(us)):
                ids = tuple(pid for u, _c in us[a:b + 1] for pid in u)
                if single_class and us[b][1] != us[a][1]:
                    if not ratio or max(peers[x].flops for x in ids) > ratio * min(peers[x].flops for x in ids):
                        continue
                segs.append(Segment(gi, a, b, ids, ctx.shares(ids)))
    return segs


def group_link(ctx: Search, ga: int, gb: int) -> tuple[float, float]:
    """(rtt_s, bandwidth) representative of links from group ga to group gb."""
    a, b = ctx.grouping.groups[ga].peers[0], ctx.grouping.groups[gb].peers[0]
    est = ctx.links.estimates.get((min(ga, gb), max(ga, gb)))
    if est is not None:
        return est.rtt_s, est.bandwidth
    lk = ctx.links.get(a, b)
    return lk.rtt_s, lk.bandwidth


def group_orders(ctx: Search, ref_bytes: float) -> list[tuple[int, ...]]:
    """Orders of the groups along the pipeline: every permutation for up to 4 groups; beyond,
    fastest first, slowest first, and nearest-neighbour chains on inter-group link cost (for
    ``ref_bytes`` a message) from each of the 3 fastest groups, also 2-opt improved."""
    grouping, peers = ctx.grouping, ctx.peers
    g = len(grouping.groups)
    if g <= 4:
        return list(itertools.permutations(range(g)))
    speed = [sum(peers[x].flops for x in grp.peers) for grp in grouping.groups]
    cost = [[0.0] * g for _ in range(g)]
    for i in range(g):
        for j in range(g):
            if i != j:
                rtt, bw = group_link(ctx, i, j)
                cost[i][j] = rtt + ref_bytes / bw
    by_speed = tuple(sorted(range(g), key=lambda i: (-speed[i], i)))
    orders = [by_speed, tuple(reversed(by_speed))]

    def nn_chain(start: int) -> list[int]:
        chain, left = [start], set(range(g)) - {start}
        while left:
            nxt = min(left, key=lambda j: (cost[chain[-1]][j], -speed[j], j))
            chain.append(nxt)
            left.remove(nxt)
        return chain

    def length(ch: Sequence[int]) -> float:
        return sum(cost[ch[i]][ch[i + 1]] for i in range(len(ch) - 1))

    def two_opt(ch: list[int]) -> list[int]:
        best, improved = ch[:], True
        while improved:
            improved = False
            for i in range(1, g - 1):
                for j in range(i + 1, g):
                    cand = best[:i] + best[i:j + 1][::-1] + best[j + 1:]
                    if length(cand) < length(best) - 1e-12:
                        best, improved = cand, True
        return best

    for start in by_speed[:3]:
        ch = nn_chain(start)
        orders.append(tuple(ch))
        orders.append(tuple(two_opt(ch)))
    seen, out = set(), []
    for o in orders:
        if o not in seen:
            seen.add(o)
            out.append(o)
    return out[:ctx.opts.max_orders]


def compositions(L: int, p: int) -> Iterator[list[tuple[int, int]]]:
    """Every split of ``L`` layers into ``p`` contiguous non-empty ranges."""
    for cuts in itertools.combinations(range(1, L), p - 1):
        bounds = (0,) + cuts + (L,)
        yield [(bounds[k], bounds[k + 1]) for k in range(p)]
