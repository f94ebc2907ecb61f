"""How a peer keeps its view of the members (issue 33): who reads the member keys (``keys.members_keys``)
how often, and from how many of each key's DHT nodes; and how what it reads or hears enters the
view (``take``, ``update``).

A read returns every member's record, so in a large swarm the reads are most of the control
plane's cost (``membership.read_interval``). The planner and its standby read every poll, any other
peer seldom, both from ``membership.WATCH_HOLDERS`` / ``SELDOM_HOLDERS`` of each key's nodes at
random, and at once when a new stage map needs it (``for_map``). A read of fewer nodes that lost
members the view had is read again from all of them (``read``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable

from ..swarm import membership

log = logging.getLogger("spantrain.peer")

LOST_SHARE = 0.1  # a read of some nodes that lost more than this share of the live members is redone from all


def watching(peer) -> bool:
    """Whether ``peer`` reads the whole member key every poll: while someone waits for members, where
    a check says so (the trainer's, with a job: the planner, its standby, a peer without a stage map
    yet; None: no opinion), else (no job) where it is among ``membership.watchers``."""
    if peer._waiting:
        return True
    said = [check() for check in peer.watch_checks]
    if any(said):
        return True
    if any(s is not None for s in said):
        return False
    return peer.peer_id in membership.watchers([p for p, r in peer._view.items() if r.alive])


def take(peer, got: dict) -> None:
    """Records (peer id -> ``PeerRecord``) into ``peer``'s view where newer than its own (of a
    member's next life: changed later)."""
    view = dict(peer._view)
    view.update({p: r for p, r in got.items() if p != peer.peer_id and (
        p not in view or (view[p].seq <= r.seq if view[p].instance == r.instance else view[p].ts < r.ts))})
    update(peer, view, whole=False)


def update(peer, view: dict, whole: bool = True) -> None:
    """``peer``'s view from now on (``whole``: read from every member key, ``status``'s age of the view)."""
    if whole:
        peer._read_at = time.monotonic()
    if peer.swim is not None:
        view = peer.swim.filter(view)
    if peer.identity is not None and peer.state != "left":
        own = peer._view.get(peer.peer_id)
        if own is not None and (peer.peer_id not in view or view[peer.peer_id].seq < own.seq):
            view[peer.peer_id] = own  # our own latest record, even if the DHT lags behind
    for pid, rec in view.items():
        if rec.alive and rec.data_url:
            peer._last_url[pid] = rec.data_url
    joined, left = membership.diff_members(peer._view, view)
    for p in (p for p in joined if p != peer.peer_id):
        log.info("peer %s joined", membership.describe(view.get(p), p))
    for p in left:
        log.info("peer %s left", membership.describe(peer._view.get(p), p))
    note_views(peer, joined, [peer._view.get(p) for p in left])
    peer._view = view
    if joined or left:
        peer._view_changed.set()


def note_views(peer, joined, left_records) -> None:
    """Members joined the view and others left it (``left_records``: their last records): a peer of
    the stage map that left done with the job is kept in ``peer.gone_done`` until it joins again
    (bounded by the map), so that its departure breaks no epoch: the planner saw it done or not by
    the luck of its poll (``Coordinator._epoch_broken``)."""
    mine = peer.plan_peers or frozenset()
    gone = {p for p in peer.gone_done if p in mine and p not in joined}
    peer.gone_done = gone | {r.peer_id for r in left_records
                             if r is not None and r.state == "done" and r.peer_id in mine}


def lost(before: dict, after: dict, me: str, keep: frozenset) -> bool:
    """Whether a read's view ``after`` lost too much of ``before`` to be taken from some of the key's
    nodes alone: a peer of ``keep`` (the stage map's), or more than ``LOST_SHARE`` of the live
    members (more than 2). A node that missed stores (one that joined nearer to the key than the
    writers know yet) must not make live members vanish; a few dead ones are the swarm's churn."""
    gone = [p for p, r in before.items() if r.alive and p != me and p not in after]
    return any(p in keep for p in gone) or len(gone) > max(2, LOST_SHARE * len(before))


async def read(peer, holders: int) -> None:
    """One read of the member key from ``holders`` of its nodes into the view, read again from all
    of them (``Peer.members``) where it ``lost`` members."""
    view = await membership.read_members(peer.dht, peer.config.swarm, peer._on_bad, holders=holders)
    if lost(peer._view, view, peer.peer_id, peer.plan_peers or frozenset()):
        await peer.members()
    else:
        peer._update_view(view)


async def keep(peer) -> None:
    """The peer's task: a read every poll where it watches, else every ``read_interval``."""
    while True:
        await asyncio.sleep(peer.config.poll_s)
        try:
            now = watching(peer)
            if peer.swim is not None and not peer._waiting:
                # with SWIM, joins, deaths and new records come as news, the records read then; a
                # peer that begins to watch (the planner, its standby) reads every record once first
                if now and not peer.swim.full_view:
                    await peer.members()
                    peer.swim.full_view = True
                elif not now:
                    peer.swim.full_view = False
                continue
            every = membership.read_interval(len(peer._view), peer.config.poll_s, now, peer.config.view_records_per_poll)
            if time.monotonic() - peer._read_at >= every:
                await read(peer, membership.WATCH_HOLDERS if now else membership.SELDOM_HOLDERS)
        except Exception as e:
            log.warning("reading members failed: %s", e)


async def for_map(peer, peer_ids: Iterable[str]) -> None:
    """A new stage map names ``peer_ids``. With SWIM, the records of those this peer has none of are
    read (their keys only). Else: where one of them has no live address here (a peer that
    reads seldom has not seen it yet, or saw an earlier run's tombstone), the members are read now,
    from all of the key's nodes; else in the background (the view may still list a peer that died
    since, and a recovery asks every member). At most once a poll: the rest of a poll since the
    last read is waited out, so a stream of maps, or one naming made-up peers, costs no more reads
    than a watcher makes."""
    async def fresh() -> None:
        await asyncio.sleep(max(0.0, peer._read_at + peer.config.poll_s - time.monotonic()))
        await peer.members()

    missing = [p for p in peer_ids if p != peer.peer_id and peer.data_url_of(p) is None]
    if peer.swim is not None:
        # SWIM tells deaths and joins: only the records of the map's peers this one lacks, their
        # keys alone (every peer read every member key from all their nodes at each new map: 7 MB
        # a peer at 1,000 peers, issue 33)
        if missing:
            await peer.read_records(missing)
        return
    if missing:
        await fresh()
    elif time.monotonic() - peer._read_at >= peer.config.poll_s:
        peer.spawn(fresh(), "map-members")
