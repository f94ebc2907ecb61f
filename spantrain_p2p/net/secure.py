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


_INTO = hasattr(AESGCM, "encrypt_into")  # cryptography >= 45: (de)crypt into a buffer given


class Sealer:
    def __init__(self, key: bytes):
        self._aead, self._n = AESGCM(key), 0

    def seal(self, data) -> list[bytearray]:
        """The records of ``data``, each its length and its ciphertext in one buffer: one write (one
        ``send``) a record, where a separate 4-byte length cost a send, and a segment, of its own."""
        # AESGCM reads a buffer as it is: no copy of the plain stream (a copy of each 1 MiB record cost
        # 15 times the encryption's own time here, in fresh pages)
        view, out = memoryview(data).cast("B"), []
        for i in range(0, max(view.nbytes, 1), MAX_PLAIN):
            piece = view[i:i + MAX_PLAIN]
            rec = bytearray(_LEN.size + piece.nbytes + TAG)
            _LEN.pack_into(rec, 0, piece.nbytes + TAG)
            nonce = self._n.to_bytes(12, "big")
            with memoryview(rec) as whole, whole[_LEN.size:] as ct:
                if _INTO:
                    self._aead.encrypt_into(nonce, piece, None, ct)
                else:
                    ct[:] = self._aead.encrypt(nonce, piece, None)
            self._n += 1
            out.append(rec)
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


class SecureProtocol(asyncio.BufferedProtocol):
    """Receives records straight into one buffer (the socket's bytes are copied once, by the
    kernel), opens each whole record into the buffer of ``inner`` (a BufferedProtocol) where it
    takes the record's plain bytes in one piece, else into a fresh buffer handed on in pieces. The
    record buffer is kept for the next record (at most MAX_PLAIN + TAG bytes a connection)."""

    def __init__(self, transport: asyncio.Transport, key: bytes):
        self.transport, self._aead, self._n = transport, AESGCM(key), 0
        self.inner: Optional[asyncio.BufferedProtocol] = None
        self._head = bytearray(_LEN.size)
        self._rec = bytearray()
        self._size = 0  # the record being read (0: its length is)
        self._want = memoryview(self._head)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._want

    def buffer_updated(self, nbytes: int) -> None:
        self._want = self._want[nbytes:]
        if self._want.nbytes:
            return
        if not self._size:
            (n,) = _LEN.unpack(self._head)
            if not TAG <= n <= MAX_PLAIN + TAG:
                self._abort(f"encrypted record of {n} bytes is out of bounds")
                return
            if len(self._rec) < n:
                self._rec = bytearray(n)
            self._size, self._want = n, memoryview(self._rec)[:n]
            return
        n, self._size, self._want = self._size, 0, memoryview(self._head)
        nonce = self._n.to_bytes(12, "big")
        self._n += 1
        try:
            with memoryview(self._rec) as whole, whole[:n] as record:
                if self._open_in_place(nonce, record, n - TAG):
                    return
                plain = self._aead.decrypt(nonce, record, None)
        except InvalidTag:
            self._abort("an encrypted record does not open: altered, dropped or replayed")
            return
        self._hand_on(memoryview(plain))

    def _open_in_place(self, nonce: bytes, record: memoryview, plain_n: int) -> bool:
        """Opens ``record`` into the inner protocol's buffer when it takes all of it now."""
        if not _INTO or not plain_n or self.transport.is_closing():
            return False
        buf = self.inner.get_buffer(plain_n)
        if len(buf) < plain_n:
            return False
        self._aead.decrypt_into(nonce, record, None, buf[:plain_n])
        self.inner.buffer_updated(plain_n)
        return True

    def _hand_on(self, view: memoryview) -> None:
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

    def _abort(self, why: str) -> None:
        self.transport.abort()
        log.warning("closed an encrypted connection: %s", why)

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

