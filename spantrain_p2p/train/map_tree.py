"""Who hands a new stage map to whom (issue 33): a tree over the map's peers, pure functions.

The planner used to tell every live peer of a new map, and every peer then read the map's DHT key:
at 1,000 peers a map is about 75 KB, and the key's few nodes answered some 75 MB per epoch. Now the
signed map itself goes down a tree: the planner (the signer, the root) sends it to ``FANOUT`` peers,
each of those to ``FANOUT`` more, and so on, every peer of the map once, a peer sending at most
``FANOUT`` copies. The tree is the map's peers in an order drawn from the map's (term, epoch), the
root left out: the same on every peer that holds the map, so nobody sends the order along, and
another tree each epoch (a slow peer is an inner node of few of them). Node ``i`` of the order is
the root's child for ``i < FANOUT``, else the child of node ``i // FANOUT - 1``.
A copy that cannot be delivered is handed to the lost child's children by its sender
(``children`` again); a peer the tree misses still hears the map's head on SWIM's messages and reads
the key, as before."""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

FANOUT = 8  # copies of a map one peer sends at most (8 x 75 KB at 1,000 peers; depth 4 at 4,096)


def order(peers: Iterable[str], root: str, term: int, epoch: int) -> list[str]:
    """The map's peers less ``root``, in the tree's order for (``term``, ``epoch``)."""
    salt = f"{term}/{epoch}/".encode()
    return sorted(set(peers) - {root}, key=lambda p: (hashlib.sha256(salt + p.encode()).digest(), p))


def children(tree: Sequence[str], me: str, root: str, fanout: int = FANOUT) -> list[str]:
    """Whom ``me`` hands the map to: the ``root`` the first ``fanout`` of ``tree``, node ``i`` the
    ``fanout`` after ``fanout * (i + 1)``, a peer outside the tree nobody."""
    if me == root:
        i = -1
    else:
        try:
            i = tree.index(me)
        except ValueError:
            return []
    return list(tree[fanout * (i + 1): fanout * (i + 2)])


def depth(n: int, fanout: int = FANOUT) -> int:
    """Hops from the root to the deepest of ``n`` nodes."""
    hops, reach, level = 0, 0, 1
    while reach < n:
        level *= fanout
        reach += level
        hops += 1
    return hops
