"""Encrypted data-plane connections (``--encrypt``): AES-GCM records over an authenticated connection.

After a handshake that asked for encryption (``handshake.Session.encrypted``), each direction is a
stream of records: a 4-byte big-endian length, then the AES-256-GCM ciphertext (with its 16-byte
tag) of at most 1 MiB of the plain stream. The nonce is the record's number in its direction, so a
record that is dropped, repeated, reordered or altered fails to open and ends the connection. The
plain stream is exactly what an unencrypted connection carries, so the framed protocol above it
does not change. AES-GCM from ``cryptography`` (OpenSSL, with the CPU's AES instructions).
"""
from __future__ import annotations

import asyncio
import logging
import struct
from typing import Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

log = logging.getLogger("spantrain_p2p.net.dataplane")
_LEN = struct.Struct(">I")
MAX_PLAIN = 1 << 20
TAG = 16


class Sealer:
    def __init__(self, key: bytes):
        self._aead, self._n = AESGCM(key), 0

    def seal(self, data) -> list[bytes]:
        # AESGCM reads a buffer as it is: no copy of the plain stream (a copy of each 1 MiB record cost
        # 15 times the encryption's own time here, in fresh pages)
        view, out = memoryview(data).cast("B"), []
        for i in range(0, max(view.nbytes, 1), MAX_PLAIN):
            ct = self._aead.encrypt(self._n.to_bytes(12, "big"), view[i:i + MAX_PLAIN], None)
            self._n += 1
            out += [_LEN.pack(len(ct)), ct]
        return out


class Opener:
    def __init__(self, key: bytes):
        self._aead, self._n = AESGCM(key), 0
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The plain pieces of every record completed by ``data``; ConnectionError if one does not open."""
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if not TAG <= n <= MAX_PLAIN + TAG:
                raise ConnectionError(f"encrypted record of {n} bytes is out of bounds")
            if len(self._buf) < _LEN.size + n:
                break
            try:  # read in place (the views are let go before the buffer is cut below)
                with memoryview(self._buf) as whole, whole[_LEN.size:_LEN.size + n] as record:
                    out.append(self._aead.decrypt(self._n.to_bytes(12, "big"), record, None))
            except InvalidTag:
                raise ConnectionError("an encrypted record does not open: altered, dropped or replayed") from None
            self._n += 1
            del self._buf[:_LEN.size + n]
        return out


class SecureWriter:
    """Encrypts what is written and hands the records on; everything else goes to what it wraps.
    Wraps the server's transport (under the framed connection) and the client's StreamWriter."""

    def __init__(self, inner, key: bytes):
        self._inner, self._sealer = inner, Sealer(key)

    def write(self, data) -> None:
        for rec in self._sealer.seal(data):
            self._inner.write(rec)

    def __getattr__(self, name):  # close, abort, is_closing, pause/resume_reading, drain, transport, ...
        return getattr(self._inner, name)


# ---- the server's side: a protocol around the framed connection ----------------------------------


class SecureProtocol(asyncio.Protocol):
    """Receives records, and feeds their plain bytes to ``inner`` (a BufferedProtocol)."""

    def __init__(self, transport: asyncio.Transport, key: bytes):
        self.transport, self._opener = transport, Opener(key)
        self.inner: Optional[asyncio.BufferedProtocol] = None

    def data_received(self, data: bytes) -> None:
        try:
            pieces = self._opener.feed(data)
        except ConnectionError as e:
            self.transport.abort()
            log.warning("closed an encrypted connection: %s", e)
            return
        for p in pieces:
            view = memoryview(p)
            while view.nbytes and not self.transport.is_closing():
                buf = self.inner.get_buffer(view.nbytes)
                n = min(len(buf), view.nbytes)
                if not n:  # a stage that takes nothing now (a request is running): the protocol decides
                    self.inner.buffer_updated(0)
                    if not len(self.inner.get_buffer(view.nbytes)):
                        break
                    continue
                buf[:n] = view[:n]
                self.inner.buffer_updated(n)
                view = view[n:]

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.inner.connection_lost(exc)


# ---- the client's side: a reader around asyncio's stream (and a SecureWriter) ---------------------
class SecureReader:
    def __init__(self, reader: asyncio.StreamReader, key: bytes):
        self._r, self._opener = reader, Opener(key)
        self._buf = bytearray()
        self._eof = False

    async def _fill(self) -> None:
        data = await self._r.read(1 << 18)
        if not data:
            self._eof = True
        for p in self._opener.feed(data):
            self._buf += p

    async def readexactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if self._eof:
                raise asyncio.IncompleteReadError(bytes(self._buf), n)
            await self._fill()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def read(self, n: int) -> bytes:
        while not self._buf and not self._eof:  # a read may end inside a record: that gives nothing yet
            await self._fill()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def at_eof(self) -> bool:
        return (self._eof or self._r.at_eof()) and not self._buf

