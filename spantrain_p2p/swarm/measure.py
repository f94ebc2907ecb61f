"""Measurements in the DHT: each peer's device profile, its probes of the links to others, its
pings and its vote on the grouping.

One key per kind (``PROFILES``, ``LINKS``, ``PINGS``, ``GROUPS``: ``keys.measure_key``), one signed
entry per peer (subkey = its peer id), so every peer can read the same snapshot and nobody can
publish in another's name. ``read`` validates each entry and skips (and logs once) the bad ones.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from .keys import GROUPS, LINKS, PINGS, PROFILES, measure_key
from .records import BadRecord, open_payload, sign_payload

log = logging.getLogger("spantrain.measure")

__all__ = ["GROUPS", "LINKS", "MAX_BYTES", "PINGS", "PROFILES", "TTL_S", "publish", "read"]

MAX_BYTES = 256 << 10
TTL_S = 3600.0


async def publish(peer, what: str, payload: dict, ttl_s: float = TTL_S) -> None:
    from hivemind.utils import get_dht_time

    value = sign_payload(payload, peer.identity, MAX_BYTES)
    await peer.dht.store(measure_key(peer.config.swarm, what), value, get_dht_time() + ttl_s, subkey=peer.peer_id)


async def read(peer, what: str, parse: Callable[[dict], Any], on_bad: Callable[[object, str], None]) -> dict[str, Any]:
    """{peer id: parse(payload)} of the valid entries signed by the peer they are filed under."""
    found = await peer.dht.get(measure_key(peer.config.swarm, what), latest=True)
    out: dict[str, Any] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for sub, item in found.value.items():
        try:
            signer, payload = open_payload(getattr(item, "value", None), MAX_BYTES)
            if signer != sub:
                raise BadRecord(f"{what} entry filed under {str(sub)[:16]} but signed by {signer[:16]}")
            out[signer] = parse(payload)
        except (BadRecord, ValueError, TypeError, KeyError) as e:
            on_bad(sub, f"{what}: {e}")
    return out
