"""The group key of a closed swarm with an allow-list, handed to each listed member and nobody else.

The swarm key keeps out whoever lacks it, and the allow-list refuses the signatures and the
connections of ids not on it; but the swarm key alone would still let a key holder who is off the
list *read* the swarm's records. So such a swarm seals its values with a random group key
(``sealing.GroupKey``) that travels only wrapped under a listed member's own RSA key:

- the swarm's first peer (one that joins nobody) makes the group key, and wraps it for itself;
- a joining peer stores a request under ``keyreq`` (subkey: its peer id): a signed payload, so it
  carries the public key its peer id is the hash of;
- every member that holds the group key answers each request signed by a listed peer (the guard
  drops the others' unread) with the key wrapped for the requester's RSA key with RSA-OAEP-SHA256,
  signed by the member, under ``groupkey`` (subkey: the requester's id);
- the requester opens the wrap with its private key, checks the key id the member signed, and
  from then on reads and writes everything else sealed with the group key.

The exchange's records are sealed with the swarm key (an outsider without it reads not even
who asks), and nothing here is home-made: RSA-OAEP from ``cryptography``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.utils import get_dht_time

from .identity import Identity
from .keys import groupkey_key, keyreq_key, wrap_subkey
from .membership import BadRecordLog, read_members
from .records import BadRecord, open_payload, sign_payload
from .sealing import KEY_BYTES, KEY_ID_BYTES, GroupKey

log = logging.getLogger(__name__)

_OAEP = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=b"spantrain group key v1")
REQUEST_TTL_S = 60.0
WRAP_TTL_S = 3600.0
MAX_WRAPPED_BYTES = 1024  # an RSA-8192 ciphertext; 2048-bit keys give 256
# what a joiner's reads refuse when no group key can ever come: a wrong swarm key, an open swarm,
# a swarm without an allow-list (``guard.GuardedDHT.refused``)
FATAL_REFUSALS = ("other-key", "unsealed", "swarm-sealed")


class GroupKeyTimeout(Exception):
    """No member handed this peer the group key in time."""


def request_payload(identity: Identity) -> dict:
    """The signed value of a request for the group key."""
    return sign_payload({"want": "group-key", "peer_id": identity.peer_id}, identity)


def open_request(subkey: Any, value: Any) -> tuple[str, rsa.RSAPublicKey]:
    """(peer id, its RSA public key) of an untrusted request; BadRecord saying why not."""
    signer, d = open_payload(value)
    if d.get("want") != "group-key" or d.get("peer_id") != signer or subkey != signer:
        raise BadRecord(f"group-key request under {str(subkey)[:16]!r} is not its signer's ({signer})")
    key = serialization.load_der_public_key(value["key"])  # open_payload has verified the signature with it
    if not isinstance(key, rsa.RSAPublicKey):
        raise BadRecord("a group-key request must carry an RSA key")
    return signer, key


def wrap_payload(identity: Identity, group: GroupKey, recipient: str, public_key: rsa.RSAPublicKey) -> dict:
    """The signed value that hands ``group`` to ``recipient`` (``public_key`` is its key)."""
    return sign_payload({"for": recipient, "gid": group.key_id, "wrapped": public_key.encrypt(group.secret, _OAEP)},
                        identity)


def open_wrap(subkey: Any, value: Any, identity: Identity, swarm_key_id: bytes) -> tuple[str, GroupKey]:
    """(the member who wrapped it, the group key) of an untrusted wrap for ``identity`` in the swarm
    of ``swarm_key_id``; BadRecord saying why not (one for another peer included: it cannot be
    opened here)."""
    signer, d = open_payload(value)
    wrapped, gid = d.get("wrapped"), d.get("gid")
    if subkey != identity.peer_id or d.get("for") != identity.peer_id:
        raise BadRecord(f"group key wrapped for {str(d.get('for'))[:16]!r}, not this peer")
    if not isinstance(wrapped, bytes) or len(wrapped) > MAX_WRAPPED_BYTES or not isinstance(gid, bytes) \
            or len(gid) != KEY_ID_BYTES:
        raise BadRecord("a group-key wrap holds wrapped bytes and an 8-byte key id")
    try:
        secret = identity.private_key.decrypt(wrapped, _OAEP)
    except ValueError:
        raise BadRecord(f"the group key wrapped by {signer} does not open with this peer's key") from None
    if len(secret) != KEY_BYTES:
        raise BadRecord(f"the group key wrapped by {signer} is {len(secret)} bytes")
    group = GroupKey(secret, swarm_key_id)
    if group.key_id != gid:
        raise BadRecord(f"the group key wrapped by {signer} does not have the id it signed")
    return signer, group


async def found_wrap(dht, swarm: str, identity: Identity) -> Optional[GroupKey]:
    """The group key wrapped for this peer, if a member has stored it (``dht``: a ``GuardedDHT``
    of a grouped swarm)."""
    found = await dht.get(groupkey_key(swarm), latest=True)
    mine = [(sub, item) for sub, item in (found.value.items() if found is not None and isinstance(found.value, dict)
                                          else ()) if isinstance(sub, str) and sub.startswith(identity.peer_id + "/")]
    for sub, item in mine:
        try:
            signer, group = open_wrap(identity.peer_id, item.value, identity, dht.key.key_id)
            if sub != wrap_subkey(identity.peer_id, signer):
                raise BadRecord(f"a wrap filed under {sub[:40]} is signed by {signer}")
        except BadRecord as e:
            log.warning("ignoring a group-key wrap: %s", e)
            continue
        log.info("got the swarm's group key (id %s) from %s", group.key_id.hex(), signer)
        return group
    return None


async def request(dht, swarm: str, identity: Identity, timeout_s: float, poll_s: float,
                  on_bad: BadRecordLog) -> GroupKey:
    """Asks the members for the group key and waits for it; GroupKeyTimeout after ``timeout_s``.
    After each poll it reads the swarm's member records (bad ones go to ``on_bad``): where their
    refusals say no key can come (a wrong swarm key, say), it ends at once with the reason."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    asked_at = -1e9
    while True:
        if loop.time() - asked_at > REQUEST_TTL_S / 3:  # a request outlives a slow first answer
            await dht.store(keyreq_key(swarm), request_payload(identity), get_dht_time() + REQUEST_TTL_S,
                            subkey=identity.peer_id)
            asked_at = loop.time()
        group = await found_wrap(dht, swarm, identity)
        if group is not None:
            return group
        await read_members(dht, swarm, on_bad)
        if any(dht.refused[k] for k in FATAL_REFUSALS):
            raise GroupKeyTimeout(dht.why_locked_out(swarm))
        if loop.time() >= deadline:
            raise GroupKeyTimeout(f"swarm {swarm!r}: no member handed this peer ({identity.peer_id}) the swarm's group key within "
                                  f"{timeout_s:.0f}s: it is not on the members' allow-list (or no member is up)")
        await asyncio.sleep(poll_s)


async def hand_out(dht, swarm: str, identity: Identity, group: GroupKey, answered: dict[str, float]) -> int:
    """Answers every request of a listed peer (the guard has dropped the others) not answered yet
    (``answered``: peer id -> the request's expiry already answered); returns how many were."""
    found = await dht.get(keyreq_key(swarm), latest=True)
    if found is None or not isinstance(found.value, dict):
        return 0
    n = 0
    for subkey, item in found.value.items():
        expiration = getattr(item, "expiration_time", 0.0)
        if answered.get(subkey) == expiration or expiration < get_dht_time():
            continue
        try:
            peer_id, public_key = open_request(subkey, item.value)
        except (BadRecord, ValueError) as e:
            log.debug("ignoring a group-key request: %s", e)
            continue
        ok = await dht.store(groupkey_key(swarm), wrap_payload(identity, group, peer_id, public_key),
                             get_dht_time() + WRAP_TTL_S, subkey=wrap_subkey(peer_id, identity.peer_id))
        if ok:
            answered[subkey] = expiration
            n += 1
            log.info("handed the group key to %s", peer_id)
    if len(answered) > 4096:  # requests of peers long gone
        answered.clear()
    return n


async def keep_handing_out(dht, swarm: str, identity: Identity, group: GroupKey, interval_s: float) -> None:
    """A member's loop: answers new requests every ``interval_s``."""
    answered: dict[str, float] = {}
    while True:
        try:
            await hand_out(dht, swarm, identity, group, answered)
        except Exception as e:
            log.warning("handing out the group key failed: %s", e)
        await asyncio.sleep(interval_s)
