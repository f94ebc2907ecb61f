"""The data plane's client: every outgoing message and page of a peer (see ``dataplane`` for the wire).

Messages go over framed TCP, on connections kept open per destination; each connection starts with
the handshake (``handshake``) when the client has an ``Authenticator``, and is then bound to the
peer at the other end. JSON pages go over one pooled HTTP session (with the operator token of a
closed swarm).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from typing import Callable, Optional, Sequence

import aiohttp

from . import framing, handshake, secure
from .addresses import address_of
from .handshake import Authenticator
from .wire import ANSWER, ANSWER_MAGIC, MAX_KIND_BYTES, PIECE_BYTES, REQUEST, REQUEST_MAGIC, SMALL_BYTES, RemoteError


PAGE_KIND = "page"  # a page (``GET /status`` …) asked over the framed connection, where HTTP cannot go


class DataPlaneClient:
    """All outgoing data-plane traffic of a peer: messages over framed TCP (connections kept open
    per destination, at most ``max_connections`` at once), JSON pages over one pooled HTTP session."""

    MAX_IDLE_PER_DESTINATION = 8

    def __init__(self, max_message_bytes: int = framing.DEFAULT_MAX_MESSAGE_BYTES, max_connections: int = 64,
                 auth: Optional[Authenticator] = None):
        self.max_message_bytes = max_message_bytes
        self.auth = auth
        self._peer_of: dict[asyncio.StreamWriter, str] = {}  # the authenticated peer at each connection's end
        self._session: Optional[aiohttp.ClientSession] = None
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self.paths = None  # paths.Paths: how to open a connection to a peer that cannot be dialed

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        return self._session

    def _headers(self) -> Optional[dict]:
        """A closed swarm's pages take its operator token (read per request: a grouped swarm's is
        known only once the group key is)."""
        token = self.auth.operator_token if self.auth is not None else None
        return {"Authorization": f"Bearer {token}"} if token else None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._idle.clear()
        self._peer_of.clear()
        writers, self._writers = self._writers, set()
        for w in writers:
            w.close()
        for w in writers:
            with contextlib.suppress(Exception):
                await w.wait_closed()

    async def _connection(self, addr: tuple[str, int], want: Optional[str]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An open connection to ``addr`` (authenticated, and to peer ``want``: when not given, the
        peer whose record serves at ``addr``, where one does: a client always names whom it dials)."""
        if want is None and self.paths is not None and self.auth is not None:
            want = self.paths.peer_at(addr)
        idle = self._idle.get(addr, [])
        while idle:
            reader, writer = idle.pop()
            if not (reader.at_eof() or writer.is_closing()) and (want is None or self._peer_of.get(writer) == want):
                return reader, writer
            self._discard(writer)  # the other side closed it while it waited (or another peer lives there now)
        if self.paths is not None:
            reader, writer = await self.paths.open(addr, want)
        else:
            reader, writer = await asyncio.open_connection(*addr, limit=1 << 20)
        return await self.authenticate(reader, writer, want, dialed=addr)

    async def authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           want: Optional[str], dialed: Optional[tuple[str, int]] = None,
                           ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Runs the client's handshake over a fresh connection (whichever way it was opened; ``dialed``:
        the address it was dialed to, where it was)."""
        self._writers.add(writer)
        if self.auth is not None:
            try:
                session = await asyncio.wait_for(self.auth.client(reader, writer, want, dialed), handshake.TIMEOUT_S)
            except BaseException:
                self._discard(writer)
                raise
            if session.encrypted:
                self._writers.discard(writer)
                reader, writer = secure.SecureReader(reader, session.recv_key), secure.SecureWriter(writer, session.send_key)
                self._writers.add(writer)
            self._peer_of[writer] = session.peer_id
        writer.transport.set_write_buffer_limits(0)  # drain() waits until the socket took it all
        return reader, writer

    async def hello(self, url: str, peer_id: Optional[str] = None, timeout: float = handshake.TIMEOUT_S) -> Optional[str]:
        """Opens an authenticated connection to ``url`` (kept for later messages) and returns the
        peer at its end (None without an ``Authenticator``); ``HandshakeError`` with the reason if
        that peer refuses us or is not ``peer_id``."""
        addr = address_of(url)
        async with self._slots:
            conn = await asyncio.wait_for(self._connection(addr, peer_id), timeout)
            self._release(addr, conn)
            return self._peer_of.get(conn[1])

    def _discard(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        self._peer_of.pop(writer, None)
        writer.close()

    def _release(self, addr: tuple[str, int], conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self.MAX_IDLE_PER_DESTINATION and conn[1] in self._writers:
            idle.append(conn)
        else:
            self._discard(conn[1])

    async def send(
        self, url: str, kind: str, header: dict, buffers: Sequence[bytes | memoryview] = (), timeout: float = 30.0,
        link=None, compensate: bool = True, charge: float = 1.0,
        on_sent: Optional[Callable[[Optional[float]], None]] = None,
        reply_charge: float = 1.0, peer_id: Optional[str] = None, on_start: Optional[Callable[[], None]] = None,
    ) -> tuple[dict, list[memoryview]] | None:
        """Sends one frame; the reply frame, or None if the peer had nothing to say. A refusal raises
        ``RemoteError``; a peer that cannot be reached or breaks the connection, ``OSError``.

        ``link`` (an ``emulator.EmulatedLink``) shapes the exchange like a wide-area link: the body
        leaves at the link's rate after its delay, the reply comes back likewise. ``timeout`` bounds
        the whole exchange, emulated time included. ``compensate=False`` keeps the real loopback
        transport's own round trip on top of the emulated one (the emulator leaves it out by default):
        for a caller that takes off a baseline of its own, like the prober's paired pings.
        ``charge``: emulated bytes per real byte of ``buffers`` on ``link`` (a proxy's tensor standing
        for a workload's, ``emulator.EmulatedLink.paced``); the frame's header counts at its own size,
        as a workload's message carries the same header.
        ``reply_charge``: the same for the reply (a layer copy fetched on recovery).
        ``peer_id``: the peer meant to be at ``url``; the handshake fails (``HandshakeError``, a
        ConnectionError) if another is.
        ``on_sent(held_s)``: called once the request's last byte has left (on an emulated link: passed
        its bandwidth, before its delay), where a caller streaming messages in order may start the next;
        ``held_s``: on an emulated link, the seconds the request's bytes held it, as the link scheduled
        them (``EmulatedLink.paced``: what a caller timing the link reads, not its own wake-ups), else None.
        ``on_start()``: called once a connection is ready, before the request's first byte: the time
        before it (a free slot, a new connection and its handshake) is not the link's.
        """
        addr = address_of(url)
        name = kind.encode("ascii")
        if not 0 < len(name) <= MAX_KIND_BYTES:
            raise ValueError(f"message kind must be 1-{MAX_KIND_BYTES} ASCII bytes, not {kind!r}")
        chunks = framing.encode(header, buffers)
        size = framing.frame_size(chunks)
        if charge != 1.0 and size:  # per byte of the whole frame: the header is not scaled
            body = size - memoryview(chunks[0]).nbytes
            charge = (body * charge + size - body) / size
        straight = link is not None and link.transparent(charge)  # (a link that could not slow it: not paced)
        ex = link.exchange(compensate, charge, on_sent) if link is not None and not straight else None

        async def exchange():
            async with self._slots:
                conn = await self._connection(addr, peer_id)
                reader, writer = conn
                reusable = False
                if on_start is not None:
                    on_start()
                # a paced body watches for a refusal while it goes out; a straight one is written whole first
                answer = asyncio.ensure_future(reader.readexactly(ANSWER.size)) if ex is not None else None
                try:
                    head = REQUEST.pack(REQUEST_MAGIC, len(name), size) + name
                    sent = 0
                    if ex is None:
                        # the request's head and the frame's first chunks up to SMALL_BYTES in one
                        # write (one record when encrypted), then the rest uncopied
                        k, joined = 0, len(head)
                        while k < len(chunks) and joined + (n := memoryview(chunks[k]).nbytes) <= SMALL_BYTES:
                            joined += n
                            k += 1
                        writer.write(b"".join([head, *chunks[:k]]))
                        for c in chunks[k:]:
                            v = memoryview(c).cast("B")
                            for i in range(0, v.nbytes, PIECE_BYTES):
                                writer.write(v[i:i + PIECE_BYTES])
                                await writer.drain()
                        await writer.drain()
                        sent = size
                    else:  # the head goes with the first paced piece, as one segment when small
                        async with contextlib.aclosing(ex.body(chunks)) as paced:
                            async for c in paced:
                                if answer.done():
                                    break
                                n = memoryview(c).nbytes
                                if head and n <= SMALL_BYTES:
                                    writer.write(b"".join([head, c]))
                                else:
                                    if head:
                                        writer.write(head)
                                    writer.write(c)
                                head = b""
                                sent += n
                                await writer.drain()
                    if ex is None and on_sent is not None:
                        on_sent(None)
                    magic, status, length = ANSWER.unpack(
                        await (answer if answer is not None else reader.readexactly(ANSWER.size)))
                    if magic != ANSWER_MAGIC:
                        raise ConnectionError(f"{url} does not answer like a data plane")
                    if ex:
                        ex.reply_started()
                    if length > self.max_message_bytes:
                        raise RemoteError(413, f"reply of {length} bytes is over our limit")
                    body = await read_exactly(reader, length)
                    reusable = sent == size
                except asyncio.IncompleteReadError:
                    raise ConnectionResetError(f"{url} closed the connection before it answered") from None
                finally:
                    if answer is not None:
                        answer.cancel()
                    if reusable:
                        self._release(addr, conn)
                    else:
                        self._discard(writer)
            if status == 204:
                reply, size_back = None, 0
            elif status == 200:
                reply, size_back = framing.decode(body, self.max_message_bytes), len(body)
            else:
                raise RemoteError(status, body[:500].decode("utf-8", "replace"))
            if ex:
                await ex.reply_done(int(size_back * reply_charge))
            elif straight:
                link.count(int(size * charge), int(size_back * reply_charge))
            return reply

        async with asyncio.timeout(timeout):  # (not ``wait_for``: no task of its own for each message)
            return await exchange()

    async def open_lane(self, url: str, kind: str, header: dict, peer_id: str,
                        timeout: float = handshake.TIMEOUT_S) -> Optional[socket.socket]:
        """A lane to ``peer_id`` at ``url`` (``lanes``): a connection of its own, authenticated, asked
        for with a ``kind`` request carrying ``header``, and once answered taken off the event loop:
        its socket, blocking, for a thread to write. None where no lane can be: a connection that is
        encrypted (it leaves this machine) or not a plain TCP one (a relayed path). A refusal raises
        ``RemoteError`` (503: not yet; 409: the peer takes no lane from us), a broken connection
        ``OSError``."""
        addr = address_of(url)
        name = kind.encode("ascii")
        chunks = framing.encode(header)
        async with self._slots, asyncio.timeout(timeout):
            if self.paths is not None:
                reader, writer = await self.paths.open(addr, peer_id)
            else:
                reader, writer = await asyncio.open_connection(*addr, limit=1 << 20)
            reader, writer = await self.authenticate(reader, writer, peer_id, dialed=addr)
            taken = False
            try:
                raw = writer.transport.get_extra_info("socket")
                if isinstance(writer, secure.SecureWriter) or raw is None or raw.family not in (socket.AF_INET, socket.AF_INET6):
                    return None
                writer.write(REQUEST.pack(REQUEST_MAGIC, len(name), framing.frame_size(chunks)) + name + b"".join(chunks))
                await writer.drain()
                magic, status, length = ANSWER.unpack(await reader.readexactly(ANSWER.size))
                if magic != ANSWER_MAGIC:
                    raise ConnectionError(f"{url} does not answer like a data plane")
                if length > self.max_message_bytes:
                    raise RemoteError(413, f"reply of {length} bytes is over our limit")
                body = await read_exactly(reader, length)
                if status != 204:
                    raise RemoteError(status, body[:500].decode("utf-8", "replace"))
                sock = socket.socket(fileno=os.dup(raw.fileno()))
                taken = True
                writer.transport.abort()  # (its descriptor closed: the connection lives on in ``sock``)
                self._writers.discard(writer)
                self._peer_of.pop(writer, None)
                sock.setblocking(True)
                return sock
            except asyncio.IncompleteReadError:
                raise ConnectionResetError(f"{url} closed the connection before it answered") from None
            finally:
                if not taken:
                    self._discard(writer)

    async def get_json(self, url: str, path: str, max_bytes: int, timeout: float) -> dict:
        """``GET url+path`` as a JSON object, refused past ``max_bytes`` (a page from another peer is
        untrusted: ValueError when too large or not an object). A peer that cannot be dialed (behind
        NAT) is asked over the path the data plane takes to it (a ``page`` message)."""
        if self.paths is not None and self.paths.indirect(url):
            return await self._page(url, path, max_bytes, timeout)
        async with self._get_session().get(f"{url}{path}", headers=self._headers(),
                                           timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            body = await resp.content.read(max_bytes + 1)
            return _json_object(body, path, max_bytes)

    async def status(self, url: str, timeout: float = 5.0, path: str = "/status") -> dict:
        if self.paths is not None and self.paths.indirect(url):
            return await self._page(url, path, self.max_message_bytes, timeout)
        async with self._get_session().get(f"{url}{path}", headers=self._headers(),
                                           timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            return json.loads(await resp.text())

    async def _page(self, url: str, path: str, max_bytes: int, timeout: float) -> dict:
        reply = await self.send(url, PAGE_KIND, {"path": path}, timeout=timeout)
        if reply is None or len(reply[1]) != 1:
            raise ValueError(f"{path}: not a page")
        return _json_object(bytes(reply[1][0]), path, max_bytes)


def _json_object(body: bytes, path: str, max_bytes: int) -> dict:
    if len(body) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes")
    d = json.loads(body)
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a JSON object")
    return d


async def read_exactly(reader: asyncio.StreamReader, n: int) -> bytearray:
    """``n`` bytes into one writable buffer (frames decoded from it give tensors their own memory)."""
    body = bytearray(n)
    view, got = memoryview(body), 0
    while got < n:
        chunk = await reader.read(min(n - got, 1 << 20))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:got]), n)
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return body
