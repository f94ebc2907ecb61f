"""Closed swarms: the swarm key, the keys derived from it, and DHT values sealed with it.

A swarm key is 32 random bytes in a file of its own (``spantrain keygen PATH``), shared by the
swarm's members out of band. HKDF-SHA256 derives one key per use, so no key serves two purposes:

- ``dht``: the ChaCha20-Poly1305 key that seals every DHT value of a closed swarm;
- ``auth``: the HMAC key with which both ends of a data-plane handshake prove they hold the key;
- ``operator``: the token an operator's browser or tool gives to read a closed swarm's pages;
- the key id: 8 bytes that name the key (not secret, unrelated to the others), so a peer given a
  wrong key is told "another key" rather than "garbage".

A closed swarm with an allow-list seals its values with a *group key* instead (``GroupKey``: 32
random bytes made by its first peer and handed to each listed member under that member's own RSA
key, see ``group_key``), so a key holder who is not on the list reads nothing either.

A sealed value is ``b"STS1"`` and the swarm key's id (or ``b"STG1"``, the swarm key's id and the
group key's), a random 12-byte nonce, then the AEAD ciphertext of the msgpack value. The associated data binds it to its DHT key, subkey and expiration time: a
value cannot be moved under another key, nor replayed with a later expiry (replayed with its own,
it is older than the live one the DHT keeps, or already expired).

Only ``cryptography``'s primitives are used; nothing here is home-made but the envelope's layout.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"STS1"
GROUP_MAGIC = b"STG1"
KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 12
FILE_HEADER = "spantrain-swarm-key-v1"
MAX_SEALED_BYTES = 1 << 20  # the largest DHT value of a swarm (a stage map) is far below


class SealError(ValueError):
    """A DHT value that a closed swarm cannot take. ``kind`` says which way it failed:
    ``"unsealed"`` (a plain value), ``"other-key"`` (sealed with another swarm key), ``"forged"``
    (our key id, but it does not open: altered, moved or replayed), ``"malformed"``, and between
    the two layers ``"group-sealed"`` (under a group key, opened with a swarm key) and
    ``"swarm-sealed"`` (under a swarm key, opened with a group key)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def is_sealed(value: Any) -> bool:
    return isinstance(value, bytes) and value[: len(MAGIC)] in (MAGIC, GROUP_MAGIC)


def is_group_sealed(value: Any) -> bool:
    return isinstance(value, bytes) and value[: len(GROUP_MAGIC)] == GROUP_MAGIC


def sealed_key_id(value: bytes) -> bytes:
    return value[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES]


def _derive(secret: bytes, use: str, n: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=n, salt=None, info=f"spantrain swarm {use} v1".encode()).derive(
        secret)


def _associated(dht_key: str, subkey: Any, expiration: float) -> bytes:
    return b"spantrain dht v1" + msgpack.packb([dht_key, subkey, float(expiration)], use_bin_type=True)


class Sealer:
    """Seals and opens DHT values with a 32-byte secret (one derived AEAD key). The envelope's head
    (``magic`` and key ids) tells the two layers and the keys apart. Never printed: ``repr`` shows
    the key id only."""

    magic = MAGIC
    label = "swarm"
    uses = ("key id", "dht")  # the HKDF uses of its key id and its AEAD key

    def __init__(self, secret: bytes):
        if not isinstance(secret, bytes) or len(secret) != KEY_BYTES:
            raise ValueError(f"a {self.label} key is {KEY_BYTES} bytes")
        self.key_id = _derive(secret, self.uses[0], KEY_ID_BYTES)
        self._aead = ChaCha20Poly1305(_derive(secret, self.uses[1]))
        self.swarm_key_id = self.key_id

    @property
    def head(self) -> bytes:
        return self.magic + self.swarm_key_id + (self.key_id if self.key_id != self.swarm_key_id else b"")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.key_id.hex()})"

    def seal(self, value: Any, dht_key: str, subkey: Any, expiration: float) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        body = msgpack.packb(value, use_bin_type=True)
        return self.head + nonce + self._aead.encrypt(nonce, body, _associated(dht_key, subkey, expiration))

    def open(self, sealed: Any, dht_key: str, subkey: Any, expiration: float) -> Any:
        """The value inside an untrusted DHT value; SealError saying why not."""
        if not is_sealed(sealed):
            raise SealError("unsealed", "the value is not sealed (a peer of an open swarm, or of none)")
        if len(sealed) > MAX_SEALED_BYTES:
            raise SealError("malformed", f"sealed value of {len(sealed)} bytes is over {MAX_SEALED_BYTES}")
        head = self.head
        if len(sealed) < len(MAGIC) + KEY_ID_BYTES:
            raise SealError("malformed", "sealed value is truncated")
        if sealed_key_id(sealed) != self.swarm_key_id:
            raise SealError("other-key", f"sealed with another swarm key (id {sealed_key_id(sealed).hex()})")
        if sealed[: len(MAGIC)] != self.magic:
            if self.magic == MAGIC:
                raise SealError("group-sealed", "sealed with the group key of the members on the swarm's allow-list")
            raise SealError("swarm-sealed", "sealed with the swarm key alone (its peer has no allow-list)")
        if len(sealed) < len(head) + NONCE_BYTES + 16:
            raise SealError("malformed", "sealed value is truncated")
        if sealed[: len(head)] != head:
            raise SealError("other-group", f"sealed with another group key (id {sealed[len(MAGIC) + KEY_ID_BYTES:len(head)].hex()})")
        nonce = sealed[len(head) : len(head) + NONCE_BYTES]
        try:
            body = self._aead.decrypt(nonce, sealed[len(head) + NONCE_BYTES :], _associated(dht_key, subkey, expiration))
        except InvalidTag:
            raise SealError("forged", "sealed value does not open: altered, moved to another key, or replayed") from None
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:
            raise SealError("malformed", f"sealed value holds no msgpack ({e.__class__.__name__})") from None


class GroupKey(Sealer):
    """The group key of a closed swarm with an allow-list (of the swarm key ``swarm_key_id``): it
    seals the swarm's DHT values and derives the operator token of its pages. ``secret`` is kept to
    be wrapped for new members. Its envelope names the swarm key too, so a peer with a wrong swarm
    key is told so before it waits for a group key."""

    magic = GROUP_MAGIC
    label = "group"
    uses = ("group key id", "group dht")

    def __init__(self, secret: bytes, swarm_key_id: bytes):
        super().__init__(secret)
        self.swarm_key_id = swarm_key_id
        self.secret = secret
        self.operator_token = _derive(secret, "group operator", 16).hex()

    @classmethod
    def generate(cls, swarm_key_id: bytes) -> "GroupKey":
        return cls(secrets.token_bytes(KEY_BYTES), swarm_key_id)


class SwarmKey(Sealer):
    """A loaded swarm key."""

    def __init__(self, secret: bytes):
        super().__init__(secret)
        self._auth = _derive(secret, "auth")
        self.operator_token = _derive(secret, "operator", 16).hex()

    @classmethod
    def generate(cls) -> "SwarmKey":
        return cls(secrets.token_bytes(KEY_BYTES))

    @staticmethod
    def write_new(path: str) -> "SwarmKey":
        """Writes a new key to ``path`` (mode 0600; an existing file is never overwritten)."""
        secret = secrets.token_bytes(KEY_BYTES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{FILE_HEADER}\n{secret.hex()}\n")
        return SwarmKey(secret)

    @classmethod
    def load(cls, path: str) -> "SwarmKey":
        """The key in ``path``; ValueError saying what is wrong (OSError if it cannot be read)."""
        with open(path, "rb") as f:
            raw = f.read(4096)
        try:
            head, hexkey = raw.decode("ascii").split()
            secret = bytes.fromhex(hexkey)
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"{path} is not a swarm key file (make one with `spantrain keygen PATH`)") from None
        if head != FILE_HEADER or len(secret) != KEY_BYTES:
            raise ValueError(f"{path} is not a {FILE_HEADER} file of {KEY_BYTES} bytes")
        return cls(secret)

    # ---- proofs of holding the key ----------------------------------------------------------
    def prove(self, role: bytes, transcript: bytes) -> bytes:
        """HMAC-SHA256 of a handshake transcript under the derived ``auth`` key."""
        return hmac.new(self._auth, role + transcript, hashlib.sha256).digest()

    def check_proof(self, role: bytes, transcript: bytes, proof: Any) -> bool:
        return isinstance(proof, bytes) and hmac.compare_digest(self.prove(role, transcript), proof)

    def check_operator_token(self, token: Any) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token.encode(), self.operator_token.encode())
