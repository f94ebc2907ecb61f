"""Which of several keys' DHT nodes one read asks, and for what: a read of many keys at once.

The member records are split over ``keys.MEMBER_BUCKETS`` keys (issue 33: no value grows with the
whole swarm, and the heartbeats land on many nodes, not five). A read of all of them asks, for
each key, ``ask`` of its nodes at random; where one node holds several of the keys (a small swarm:
every node holds every key), it is asked once, for all of them together: a node already picked is
preferred for the next key. (A greedy cover, always the node that holds the most keys still to
read, made fewer calls but sent every reader to the nodes that hold several keys, and those take
the most heartbeats already: the busiest node 10.4x the mean at 48 peers, simulated, against 3.4x.)
Pure logic, shared by the guard (``GuardedDHT.get_many``) and the simulator (``sim.control_plane``).
"""
from __future__ import annotations

import random
from typing import Hashable, Mapping, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)
P = TypeVar("P", bound=Hashable)

__all__ = ["pick"]


def pick(held: Mapping[K, Sequence[P]], ask: int, rng: random.Random, whole_below: int = 0) -> dict[P, list[K]]:
    """Per node, the keys to ask it for: each key of ``held`` (key -> its nodes) from ``ask`` of its
    nodes (all where it has fewer, or fewer than ``whole_below``: a swarm that small is asked whole,
    as hivemind's search would visit it), chosen at random but preferring nodes already asked for an
    earlier key, so that a read of many keys makes as few calls as their nodes allow."""
    calls: dict[P, list[K]] = {}
    order = list(held)
    rng.shuffle(order)
    for key in order:
        nodes = list(dict.fromkeys(held[key]))
        rng.shuffle(nodes)
        nodes.sort(key=lambda p: p not in calls)  # stable: the asked ones first, each group shuffled
        for p in nodes[:len(nodes) if len(nodes) < whole_below else max(1, ask)]:
            calls.setdefault(p, []).append(key)
    return calls
