"""Measurements in the DHT: each peer's device profile, its probes of the links to others, its
pings and its vote on the grouping.

One signed entry per peer and kind (``PROFILES``, ``LINKS``, ``PINGS``, ``GROUPS``, ``ACCUSE``;
subkey = its peer id), under the key of its id's bucket (``keys.measure_key_of``: 32 keys for the
links, 16 for the profiles, 8 for the rest, so that no value holds the whole swarm's), so every
peer can read the same snapshot and nobody can publish in another's name. ``read`` takes every bucket, or only those of the peers it is asked
about; it validates each entry and skips (and logs once) the bad ones.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable, Optional

from .keys import GROUPS, LINKS, PINGS, PROFILES, measure_key_of, measure_keys
from .records import BadRecord, open_payload, sign_payload

log = logging.getLogger("spantrain.measure")

__all__ = ["GROUPS", "KEPT", "LINKS", "MAX_BYTES", "PINGS", "PROFILES", "TTL_S", "VERSIONED", "keep", "publish", "read",
           "version_field", "version_of", "versions_changed"]

MAX_BYTES = 256 << 10
READ_HOLDERS = 2
TTL_S = 3600.0
# kinds a peer keeps in the DHT for as long as it runs (``keep``): what a planner plans from and
# votes on (pings serve the measuring phase only; an accusation lasts its TTL on purpose)
KEPT = (PROFILES, LINKS, GROUPS)


# kinds whose entries carry the publisher's measurement version ``mv`` (one counter for both), which
# its member record carries too (``progress[version_field(kind)]``, ``Peer.note_measured``): a reader
# holding an entry of that version reads that kind of that peer no more (``Coordinator._measured_snapshot``)
VERSIONED = (PROFILES, LINKS)


def version_field(what: str) -> str:
    """The member record's progress field with the version of a peer's latest entry of ``what``."""
    return f"mv.{what}"


def versions_changed(before, after) -> list[str]:
    """The ``VERSIONED`` kinds whose version a peer's record ``after`` says anew against ``before``
    (every kind where there is no ``before``)."""
    if before is None:
        return list(VERSIONED)
    return [w for w in VERSIONED if before.progress.get(version_field(w)) != after.progress.get(version_field(w))]


async def publish(peer, what: str, payload: dict, ttl_s: float = TTL_S, again: bool = False) -> None:
    """Signs and stores this peer's entry of ``what``; a ``VERSIONED`` one with the next measurement
    version (``again``: the latest entry of ``what`` re-published as it is), which its record then
    announces. One publish of a peer at a time: a copy re-published while a newer one was stored
    could land after it (a later expiry wins) and bring the old one back."""
    from hivemind.utils import get_dht_time

    async with _lock(peer):
        if again:
            payload = _kept(peer).get(what)
            if payload is None:
                return
        mv = None
        if what in VERSIONED and not again:
            # deciseconds of the clock, or one more: a peer restarted under the same id goes on above
            # the versions of its last life, which the readers may hold
            mv = max(getattr(peer, "measured_version", 0) + 1, int(time.time() * 10))
            peer.measured_version = mv
            payload = {**payload, "mv": mv}
        value = sign_payload(payload, peer.identity, MAX_BYTES)
        stored = await peer.dht.store(measure_key_of(peer.config.swarm, what, peer.peer_id), value,
                                      get_dht_time() + ttl_s, subkey=peer.peer_id)
        if what in KEPT and not again:
            _kept(peer)[what] = payload
    note = getattr(peer, "note_measured", None)
    if mv is not None and note is not None and stored is not False:  # (a store no node took: not announced)
        await note(what, mv, value)


def _lock(peer) -> asyncio.Lock:
    lock = getattr(peer, "measurements_lock", None)
    if lock is None:
        lock = peer.measurements_lock = asyncio.Lock()
    return lock


def version_of(payload: dict) -> int:
    """The measurement version an entry says (0: none, a peer before versions)."""
    mv = payload.get("mv", 0)
    return mv if type(mv) is int and mv >= 0 else 0


def _kept(peer) -> dict:
    kept = getattr(peer, "measurements_kept", None)
    if kept is None:
        kept = peer.measurements_kept = {}
    return kept


async def keep(peer, every_s: float = TTL_S / 4) -> None:
    """A peer's task: publishes its latest entry of each ``KEPT`` kind again every ``every_s``. A
    profile is published once and a vote when it changes: an hour into a run they had expired, and
    the planner's snapshot (and a broken epoch's re-plan) lost every peer that had not re-measured."""
    while True:
        await asyncio.sleep(every_s)
        for what in list(_kept(peer)):
            try:
                await publish(peer, what, {}, again=True)
            except Exception as e:
                log.warning("re-publishing this peer's %s failed: %s", what, e)


async def read(peer, what: str, parse: Callable[[dict], Any], on_bad: Callable[[object, str], None],
               peer_ids: Optional[Iterable[str]] = None, holders: int = READ_HOLDERS) -> dict[str, Any]:
    """{peer id: parse(payload)} of the valid entries signed by the peer they are filed under, from
    every bucket's key, or (``peer_ids``) only from the keys those peers' entries are under (other
    entries found there are returned too). An entry under another bucket's key than its peer's is
    refused (the nodes refuse to store it there: ``validator``)."""
    ids = None if peer_ids is None else list(peer_ids)
    if ids is not None and not ids:
        return {}
    keys = measure_keys(peer.config.swarm, what, ids)
    # two of each key's five nodes (all five answer with the whole value: a planner's read of every
    # profile and link at 1,000 peers is 4.7 MB a node asked); an entry one node lacks is kept from
    # earlier reads (``GuardedDHT``), and a small swarm's nodes are all asked
    found = await peer.dht.get_many(keys, latest=True, holders=holders)
    out: dict[str, Any] = {}
    for key in keys:
        item = found.get(key)
        if item is None or not isinstance(item.value, dict):
            continue
        for sub, entry in item.value.items():
            try:
                signer, payload = open_payload(getattr(entry, "value", None), MAX_BYTES)
                if signer != sub:
                    raise BadRecord(f"{what} entry filed under {str(sub)[:16]} but signed by {signer[:16]}")
                if measure_key_of(peer.config.swarm, what, signer) != key:
                    raise BadRecord(f"{what} entry of {signer[:16]} under another bucket's key")
                out[signer] = parse(payload)
            except (BadRecord, ValueError, TypeError, KeyError) as e:
                on_bad(sub, f"{what}: {e}")
    return out
