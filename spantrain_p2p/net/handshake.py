"""The data plane's handshake: binds a connection to both peers' libp2p identities.

A connection that carries messages starts with three handshake messages (each ``b"STH1"``, a
4-byte big-endian length, then a msgpack map):

1. client hello: ``{v, id, key, nonce, eph, enc, host, want}``: its peer id, its RSA public key
   (DER; the peer id is the key's hash, as libp2p derives it), 32 random bytes, an X25519 public key
   for this connection only, whether it wants encryption, the machine it says it is on (below), and
   the peer id it means to reach;
2. server hello: ``{core, sig, proof}``: ``core`` is the msgpack of the server's own ``{v, id, key,
   nonce, eph, enc, host}``; ``sig`` its RSA signature of ``"server" + T``, where the transcript hash
   ``T = sha256(client hello + core)``; ``proof`` (closed swarms) an HMAC of the same under the
   key derived from the swarm key. Or ``{error}``;
3. client finish: ``{sig, proof}`` over ``"client" + T``; the server answers ``{ok: true}`` or
   ``{error}`` (a reason: not on the allow-list, a wrong swarm key).

Each side checks that the other's key hashes to the id it claims and signed this transcript (with
fresh nonces from both, so a recorded handshake cannot be replayed), and in a closed swarm that it
holds the swarm key. From then on the connection's sender is known: a message's ``src`` must be it.
Encryption (either side asks): both derive two AEAD keys, one per direction, with HKDF from the
X25519 shared secret salted with ``T`` (``secure``). Primitives from ``cryptography`` only.

A peer asks for encryption on every connection that leaves its machine. One whose two ends are
both on it (``Authenticator.host``) it does not ask for: the client dialed the listening address
of the peer it names straight (the socket's far end is that very loopback address: no relay, no
reversal), and the server sees a loopback address too, and a client hello that says it is on the
same machine (``host``: peers that emulate a scenario's stand for machines of their own unless
the scenario gives them one host). Such bytes go from one process's memory to the other's through
the kernel: no one but root can read or inject them, and root reads both processes anyway. The
handshake still binds the connection to both identities (a relay on the machine, or a peer that
took a dead one's port, fails it or makes one end ask), and ``--encrypt`` has a peer ask on those
connections too.
"""
from __future__ import annotations

import asyncio
import hashlib
import secrets
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgpack
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..swarm.identity import Identity, peer_id_from_public_der, public_key, verify
from .addresses import ip_of
from ..swarm.sealing import SwarmKey

MAGIC = b"STH1"
_PREFIX = struct.Struct(">4sI")
MAX_MESSAGE_BYTES = 8 << 10
VERSION = 1
TIMEOUT_S = 10.0  # the whole handshake, from the first byte


class HandshakeError(ConnectionError):
    """The other side could not be authenticated, or refused us; the message says why."""


@dataclass(frozen=True)
class Session:
    """An authenticated connection: who is at the other end, and its keys when encrypted."""

    peer_id: str
    encrypted: bool = False
    send_key: bytes = b""
    recv_key: bytes = b""


def _loopback_ip(peername: Any):
    """The loopback IP a socket's far end (``get_extra_info("peername")``) has, else None."""
    ip = ip_of(peername[0]) if isinstance(peername, tuple) and len(peername) >= 2 and isinstance(peername[0], str) \
        else None
    return ip if ip is not None and ip.is_loopback else None


def is_loopback(peername: Any) -> bool:
    """Whether a socket's far end is a loopback address: its bytes never leave this machine."""
    return _loopback_ip(peername) is not None


def dialed_straight(peername: Any, dialed: Optional[tuple[str, int]]) -> bool:
    """Whether a client's socket ends at the loopback address it dialed (``dialed``: its host, an IP
    literal, and port), not at a relay or another path's end."""
    ip = _loopback_ip(peername)
    return ip is not None and dialed is not None and peername[1] == dialed[1] and ip == ip_of(dialed[0])


class Authenticator:
    """What a peer proves and checks in handshakes: its identity, the swarm key of a closed swarm,
    whether it wants encryption, and ``admit(peer_id)`` (None, or the reason that peer is refused).
    ``host()``, where given: the machine this peer is on, as its hellos say (an emulated peer's
    scenario decides); a connection whose two ends are both on it is then not asked to be
    encrypted (see the module's docstring). Without it, every connection is asked (``encrypt``)."""

    def __init__(self, identity: Identity, swarm_key: Optional[SwarmKey] = None, encrypt: bool = False,
                 admit: Optional[Callable[[str], Optional[str]]] = None,
                 host: Optional[Callable[[], str]] = None):
        self.identity, self.swarm_key, self.encrypt = identity, swarm_key, encrypt
        self.admit = admit or (lambda peer_id: None)
        self.host = host
        # what a closed swarm's pages take: the swarm key's, or (with an allow-list) the group
        # key's once this peer holds it (None: an open swarm, or not yet)
        self.operator_token: Optional[str] = swarm_key.operator_token if swarm_key is not None else None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def _hello(self, here: bool = False) -> tuple[dict, X25519PrivateKey]:
        """``here``: both ends of this connection are on this machine (no encryption asked for)."""
        eph = X25519PrivateKey.generate()
        pub = eph.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return {"v": VERSION, "id": self.peer_id, "key": self.identity.public_der, "nonce": secrets.token_bytes(32),
                "eph": pub, "enc": self.encrypt and not here, "host": self.host() if self.host else ""}, eph

    def _proof(self, role: bytes, transcript: bytes) -> bytes:
        return self.swarm_key.prove(role, transcript) if self.swarm_key is not None else b""

    def _check_party(self, d: dict, role: bytes, transcript: bytes, sig: Any, proof: Any) -> str:
        """The other party's peer id, once its key, signature and proof check out."""
        key, claimed = d.get("key"), d.get("id")
        if not isinstance(key, bytes) or not isinstance(claimed, str) or peer_id_from_public_der(key) != claimed:
            raise HandshakeError("the other side's key does not match the peer id it claims")
        if not isinstance(sig, bytes) or not verify(key, role + transcript, sig):
            raise HandshakeError(f"bad handshake signature from {claimed}")
        if self.swarm_key is not None and not self.swarm_key.check_proof(role, transcript, proof):
            raise HandshakeError(f"{claimed} does not hold this swarm's key")
        return claimed

    # ---- client side ----------------------------------------------------------------------
    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     want: Optional[str] = None, dialed: Optional[tuple[str, int]] = None) -> Session:
        """Runs the client's side over a fresh connection; HandshakeError if it fails. ``dialed``: the
        address this connection was dialed to, where it was (the listening address of ``want``)."""
        hello, eph = self._hello(self.host is not None and dialed_straight(writer.get_extra_info("peername"), dialed))
        hello["want"] = want or ""
        hello_bytes = pack(hello)
        writer.write(hello_bytes)
        answer = await read_message(reader)
        if "error" in answer:
            raise HandshakeError(f"refused: {str(answer['error'])[:300]}")
        core_bytes = answer.get("core")
        if not isinstance(core_bytes, bytes) or len(core_bytes) > MAX_MESSAGE_BYTES:
            raise HandshakeError("server hello lacks its core")
        core = unpack_map(core_bytes)
        transcript = hashlib.sha256(hello_bytes + core_bytes).digest()
        server = self._check_party(core, b"server", transcript, answer.get("sig"), answer.get("proof"))
        if want and server != want:
            raise HandshakeError(f"expected peer {want} at this address, found {server}")
        writer.write(pack({"sig": self.identity.sign(b"client" + transcript),
                           "proof": self._proof(b"client", transcript)}))
        verdict = await read_message(reader)
        if verdict.get("ok") is not True:
            raise HandshakeError(f"refused by {server}: {str(verdict.get('error'))[:300]}")
        return self._session(server, eph, core, hello["enc"] or core.get("enc") is True, transcript, client=True)

    # ---- server side ----------------------------------------------------------------------
    def server_hello(self, hello_bytes: bytes, peername: Any = None) -> tuple[bytes, "Pending"]:
        """The answer to a client hello (the full message, prefix included), and what the finish
        will be checked against; HandshakeError (to answer as ``{error}``) if the hello is bad.
        ``peername``: the connection's far end (``get_extra_info("peername")``)."""
        hello = unpack_map(hello_bytes[_PREFIX.size:])
        if hello.get("v") != VERSION:
            raise HandshakeError(f"handshake version {hello.get('v')!r}, this peer speaks {VERSION}")
        for field, n in (("nonce", 32), ("eph", 32)):
            if not isinstance(hello.get(field), bytes) or len(hello[field]) != n:
                raise HandshakeError(f"client hello field {field!r} must be {n} bytes")
        want = hello.get("want")
        if want and want != self.peer_id:
            raise HandshakeError(f"this is peer {self.peer_id}, not {str(want)[:60]}")
        # cheap checks before the RSA signature this answer costs: the key is one we take, it hashes
        # to the id claimed, and that id is admitted (the allow-list); the signature comes at finish
        key, claimed = hello.get("key"), hello.get("id")
        if not isinstance(key, bytes) or not isinstance(claimed, str) or peer_id_from_public_der(key) != claimed:
            raise HandshakeError("the client's key does not match the peer id it claims")
        try:
            public_key(key)
        except ValueError as e:
            raise HandshakeError(f"client key refused: {e}") from None
        refused = self.admit(claimed)
        if refused:
            raise HandshakeError(refused)
        host = hello.get("host")
        mine, eph = self._hello(self.host is not None and is_loopback(peername) and bool(host) and host == self.host())
        core_bytes = msgpack.packb(mine, use_bin_type=True)
        transcript = hashlib.sha256(hello_bytes + core_bytes).digest()
        answer = pack({"core": core_bytes, "sig": self.identity.sign(b"server" + transcript),
                       "proof": self._proof(b"server", transcript)})
        return answer, Pending(hello, eph, transcript, mine["enc"] or hello.get("enc") is True)

    def server_finish(self, pending: "Pending", finish: dict) -> Session:
        client = self._check_party(pending.hello, b"client", pending.transcript, finish.get("sig"), finish.get("proof"))
        refused = self.admit(client)
        if refused:
            raise HandshakeError(refused)
        return self._session(client, pending.eph, pending.hello, pending.encrypt, pending.transcript, client=False)

    @staticmethod
    def _session(other: str, eph: X25519PrivateKey, their: dict, encrypt: bool, transcript: bytes,
                 client: bool) -> Session:
        if not encrypt:
            return Session(other)
        try:
            shared = eph.exchange(X25519PublicKey.from_public_bytes(their.get("eph", b"")))
        except ValueError:
            raise HandshakeError("bad X25519 key in the handshake") from None
        keys = HKDF(algorithm=hashes.SHA256(), length=64, salt=transcript,
                    info=b"spantrain data plane keys v1").derive(shared)
        c2s, s2c = keys[:32], keys[32:]
        return Session(other, True, c2s if client else s2c, s2c if client else c2s)


@dataclass(frozen=True)
class Pending:
    hello: dict
    eph: X25519PrivateKey
    transcript: bytes
    encrypt: bool


def pack(d: dict) -> bytes:
    body = msgpack.packb(d, use_bin_type=True)
    return _PREFIX.pack(MAGIC, len(body)) + body


def unpack_map(body: bytes) -> dict:
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES,
                            max_str_len=MAX_MESSAGE_BYTES)
    except Exception as e:
        raise HandshakeError(f"handshake message is not msgpack ({e.__class__.__name__})") from None
    if not isinstance(d, dict):
        raise HandshakeError("handshake message must be a map")
    return d


def message_length(prefix: bytes) -> int:
    """The body length a handshake message's 8-byte prefix announces (checked against the limit)."""
    magic, n = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise HandshakeError("not a handshake message")
    if n > MAX_MESSAGE_BYTES:
        raise HandshakeError(f"handshake message of {n} bytes is over {MAX_MESSAGE_BYTES}")
    return n


PREFIX_BYTES = _PREFIX.size


async def read_message(reader: asyncio.StreamReader) -> dict:
    try:
        n = message_length(await reader.readexactly(_PREFIX.size))
        return unpack_map(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        raise HandshakeError("the other side closed the connection during the handshake") from None
