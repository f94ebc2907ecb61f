"""Membership in the DHT: announcing our signed record on a heartbeat, reading everybody's.

All records live under one DHT key per swarm, one subkey per peer id. A record expires after a
few heartbeats, so a crashed peer falls out by itself; a peer that leaves writes a tombstone
(state ``left``) whose expiry is later than its last heartbeat's, so it replaces it at once.
"""
from __future__ import annotations

import logging
from typing import Optional

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from .keys import members_key
from .records import BadRecord, PeerRecord, open_record

log = logging.getLogger(__name__)

__all__ = ["BadRecordLog", "announce", "describe", "diff_members", "members_key", "parse_members", "read_members"]


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


async def read_members(node: DHTNode, swarm: str, on_bad: BadRecordLog, latest: bool = True) -> dict[str, PeerRecord]:
    found = await node.get(members_key(swarm), latest=latest)
    if found is None:
        return {}
    return parse_members(found.value, get_dht_time(), on_bad)


async def announce(node: DHTNode, swarm: str, sealed: dict, peer_id: str, ttl: float) -> bool:
    return bool(await node.store(members_key(swarm), sealed, get_dht_time() + ttl, subkey=peer_id))


def diff_members(old: dict[str, PeerRecord], new: dict[str, PeerRecord]) -> tuple[list[str], list[str]]:
    """(joined, left) peer ids between two views (tombstoned peers count as gone)."""
    alive_old = {p for p, r in old.items() if r.alive}
    alive_new = {p for p, r in new.items() if r.alive}
    return sorted(alive_new - alive_old), sorted(alive_old - alive_new)


def describe(rec: Optional[PeerRecord], peer_id: str) -> str:
    if rec is not None and rec.name:
        return f"{rec.name} ({peer_id[:12]}…)"
    return f"{peer_id[:12]}…"
