"""What a DHT node of a swarm agrees to keep: hivemind's record validator for the swarm's keys.

hivemind's DHT keeps, per (key, subkey), the value with the latest expiry, and takes anyone's
word for it. Readers already drop what they cannot verify, but that is not enough: a value stored
with an expiry a year away would make every node refuse the genuine (older-expiring) one from then
on. So every node validates at store time, and on every value another node returns to it:

- only the swarm's own keys (``keys``) are kept; the key hashes are computed once here;
- every value carries an outer signature by its storer (``sign_value``, hivemind's hook, called
  on ``store``) over the key, the subkey, the value *and the expiry*, so a value cannot be replayed
  with a later expiry, nor moved under another subkey;
- the subkey names its owner: the storer's peer id is the subkey (``OWN``: member records,
  measurements, job copies, key requests) or its last ``/`` part (``SUFFIX``: leases, stage maps,
  group-key wraps, see ``keys.owned``); nobody can store under another's subkey;
- the expiry is at most the key's TTL (plus a clock allowance) from now;
- a plain value is a signed payload of that same key (``records.sign_payload``); a value sealed
  with this node's key (the swarm key, or the group key once handed over) must open with it. A
  value sealed with another key, or plain in a closed swarm, is kept: it is refused on read by
  the guard (``guard``), which tells a joiner with the wrong key why it sees no swarm.

``strip_value`` hands the application the inner value, so readers see what they always saw. The
RSA checks of one record are remembered (a small cache): a member record is validated on every
read by every node that holds it.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from . import keys
from .identity import Identity, peer_id_from_public_der, verify
from .sealing import SealError, is_sealed

MAGIC = b"STV1"
SKEW_S = 60.0  # clocks of peers may differ this much
MAX_VALUE_BYTES = (1 << 20) + (8 << 10)  # a sealed stage map, plus the envelope
MAX_SUBKEY_CHARS = 256
OWN, SUFFIX = "own", "suffix"


@dataclass(frozen=True)
class KeyRule:
    key: Callable[..., str]  # the DHT key of a swarm (a builder of ``keys``; with ``buckets``, of a swarm and a bucket)
    ttl_s: float  # the longest life a value of this key may ask for
    owner: str  # OWN or SUFFIX
    buckets: int = 0  # a key per bucket of peer ids: a subkey only under its owner's (``keys.bucket_of``)

    def dht_keys(self, swarm: str) -> list[tuple[str, Optional[int]]]:
        """(DHT key, its bucket or None) of every key of ``swarm`` this rule covers."""
        if not self.buckets:
            return [(self.key(swarm), None)]
        return [(self.key(swarm, b), b) for b in range(self.buckets)]


def _measure(what: str) -> Callable[[str, int], str]:
    return lambda swarm, bucket: keys.measure_key(swarm, what, bucket)


RULES = (
    # a record lives a few heartbeats (--heartbeat up to 200 s), or with SWIM 3 x record_s (300 s)
    KeyRule(keys.members_key, 1200.0, OWN, keys.MEMBER_BUCKETS),
    *(KeyRule(_measure(what), 3600.0, OWN, keys.buckets_of(what)) for what in (keys.PROFILES, keys.LINKS, keys.PINGS,
                                                                                keys.GROUPS, keys.ACCUSE)),
    KeyRule(keys.lease_key, 120.0, SUFFIX),  # a lease: seconds
    KeyRule(keys.job_key, 600.0, OWN, keys.buckets_of("job")),
    KeyRule(keys.stagemap_key, 600.0, SUFFIX),
    KeyRule(keys.keyreq_key, 60.0, OWN),
    KeyRule(keys.groupkey_key, 3600.0, SUFFIX),
)


def owner_of(subkey: Any, rule: KeyRule) -> Optional[str]:
    """The peer id a subkey of ``rule``'s key belongs to (None: not a well-formed subkey)."""
    if not isinstance(subkey, str) or not 0 < len(subkey) <= MAX_SUBKEY_CHARS:
        return None
    return subkey if rule.owner == OWN else subkey.rsplit("/", 1)[-1] if "/" in subkey else None


def _signed_bytes(key: bytes, subkey: bytes, inner: bytes, expiration: float) -> bytes:
    return b"spantrain record v1" + msgpack.packb([key, subkey, inner, float(expiration)], use_bin_type=True)


class SwarmValidator(RecordValidatorBase):
    """The record validator of one swarm's DHT node. ``identity`` signs what this node stores
    (None: a reader that stores nothing). ``sealer_for(dht_key)`` gives the sealer a closed swarm's
    value must open with (None: none known yet, or an open swarm), set once the guard exists.
    ``refused`` counts refusals by reason (what tests and logs read)."""

    def __init__(self, swarm: str, identity: Optional[Identity] = None, closed: bool = False):
        self.swarm, self.identity, self.closed = swarm, identity, closed
        self.rules: dict[bytes, tuple[str, KeyRule, Optional[int]]] = {}
        for rule in RULES:
            for dht_key, bucket in rule.dht_keys(swarm):
                self.rules[DHTID.generate(source=dht_key).to_bytes()] = (dht_key, rule, bucket)
        self.sealer_for: Callable[[str], Any] = lambda dht_key: None
        self.refused: dict[str, int] = {}
        self._seen: OrderedDict[bytes, bool] = OrderedDict()

    # ---- hivemind's interface ---------------------------------------------------------------------
    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self.rules or self.identity is None:
            return record.value  # refused by every node of the swarm, this one included
        sig = self.identity.sign(_signed_bytes(record.key, record.subkey, record.value, record.expiration_time))
        return msgpack.packb([MAGIC, record.value, self.identity.public_der, sig], use_bin_type=True)

    def strip_value(self, record: DHTRecord) -> bytes:
        outer = _outer(record.value)
        return outer[1] if outer is not None else record.value

    def validate(self, record: DHTRecord) -> bool:
        reason = self.why_not(record)
        if reason is not None:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        return reason is None

    # ---- the rules --------------------------------------------------------------------------------
    def why_not(self, record: DHTRecord) -> Optional[str]:
        """None if ``record`` may be kept, else a short reason."""
        found = self.rules.get(record.key)
        if found is None:
            return "not-this-swarm"
        dht_key, rule, bucket = found
        exp = record.expiration_time
        if not isinstance(exp, (int, float)) or not math.isfinite(exp) or exp > get_dht_time() + rule.ttl_s + SKEW_S:
            return "far-expiry"
        if not isinstance(record.value, bytes) or len(record.value) > MAX_VALUE_BYTES:
            return "too-large"
        outer = _outer(record.value)
        if outer is None:
            return "unsigned"
        _, inner, der, sig = outer
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False) if record.subkey else None
        except Exception:
            return "bad-subkey"
        owner = owner_of(subkey, rule)
        if owner is None:
            return "bad-subkey"
        if bucket is not None and keys.bucket_of(owner, rule.buckets) != bucket:
            return "wrong-bucket"  # one record a peer, under its own bucket's key: no key grows past its share
        digest = hashlib.sha256(record.key + record.subkey + record.value + repr(float(exp)).encode()).digest()
        if digest not in self._seen:
            signed = verify(der, _signed_bytes(record.key, record.subkey, inner, exp), sig)
            self._remember(digest, signed and peer_id_from_public_der(der) == owner)
        if not self._seen[digest]:
            return "not-owner"
        return self._inner_reason(dht_key, subkey, inner, der, exp)

    def _inner_reason(self, dht_key: str, subkey: str, inner: bytes, der: bytes, exp: float) -> Optional[str]:
        try:
            # decoded as every reader decodes it (hivemind's serializer: map keys strings only): a
            # value a node took but a reader cannot decode made that reader's whole search fail
            value = MSGPackSerializer.loads(inner)
        except Exception:
            return "malformed"
        if not is_sealed(value):  # a signed payload of the same peer (the reader checks its signature)
            return None if isinstance(value, dict) and value.get("key") == der else "malformed"
        sealer = self.sealer_for(dht_key) if self.closed else None
        if sealer is None:
            return None
        try:
            sealer.open(value, dht_key, subkey, exp)
        except SealError as e:
            # sealed with our key but altered, moved or replayed; one sealed with another key (or
            # none) is kept for the guard, which refuses it on read and says why to whoever joins
            return "forged" if e.kind in ("forged", "malformed") else None
        return None

    def _remember(self, digest: bytes, ok: bool) -> None:
        self._seen[digest] = ok
        if len(self._seen) > 8192:
            self._seen.popitem(last=False)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def _outer(value: bytes) -> Optional[list]:
    try:
        outer = msgpack.unpackb(value, raw=False, max_bin_len=MAX_VALUE_BYTES)
    except Exception:
        return None
    if (not isinstance(outer, list) or len(outer) != 4 or outer[0] != MAGIC
            or not all(isinstance(x, bytes) for x in outer[1:]) or len(outer[2]) > 2048 or len(outer[3]) > 1024):
        return None
    return outer
