"""Two-level grouping of a swarm from one measurement snapshot: network groups, then compute classes.

Every peer runs this on the same snapshot and must get the same answer, so it is a pure,
deterministic function of the snapshot's content (never of the order of its lists), and
``Grouping.digest()`` is what peers publish to check they agree.

**Network groups** ("regions"): single-linkage clustering over the known links, best link
first. A link joins two groups only if it is about as good as the links already inside
each of them: bandwidth at least ``1 / bandwidth_factor`` of the group's slowest internal
link and RTT at most ``max(rtt_factor * the group's slowest internal RTT, that + rtt_slack_s)``.
A lone peer's yardstick is its own best link, so a peer whose best link is a slow WAN hop
stays alone rather than dragging a WAN link into a fast group. Unknown links are skipped:
a group stays connected through its other links, so a few missing measurements change nothing.
Both directions of a pair count by their worse one. Cost: sorting the links, O(E log E),
plus near-linear union-find.

**Compute classes** inside a group: peers sorted by speed, fastest first; a new class starts
where a peer is more than ``class_ratio`` (1.5x) slower than the fastest of the current class.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

REF_BYTES = 8e6  # the transfer size that ranks links: an activation-sized message


@dataclass(frozen=True)
class GroupingOptions:
    bandwidth_factor: float = 3.0
    rtt_factor: float = 2.0
    rtt_slack_s: float = 0.005
    class_ratio: float = 1.5


@dataclass(frozen=True)
class NetworkGroup:
    """Peers joined by fast links; ``classes`` partitions them by speed, fastest class first."""

    peers: tuple[str, ...]
    classes: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Grouping:
    groups: tuple[NetworkGroup, ...]

    def group_of(self) -> dict[str, int]:
        return {p: i for i, g in enumerate(self.groups) for p in g.peers}

    def canonical(self) -> dict:
        return {"v": 1, "groups": [[list(c) for c in g.classes] for g in self.groups]}

    def digest(self) -> str:
        """sha256 (hex) of the canonical JSON form: equal groupings give equal digests."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"digest": self.digest(), **self.canonical()}


class _DSU:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))
        self.size = [1] * n
        self.min_bw = [float("inf")] * n  # slowest link inside the group (its yardstick)
        self.max_rtt = [0.0] * n

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int, bw: float, rtt: float) -> None:
        if self.size[a] < self.size[b]:
            a, b = b, a
        self.parent[b] = a
        self.size[a] += self.size[b]
        self.min_bw[a] = min(self.min_bw[a], self.min_bw[b], bw)
        self.max_rtt[a] = max(self.max_rtt[a], self.max_rtt[b], rtt)


def _pair_links(snapshot: Any) -> list[tuple[float, str, str, float, float]]:
    """Known links as unordered pairs, the worse direction counting: (-score, a, b, bw, rtt)."""
    ids = {p.id for p in snapshot.peers}
    pairs: dict[tuple[str, str], tuple[float, float]] = {}
    for a, b, link in snapshot.network.known():
        if a == b or a not in ids or b not in ids:
            continue
        key = (a, b) if a < b else (b, a)
        got = pairs.get(key)
        if got is None:
            pairs[key] = (link.bandwidth, link.rtt_s)
        else:
            pairs[key] = (min(got[0], link.bandwidth), max(got[1], link.rtt_s))
    out = []
    for (a, b), (bw, rtt) in pairs.items():
        score = REF_BYTES / (rtt + REF_BYTES / bw)  # effective bytes/s for an activation-sized message
        out.append((-score, a, b, bw, rtt))
    out.sort()
    return out


def compute_classes(peers: Iterable[Any], ratio: float = 1.5) -> tuple[tuple[str, ...], ...]:
    """Speed classes: fastest first; a class holds peers within ``ratio`` of its fastest."""
    ordered = sorted(peers, key=lambda p: (-p.flops, p.id))
    classes: list[list[str]] = []
    top = 0.0
    for p in ordered:
        if not classes or p.flops * ratio < top:
            classes.append([])
            top = p.flops
        classes[-1].append(p.id)
    return tuple(tuple(c) for c in classes)


def group(snapshot: Any, options: Optional[GroupingOptions] = None) -> Grouping:
    """The two-level grouping of ``snapshot`` (a ``spantrain_p2p.plan.types.Snapshot``)."""
    o = options or GroupingOptions()
    peers = sorted(snapshot.peers, key=lambda p: p.id)
    index = {p.id: i for i, p in enumerate(peers)}
    dsu = _DSU(len(peers))
    seen = [False] * len(peers)  # a peer's first (best) link is its yardstick while it is alone
    for _neg, a, b, bw, rtt in _pair_links(snapshot):
        ia, ib = index[a], index[b]
        ra, rb = dsu.find(ia), dsu.find(ib)
        first_a, first_b = not seen[ia], not seen[ib]
        seen[ia] = seen[ib] = True
        if ra == rb:
            continue
        ok = True
        for r, first in ((ra, first_a), (rb, first_b)):
            if dsu.size[r] == 1:
                if first:
                    continue  # this is the lone peer's best link: its own yardstick
                # a lone peer already refused its better links: refuse worse ones too
                ok = False
                break
            ref_bw, ref_rtt = dsu.min_bw[r], dsu.max_rtt[r]
            if bw * o.bandwidth_factor < ref_bw or rtt > max(ref_rtt * o.rtt_factor, ref_rtt + o.rtt_slack_s):
                ok = False
                break
        if ok:
            dsu.union(ra, rb, bw, rtt)
    members: dict[int, list[Any]] = {}
    for i, p in enumerate(peers):
        members.setdefault(dsu.find(i), []).append(p)
    groups = []
    for ps in members.values():
        groups.append(NetworkGroup(tuple(sorted(p.id for p in ps)), compute_classes(ps, o.class_ratio)))
    groups.sort(key=lambda g: g.peers[0])
    return Grouping(tuple(groups))


def grouping_from_dict(d: Mapping[str, Any]) -> Grouping:
    """Inverse of ``Grouping.canonical`` (for a grouping read back from the DHT); checked."""
    if not isinstance(d, Mapping) or d.get("v") != 1 or not isinstance(d.get("groups"), list):
        raise ValueError("grouping must be {'v': 1, 'groups': [...]}")
    groups, seen = [], set()
    for g in d["groups"]:
        if not isinstance(g, list) or not g:
            raise ValueError("each group must be a non-empty list of classes")
        classes = []
        for c in g:
            if not isinstance(c, list) or not c or not all(isinstance(x, str) and x for x in c):
                raise ValueError("each class must be a non-empty list of peer ids")
            if seen & set(c):
                raise ValueError("a peer appears in two places of the grouping")
            seen |= set(c)
            classes.append(tuple(c))
        groups.append(NetworkGroup(tuple(sorted(x for c in classes for x in c)), tuple(classes)))
    return Grouping(tuple(groups))
