"""A signed entry sent again to a peer that holds its last one, as the change between the two
(issue 33): a peer's links go to the planner, its standby and the grouping's voters each time its
weather changes, and at 1,000 peers those pushes were most of the busiest voter's traffic (4.6 KB/s
of its 17), though a change moves one link of 16 and leaves the other 3 KB as they were.

The change is the new body compressed with the old one as zlib's preset dictionary (``zdict``): 49
bytes for one link of 16 changed, against a 3 KB body (326 sent, with the signature and framing). The receiver rebuilds the body from the one
it holds and checks the signature over the rebuilt bytes with the key it took with that one: it
trusts nothing more than it did with the whole entry. A receiver that holds no such body says so
in its answer, and the sender sends it whole (``Sent.lacked``).

Plain data and zlib (the standard library's); the sender's side is ``Sent``, the receiver's
``Held``; both bounded.
"""
from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from typing import Optional

__all__ = ["DIGEST_BYTES", "Held", "Sent", "delta", "digest", "undelta"]

DIGEST_BYTES = 16
KEEP_BODIES = 4  # a sender's last bodies of a kind, to send changes against
MAX_ACKED = 4096  # (receiver, kind) pairs a sender remembers, at most
HELD_BYTES = 64 << 20  # bodies a receiver holds to rebuild changes from, in all (at 1,000 peers: 3 MB of links)
HELD_OVERHEAD = 512  # bytes an entry costs beside its body and key (its tuple, ids, digest), as counted
MAX_HELD = 65536  # entries, at most
_WBITS = -15  # raw deflate: no header or checksum (the signature covers the rebuilt body)


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()[:DIGEST_BYTES]


def delta(body: bytes, base: bytes) -> bytes:
    """``body`` compressed with ``base`` as the dictionary."""
    c = zlib.compressobj(9, zlib.DEFLATED, _WBITS, 9, zlib.Z_DEFAULT_STRATEGY, zdict=base)
    return c.compress(body) + c.flush()


def undelta(z: bytes, base: bytes, max_bytes: int) -> bytes:
    """The body ``delta(body, base)`` came from; ValueError where ``z`` is not one, or is over
    ``max_bytes`` rebuilt (never more than that is inflated)."""
    d = zlib.decompressobj(_WBITS, zdict=base)
    try:
        out = d.decompress(z, max_bytes + 1)
    except zlib.error as e:
        raise ValueError(f"not a change of the entry held ({e})") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise ValueError(f"a change rebuilds more than {max_bytes} bytes")
    if not d.eof or d.unused_data:
        raise ValueError("a change that does not end where its bytes do")
    return out


class Sent:
    """The sender's side: its last bodies of each kind and, per receiver, the body it took last."""

    def __init__(self) -> None:
        self._bodies: dict[str, OrderedDict[bytes, bytes]] = {}  # kind -> digest -> body (the last few)
        self._acked: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # (receiver, kind) -> digest
        # (kind, base digest, body digest) -> the change: compressed once for all the watchers that
        # took the same base (16 voters and the planner's pair), forgotten with each new body
        self._changes: dict[tuple[str, bytes, bytes], bytes] = {}

    def wire(self, to: str, kind: str, signed: dict) -> dict:
        """What goes to ``to``: the change (``{"base", "z", "sig"}``) where it took one of this
        kind's last bodies, else the signed entry whole."""
        body, d = signed["body"], digest(signed["body"])
        bodies = self._bodies.setdefault(kind, OrderedDict())
        if d not in bodies:
            self._changes.clear()
        bodies[d] = body
        bodies.move_to_end(d)
        while len(bodies) > KEEP_BODIES:
            bodies.popitem(last=False)
        base = self._acked.get((to, kind))
        if base is None or base not in bodies:
            return signed
        z = self._changes.get((kind, base, d))
        if z is None:
            z = self._changes[(kind, base, d)] = delta(body, bodies[base])
        return {"base": base, "z": z, "sig": signed["sig"]}

    def acked(self, to: str, kind: str, signed: dict) -> None:
        """``to`` took ``signed`` (whole or as a change)."""
        self._acked[(to, kind)] = digest(signed["body"])
        self._acked.move_to_end((to, kind))
        while len(self._acked) > MAX_ACKED:
            self._acked.popitem(last=False)

    def lacked(self, to: str, kind: str) -> None:
        """``to`` holds no body to rebuild from: the next goes whole."""
        self._acked.pop((to, kind), None)


class Held:
    """The receiver's side: the last body, its key and digest, of each (sender, kind) it took, at
    most ``HELD_BYTES`` in all (the longest unused go first)."""

    def __init__(self, max_bytes: int = HELD_BYTES) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[tuple[str, str], tuple[bytes, bytes, bytes]] = OrderedDict()
        self._bytes = 0

    def whole(self, src: str, kind: str, value: dict, max_bytes: int) -> Optional[dict]:
        """The signed entry ``value`` stands for: itself where whole, rebuilt where a change of the
        body held; None where it is a change of a body not held (the sender is told, and sends it
        whole next). ValueError where it is neither (the signature is checked by the caller)."""
        if not isinstance(value, dict) or set(value) != {"base", "z", "sig"}:
            return value  # whole (or malformed: ``open_payload`` says which)
        base, z, sig = value["base"], value["z"], value["sig"]
        if not (isinstance(base, bytes) and len(base) == DIGEST_BYTES and isinstance(z, bytes) and isinstance(sig, bytes)):
            raise ValueError("a change is {base: 16 bytes, z: bytes, sig: bytes}")
        held = self._held.get((src, kind))
        if held is None or held[0] != base:
            return None
        self._held.move_to_end((src, kind))
        return {"body": undelta(z, held[1], max_bytes), "key": held[2], "sig": sig}

    def keep(self, src: str, kind: str, signed: dict) -> None:
        """``signed`` (its signature checked, by ``src``) is the body to rebuild ``src``'s next from."""
        old = self._held.pop((src, kind), None)
        if old is not None:
            self._bytes -= len(old[1]) + len(old[2]) + HELD_OVERHEAD
        body, key = signed["body"], signed["key"]
        self._held[(src, kind)] = (digest(body), body, key)
        self._bytes += len(body) + len(key) + HELD_OVERHEAD
        while (self._bytes > self.max_bytes or len(self._held) > MAX_HELD) and self._held:
            _, (_, b, k) = self._held.popitem(last=False)
            self._bytes -= len(b) + len(k) + HELD_OVERHEAD
