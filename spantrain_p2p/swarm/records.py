"""Signed, versioned peer records: what each peer announces about itself in the DHT.

Pure functions over plain data: ``seal`` turns a record into the signed DHT value, ``open_record``
checks an untrusted DHT value and returns the record or raises ``BadRecord`` with the reason.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import msgpack

from .identity import Identity, peer_id_from_public_der, verify

RECORD_SCHEMA = 1
# "direct": others dialed it back; "nat": not reachable from outside, with an endpoint-independent
# mapping (hole punching can work); "nat-symmetric": a new public port per destination (relay only)
REACH = ("", "direct", "nat", "nat-symmetric")
STATES = ("joining", "idle", "ready", "measuring", "training", "recovering", "done", "failed", "left")
MAX_RECORD_BYTES = 8 << 10
MAX_KEY_BYTES = 2048
MAX_SIG_BYTES = 1024
MAX_STR = 256
MAX_LIST = 16


class BadRecord(ValueError):
    """An untrusted record that failed validation; the message says why."""


@dataclass(frozen=True)
class PeerRecord:
    peer_id: str
    seq: int  # grows with every change of the record in one run of the peer
    ts: float  # DHT time of the record's last change, seconds
    state: str
    version: str
    data_url: str  # data plane, e.g. http://127.0.0.1:34567
    maddrs: tuple[str, ...]
    instance: str  # random per process start: tells a restart from a duplicate
    name: str = ""  # human name (a scenario's peer name), may be empty
    device: Mapping[str, Any] = field(default_factory=dict)  # {"kind", "tflops", "memory_gb", "cpus"}
    progress: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"epoch": 3, "failed_epoch": 2}
    reach: str = ""  # how others reach its data plane (REACH): "" not known yet
    schema: int = RECORD_SCHEMA

    @property
    def alive(self) -> bool:
        return self.state != "left"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["maddrs"] = list(self.maddrs)
        d["device"] = dict(self.device)
        d["progress"] = dict(self.progress)
        return d


def sign_payload(payload: dict, identity: Identity, max_bytes: int = MAX_RECORD_BYTES) -> dict:
    """A signed DHT value: msgpack body, the signer's public key, and a signature over the body."""
    body = msgpack.packb(payload, use_bin_type=True)
    if len(body) > max_bytes:
        raise ValueError(f"signed payload is {len(body)} bytes, over the {max_bytes} limit")
    return {"body": body, "key": identity.public_der, "sig": identity.sign(body)}


# signatures found good, by a digest of (key, body, signature): a record is read again and again (a
# watcher reads every member's every second) and, unchanged, re-stored with each heartbeat; its RSA
# check was a third of a watcher's CPU at 48 peers. Only good ones are kept, and at most this many.
VERIFIED_KEPT = 16384
_VERIFIED: "OrderedDict[bytes, bool]" = OrderedDict()


def _triple_digest(key: bytes, body: bytes, sig: bytes) -> bytes:
    """A digest of the three, each length-prefixed: no other split of the same bytes shares it."""
    h = hashlib.sha256()
    for part in (key, body, sig):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def open_payload(value: Any, max_bytes: int = MAX_RECORD_BYTES) -> tuple[str, dict]:
    """(signer peer id, payload) of an untrusted signed DHT value; BadRecord saying why not."""
    if not isinstance(value, dict) or set(value) != {"body", "key", "sig"}:
        raise BadRecord("not a signed peer record (want a map with body, key, sig)")
    body, key, sig = value["body"], value["key"], value["sig"]
    if not all(isinstance(x, bytes) for x in (body, key, sig)):
        raise BadRecord("body, key and sig must be bytes")
    if len(body) > max_bytes or len(key) > MAX_KEY_BYTES or len(sig) > MAX_SIG_BYTES:
        raise BadRecord(f"record too large ({len(body)} + {len(key)} + {len(sig)} bytes)")
    digest = _triple_digest(key, body, sig)
    if digest not in _VERIFIED:
        if not verify(key, body, sig):
            raise BadRecord("bad signature")
        _VERIFIED[digest] = True
        if len(_VERIFIED) > VERIFIED_KEPT:
            _VERIFIED.popitem(last=False)
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=max_bytes)
    except Exception as e:
        raise BadRecord(f"body is not msgpack ({e.__class__.__name__})") from None
    if not isinstance(d, dict):
        raise BadRecord("body must be a map")
    return peer_id_from_public_der(key), d


def seal(record: PeerRecord, identity: Identity) -> dict:
    """The DHT value for ``record``, signed by its own peer."""
    if record.peer_id != identity.peer_id:
        raise ValueError("a peer can only sign its own record")
    return sign_payload(record.to_dict(), identity)


def _str(d: Mapping, name: str, max_len: int = MAX_STR) -> str:
    v = d.get(name)
    if not isinstance(v, str) or len(v) > max_len:
        raise BadRecord(f"field {name!r} must be a string of at most {max_len} characters")
    return v


def _number(d: Mapping, name: str, lo: float, hi: float) -> float:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise BadRecord(f"field {name!r} must be a number in [{lo}, {hi}]")
    return v


def _small_map(raw: Any, what: str = "device") -> dict:
    if not isinstance(raw, dict) or len(raw) > MAX_LIST:
        raise BadRecord(f"field {what!r} must be a small map")
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or len(k) > 32:
            raise BadRecord(f"{what} keys must be short strings")
        if isinstance(v, str) and len(v) <= MAX_STR:
            out[k] = v
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 1e12:
            out[k] = v
        else:
            raise BadRecord(f"{what} field {k!r} must be a short string or a finite number")
    return out


def open_record(subkey: Any, value: Any) -> PeerRecord:
    """Validates an untrusted DHT entry (subkey, value) and returns its record."""
    signer, d = open_payload(value)
    schema = d.get("schema")
    if schema != RECORD_SCHEMA:
        raise BadRecord(f"unknown record schema {schema!r} (this peer reads {RECORD_SCHEMA})")
    peer_id = _str(d, "peer_id", 128)
    if peer_id != signer or subkey != peer_id:
        raise BadRecord(f"record for {peer_id!r} under subkey {subkey!r} is signed by {signer}")
    state = _str(d, "state", 16)
    if state not in STATES:
        raise BadRecord(f"unknown state {state!r}")
    maddrs = d.get("maddrs")
    if not isinstance(maddrs, list) or len(maddrs) > MAX_LIST or not all(
        isinstance(m, str) and len(m) <= MAX_STR for m in maddrs
    ):
        raise BadRecord("field 'maddrs' must be a short list of strings")
    data_url = _str(d, "data_url")
    if data_url and not data_url.startswith(("http://", "https://")):
        raise BadRecord("field 'data_url' must be an http(s) URL")
    return PeerRecord(
        peer_id=peer_id,
        seq=int(_number(d, "seq", 0, 2**62)),
        ts=float(_number(d, "ts", 0, 1e11)),
        state=state,
        version=_str(d, "version", 64),
        data_url=data_url,
        maddrs=tuple(maddrs),
        instance=_str(d, "instance", 64),
        name=_str(d, "name", 64),
        device=_small_map(d.get("device", {})),
        progress=_small_map(d.get("progress", {}), "progress"),
        reach=_reach(d),
    )


def _reach(d: Mapping) -> str:
    v = d.get("reach", "")
    if v not in REACH:
        raise BadRecord(f"field 'reach' must be one of {REACH}")
    return v
