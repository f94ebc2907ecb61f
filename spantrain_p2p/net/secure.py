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


def record_size(buf, at: int = 0) -> int:
    """The size of the record whose 4-byte length starts at ``at`` (its ciphertext and tag);
    ConnectionError where no sealer makes a record of that size."""
    (n,) = _LEN.unpack_from(buf, at)
    if not TAG <= n <= MAX_PLAIN + TAG:
        raise ConnectionError(f"encrypted record of {n} bytes is out of bounds")
    return n


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
            n = record_size(self._buf)
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
    """Receives into one buffer as many bytes as the socket holds, so that one read can bring
    several records (a record's length and its ciphertext each cost a read, and a turn of the event
    loop, of their own before: 4 to 6 reads a tensor message), and opens each whole record into
    the buffer of ``inner`` (a BufferedProtocol) where it takes the record's plain bytes in one
    piece, else into a fresh buffer handed on in pieces. The buffer is kept for the next records:
    at most a whole record (MAX_PLAIN + TAG and its length), ``ROOM`` and ``MIN_ROOM`` bytes a connection."""

    ROOM = 256 << 10  # offered to each read beyond the record under way
    MIN_ROOM = 4 << 10  # less than this left at the end: the record under way moves to the front

    def __init__(self, transport: asyncio.Transport, key: bytes):
        self.transport, self._aead, self._n = transport, AESGCM(key), 0
        self.inner: Optional[asyncio.BufferedProtocol] = None
        self._buf = bytearray(self.MIN_ROOM)  # grows as records need (never in place: asyncio holds a view)
        self._start = 0  # where the first record not yet opened begins
        self._have = 0  # bytes received into ``_buf``

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buf) - self._have < self.MIN_ROOM:
            self._make_room(0)
        return memoryview(self._buf)[self._have:]

    def _make_room(self, record: int) -> None:
        """Moves the bytes not yet opened to the front, into a larger buffer where ``record`` bytes
        (the record under way, its length included) and ``MIN_ROOM`` more would not fit."""
        kept = self._have - self._start
        need = max(record, kept) + self.MIN_ROOM
        if need > len(self._buf):
            grown = bytearray(need + (self.ROOM if record else 0))  # (a record's: room for the next reads too)
            grown[:kept] = self._buf[self._start:self._have]
            self._buf = grown
        elif self._start:
            self._buf[:kept] = self._buf[self._start:self._have]
        self._start, self._have = 0, kept

    def buffer_updated(self, nbytes: int) -> None:
        self._have += nbytes
        while not self.transport.is_closing() and self._have - self._start >= _LEN.size:
            try:
                n = record_size(self._buf, self._start)
            except ConnectionError as e:
                self._abort(str(e))
                return
            begin, end = self._start + _LEN.size, self._start + _LEN.size + n
            if end > self._have:
                if end > len(self._buf):
                    self._make_room(_LEN.size + n)
                return
            nonce = self._n.to_bytes(12, "big")
            self._n += 1
            try:
                with memoryview(self._buf) as whole, whole[begin:end] as record:
                    plain = None if self._open_in_place(nonce, record, n - TAG) else \
                        self._aead.decrypt(nonce, record, None)
            except InvalidTag:
                self._abort("an encrypted record does not open: altered, dropped or replayed")
                return
            self._start = end
            if plain is not None:
                self._hand_on(memoryview(plain))
        if self._start == self._have:
            self._start = self._have = 0

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

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

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

