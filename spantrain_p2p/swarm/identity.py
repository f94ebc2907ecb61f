"""Peer identity: the libp2p RSA key a peer id is derived from, and signatures made with it.

The key file has libp2p's protobuf format (the one hivemind's ``P2P(identity_path=…)`` reads), so
the peer id p2pd announces and the key that signs our DHT records are one and the same: a record
is only accepted when the public key it carries hashes to the peer id it claims.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.proto import crypto_pb2

_PADDING = padding.PKCS1v15()  # deterministic, and what libp2p uses for RSA


@functools.lru_cache(maxsize=4096)
def peer_id_from_public_der(public_der: bytes) -> str:
    """libp2p peer id (base58) of an RSA public key in DER SubjectPublicKeyInfo form. Remembered for
    the last 4,096 keys: the base58 encoding is pure Python, and a planner reading every member's
    record every second derived each one's id twice a read (a sixth of its CPU at 48 peers)."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


MIN_KEY_BITS, MAX_KEY_BITS, EXPONENT = 2048, 4096, 65537


def public_key(public_der: bytes) -> rsa.RSAPublicKey:
    """The RSA key of an untrusted DER blob, if it is one this swarm takes: 2048-4096 bits with
    e = 65537 (a weak key is refused; a huge one or an odd exponent makes every check cost more);
    ValueError saying why not."""
    try:
        key = serialization.load_der_public_key(public_der)
    except (ValueError, TypeError):
        raise ValueError("not a DER public key") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA key")
    if not MIN_KEY_BITS <= key.key_size <= MAX_KEY_BITS or key.public_numbers().e != EXPONENT:
        raise ValueError(f"RSA keys of {MIN_KEY_BITS}-{MAX_KEY_BITS} bits with e = {EXPONENT} only "
                         f"(got {key.key_size} bits, e = {key.public_numbers().e})")
    return key


def verify(public_der: bytes, data: bytes, signature: bytes) -> bool:
    try:
        key = public_key(public_der)
    except ValueError:
        return False
    try:
        key.verify(signature, data, _PADDING, hashes.SHA256())
        return True
    except InvalidSignature:
        return False


@dataclass(frozen=True)
class Identity:
    private_key: rsa.RSAPrivateKey
    public_der: bytes
    peer_id: str

    @classmethod
    def from_private_key(cls, key: rsa.RSAPrivateKey) -> "Identity":
        public_der = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return cls(key, public_der, peer_id_from_public_der(public_der))

    @classmethod
    def generate(cls) -> "Identity":
        return cls.from_private_key(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @classmethod
    def load(cls, path: str) -> "Identity":
        """Reads a libp2p protobuf private key file; a clear ValueError if it is not one."""
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        try:
            proto = crypto_pb2.PrivateKey.FromString(raw)
            key = serialization.load_der_private_key(proto.data, password=None)
        except Exception as e:  # protobuf and cryptography raise several kinds
            raise ValueError(f"{path} is not a libp2p RSA identity file ({e.__class__.__name__})") from None
        if proto.key_type != crypto_pb2.RSA or not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"{path}: only RSA identities are supported")
        return cls.from_private_key(key)

    def save(self, path: str) -> None:
        der = self.private_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)

    @classmethod
    def load_or_create(cls, path: str) -> tuple["Identity", bool]:
        """(identity, created): loads ``path``, or generates a new key there if it does not exist."""
        if os.path.exists(path):
            return cls.load(path), False
        ident = cls.generate()
        ident.save(path)
        return ident, True

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data, _PADDING, hashes.SHA256())
