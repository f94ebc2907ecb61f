"""A peer's way into a swarm, before it announces itself: its identity (a stable one must not be
in use by a live peer), a closed swarm's group key, and whether the members admit it at all.
Functions of a starting ``Peer`` (``node.Peer.start``)."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile

from ..net.handshake import HandshakeError
from ..swarm import group_key, membership
from ..swarm.identity import Identity
from ..swarm.records import PeerRecord
from ..swarm.sealing import GroupKey
from .config import PeerError

log = logging.getLogger("spantrain.peer")


def prepare_identity(peer) -> tuple[str, bool]:
    """(key path for p2pd, whether to check it is not in use already)."""
    path = peer.config.identity_path
    if path:
        try:
            peer.identity, created = Identity.load_or_create(path)
        except (OSError, ValueError) as e:
            raise PeerError(f"--identity {path}: {e}") from None
        return path, not created
    peer._tmpdir = tempfile.mkdtemp(prefix="spantrain-id-")
    path = os.path.join(peer._tmpdir, "identity.key")
    peer.identity = Identity.generate()
    peer.identity.save(path)
    return path, False


def forget_key_file(peer) -> None:
    """The p2p daemon read the ephemeral identity's key at its start: the file goes now, not when the
    peer leaves, so that a peer killed later leaves no private key behind (a SIGKILL runs no clean-up:
    3,798 such folders had piled up in this box's /tmp, 2026-12-02). The key stays in memory."""
    if peer._tmpdir is not None:
        shutil.rmtree(peer._tmpdir, ignore_errors=True)
        peer._tmpdir = None


async def refuse_duplicate(peer) -> None:
    """PeerError if another live process already runs with our identity (a stale record is fine)."""
    view = await membership.read_members(peer._dht, peer.config.swarm, peer._on_bad, peer_ids=[peer.peer_id])
    other = view.get(peer.peer_id)
    if other is None or not other.alive or other.instance == peer.instance or not other.data_url:
        return
    try:
        st = await peer.client.status(other.data_url, timeout=3.0)
    except Exception:
        log.info("replacing the record of an earlier run of this identity (it does not answer)")
        return
    if st.get("peer_id") == peer.peer_id:
        raise PeerError(
            f"identity {peer.config.identity_path} (peer id {peer.peer_id}) is already used by a live peer of "
            f"this swarm at {other.data_url}; stop that peer or use another --identity"
        )


async def take_group_key(peer, joining: bool) -> None:
    """A closed swarm with an allow-list: the first peer makes the group key, a joiner waits to be
    handed it (PeerError at once for a wrong swarm key, or after ``group_key_timeout_s`` when no
    member hands it over: not on their list); then this peer hands it to listed joiners."""
    cfg, dht = peer.config, peer._dht
    if not joining:
        dht.group = GroupKey.generate(peer.swarm_key.key_id)
        log.info("made the group key (id %s) of swarm %r", dht.group.key_id.hex(), cfg.swarm)
    else:
        try:
            dht.group = await group_key.request(dht, cfg.swarm, peer.identity, cfg.group_key_timeout_s,
                                                min(cfg.poll_s, 1.0), peer._on_bad)
        except group_key.GroupKeyTimeout as e:
            raise PeerError(str(e)) from None
    peer.client.auth.operator_token = dht.group.operator_token
    peer.spawn(group_key.keep_handing_out(dht, cfg.swarm, peer.identity, dht.group, min(cfg.poll_s, 1.0)),
               "group-key")


async def check_admission(peer) -> dict[str, PeerRecord]:
    """PeerError, at once, when this peer cannot take part in the swarm it joins: the swarm's
    records are sealed with a key it lacks (or not sealed while it has one), or its members
    refuse its connections (not on their allow-list). Returns the members it read."""
    view = await (membership.read_members(peer._dht, peer.config.swarm, peer._on_bad) if peer.swim is None
                  else membership.read_some(peer._dht, peer.config.swarm, peer._on_bad, 3))
    live = [r for r in view.values() if r.alive and r.peer_id != peer.peer_id and r.data_url]
    if not live:
        reason = peer._dht.why_locked_out(peer.config.swarm)
        if reason:
            raise PeerError(reason)
        return view
    refusals = []
    for rec in live[:3]:
        try:
            await peer.client.hello(rec.data_url, rec.peer_id)
            return view
        except HandshakeError as e:
            refusals.append(f"{membership.describe(rec, rec.peer_id)}: {e}")
        except (OSError, asyncio.TimeoutError):
            continue  # that member is gone; another may answer, or the heartbeat will tell
    if refusals:
        raise PeerError(f"swarm {peer.config.swarm!r} refused this peer ({peer.peer_id}): " + "; ".join(refusals))
    return view
