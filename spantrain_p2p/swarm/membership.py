"""Membership in the DHT: announcing our signed record on a heartbeat, reading everybody's.

All records live under the swarm's member keys (``keys.members_keys``: one per bucket of peer
ids), one subkey per peer id. A record expires after a
few heartbeats, so a crashed peer falls out by itself; a peer that leaves writes a tombstone
(state ``left``) whose expiry is later than its last heartbeat's, so it replaces it at once.

A read returns every member's record, so how often each peer reads is the control plane's largest
cost in a large swarm (``read_interval``).
"""
from __future__ import annotations

import logging
import random
from typing import Optional

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from .keys import member_key_of, members_key, members_keys
from .records import BadRecord, PeerRecord, open_record

log = logging.getLogger(__name__)

__all__ = ["BadRecordLog", "announce", "describe", "diff_members", "member_key_of", "members_key", "members_keys",
           "parse_members", "read_interval", "read_members", "read_some", "watchers"]

WATCHERS = 2  # with no planner, the first members by peer id stand in for it and its standby
# of each member key's 5 nodes, a read asks this many, picked at random (an entry the node asked
# lacks is kept from earlier reads until it expires, and a read that lost members is read again
# from all, ``member_view.lost``). A watcher asked 2 while one key held every record; with the
# records in 8 keys that was 16 calls a second at 48 peers, and the watchers the busiest peers.
WATCH_HOLDERS, SELDOM_HOLDERS = 1, 1
RECORDS_PER_POLL = 8.0  # a member that does not watch reads about this many records a poll, on average
MAX_POLLS = 60  # and reads the whole key at least every this many polls


def read_interval(members: int, poll_s: float, watching: bool, per_poll: float = RECORDS_PER_POLL) -> float:
    """Seconds between two reads of the whole member key by one peer of a swarm of ``members``.

    A read returns every member's record (about 1.5 KB each), from the key's few DHT nodes: a swarm
    where every peer reads every poll costs each peer N records a poll and those nodes N reads a
    poll. The peers that act on every join and death read every poll (``watching``: the planner and
    its standby, a peer waiting for members or for its first stage map); any other spaces its reads
    to about ``per_poll`` records a poll: with the defaults (a poll a second) a swarm of 8 or fewer
    is read every second, 32 every 4 s, 480 or more every minute. What such a peer needs sooner it
    asks for at once (``Peer.read_for_map``: a stage map's peer it has not seen), and a dead neighbour shows
    on the data plane before any record expires."""
    if watching:
        return poll_s
    return poll_s * max(1.0, min(float(MAX_POLLS), members / per_poll))


def watchers(live: list[str], k: int = WATCHERS) -> list[str]:
    """The ``k`` live members that read every poll when no planner says otherwise: the first by
    peer id (the election's rank order, so its first leader and standby where they are ready)."""
    return sorted(live)[:k]


class BadRecordLog:
    """Logs each (subkey, reason) of a rejected DHT entry once, not on every poll, and remembers at
    most ``limit`` of them (a hostile peer can make up reasons). ``what`` names the entries in the
    line ("ignoring peer record 'Qm…': bad signature"); ``logger`` is the one that says it."""

    def __init__(self, what: str = "peer record", logger: Optional[logging.Logger] = None, limit: int = 1024):
        self.what = what
        self._log = logger or log
        self._seen: set[tuple[str, str]] = set()
        self._limit = limit

    def __call__(self, subkey: object, reason: str) -> None:
        k = (repr(subkey)[:80], reason)
        if k not in self._seen and len(self._seen) < self._limit:
            self._seen.add(k)
            self._log.warning("ignoring %s %s: %s", self.what, k[0], reason)


def parse_members(entries: object, now: float, on_bad: BadRecordLog) -> dict[str, PeerRecord]:
    """Valid, unexpired records by peer id from the raw DHT dictionary value (tombstones included)."""
    out: dict[str, PeerRecord] = {}
    if not isinstance(entries, dict):
        if entries is not None:
            on_bad("<members>", "members value is not a dictionary")
        return out
    for subkey, item in entries.items():
        value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", 0.0)
        if expiration < now:
            continue
        try:
            rec = open_record(subkey, value)
        except BadRecord as e:
            on_bad(subkey, str(e))
            continue
        out[rec.peer_id] = rec
    return out


async def read_members(node, swarm: str, on_bad: BadRecordLog, latest: bool = True,
                       holders: Optional[int] = None, peer_ids=None) -> dict[str, PeerRecord]:
    """Every member's record, from every member key at once, through ``node``, a ``GuardedDHT``;
    ``holders``: ask only that many of each key's nodes (``GuardedDHT.get_many``); ``peer_ids``:
    read only the keys these peers' records are under (every record found there is returned). A
    record found under a key its peer id does not hash to is refused (the nodes refuse to store it
    there, ``validator``)."""
    keys = members_keys(swarm) if peer_ids is None else sorted({member_key_of(swarm, p) for p in peer_ids})
    return await _read_keys(node, swarm, keys, on_bad, latest, holders)


async def _read_keys(node, swarm: str, keys: list[str], on_bad: BadRecordLog, latest: bool,
                     holders: Optional[int]) -> dict[str, PeerRecord]:
    found = await node.get_many(keys, latest=latest, **({"holders": holders} if holders else {}))
    now, out = get_dht_time(), {}
    for key in keys:
        item = found.get(key)
        if item is None:
            continue
        for peer_id, rec in parse_members(item.value, now, on_bad).items():
            if member_key_of(swarm, peer_id) != key:
                on_bad(peer_id, f"stored under {key}, not its own member key")
                continue
            out[peer_id] = rec
    return out


async def read_some(node, swarm: str, on_bad: BadRecordLog, want: int) -> dict[str, PeerRecord]:
    """Records of at least ``want`` live members where the swarm has them: member keys read one at a
    time in a random order (a joiner that learns the members another way: one key of a large swarm,
    every key of a small one)."""
    out: dict[str, PeerRecord] = {}
    keys = members_keys(swarm)
    random.shuffle(keys)
    for key in keys:
        out.update(await _read_keys(node, swarm, [key], on_bad, True, 1))
        if sum(r.alive for r in out.values()) >= want:
            break
    return out


async def announce(node: DHTNode, swarm: str, sealed: dict, peer_id: str, ttl: float) -> bool:
    return bool(await node.store(member_key_of(swarm, peer_id), sealed, get_dht_time() + ttl, subkey=peer_id))


def diff_members(old: dict[str, PeerRecord], new: dict[str, PeerRecord]) -> tuple[list[str], list[str]]:
    """(joined, left) peer ids between two views (tombstoned peers count as gone)."""
    alive_old = {p for p, r in old.items() if r.alive}
    alive_new = {p for p, r in new.items() if r.alive}
    return sorted(alive_new - alive_old), sorted(alive_old - alive_new)


def describe(rec: Optional[PeerRecord], peer_id: str) -> str:
    if rec is not None and rec.name:
        return f"{rec.name} ({peer_id[:12]}…)"
    return f"{peer_id[:12]}…"
