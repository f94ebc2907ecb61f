"""The data plane: a server per peer for bulk traffic, and its client.

Two ways in on one port, told apart by a connection's first four bytes:
- **framed TCP** (what ``DataPlaneClient.send`` speaks): a request is ``b"STQ1"``, the kind's length
  (1 byte), the frame's length (8 bytes, big-endian), the kind (ASCII), then the frame (see
  ``framing``); the answer is ``b"STR1"``, a status (2 bytes, HTTP's codes), the body's length (8
  bytes), then the body: the reply frame (200), nothing (204), or the reason in UTF-8. One request at a
  time per connection; the client keeps connections open for the next. The server receives a frame
  straight into the buffer its tensors are then decoded from (``asyncio.BufferedProtocol``: no copy
  between the socket and the tensor), which moves about twice what HTTP did on loopback;
- **HTTP** (aiohttp): ``POST /msg/{kind}`` carries the same frame, for any HTTP client;
  ``GET /status`` (and other JSON pages) report the peer.
Both go through the same handlers and limits: a frame over the size limit gets 413 with the reason
(the framed server answers before the body has come, then drops it), a malformed frame 400, an
unknown kind 404, a handler that cannot take it yet 503, a handler that fails 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import struct
from typing import Any, Awaitable, Callable, Optional, Sequence
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from . import framing

log = logging.getLogger(__name__)

Reply = Optional[tuple[dict, Sequence[bytes | memoryview]]]
Handler = Callable[[dict, list[memoryview]], Awaitable[Reply]]

REQUEST = struct.Struct(">4sBQ")  # magic, kind length, frame length
ANSWER = struct.Struct(">4sHQ")  # magic, status, body length
REQUEST_MAGIC, ANSWER_MAGIC = b"STQ1", b"STR1"
MAX_KIND_BYTES = 64
# at most this much is received in one go: copying several MiB at once holds the event loop (and the
# pings and emulated delays it times) for a millisecond or more; asyncio's own reads take 256 KiB
_RECV_BYTES = 256 << 10
_PIECE_BYTES = 1 << 22  # a big buffer goes out in pieces, each once the socket took the last
_SMALL_BYTES = 64 << 10  # a message or answer up to this size goes out in one write


class Retry(Exception):
    """Raised by a handler that cannot take the message yet (e.g. it has no stage map): 503."""


class RemoteError(RuntimeError):
    """The other peer refused a message; ``status`` is the HTTP code, the message its reason."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


class DataPlaneServer:
    def __init__(
        self,
        host: str,
        port: int,
        status: Callable[[], dict],
        max_message_bytes: int = framing.DEFAULT_MAX_MESSAGE_BYTES,
    ):
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self._handlers: dict[str, Handler] = {}
        self._json_gets: dict[str, Callable[[], dict]] = {"/status": status}
        self._gets: dict[str, Callable[[], tuple[bytes, str]]] = {}
        self._async_json_gets: dict[str, Callable[[], Awaitable[dict]]] = {}
        self._runner: Optional[web.AppRunner] = None
        self._listener: Optional[asyncio.AbstractServer] = None
        self._framed: set["_FramedConnection"] = set()
        self._tasks: set[asyncio.Task] = set()
        self._scratch = bytearray(_RECV_BYTES)  # where the framed server drops the body of a refused message

    def register(self, kind: str, handler: Handler) -> None:
        self._handlers[kind] = handler

    def add_json_get(self, path: str, fn: Callable[[], dict]) -> None:
        """Serves ``GET path`` with the JSON ``fn()`` returns (before start)."""
        self._json_gets[path] = fn

    def add_get(self, path: str, fn: Callable[[], tuple[bytes, str]]) -> None:
        """Serves ``GET path`` with the body and content type ``fn()`` returns (before start)."""
        self._gets[path] = fn

    def add_async_json_get(self, path: str, fn: Callable[[], Awaitable[dict]]) -> None:
        """Serves ``GET path`` with the JSON ``await fn()`` returns (non-finite numbers as null)."""
        self._async_json_gets[path] = fn

    def local_json(self, path: str) -> Optional[dict]:
        """What ``GET path`` of this server answers, without a request (None: no such page)."""
        fn = self._json_gets.get(path)
        return fn() if fn is not None else None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_message_bytes)
        for path, fn in self._json_gets.items():
            app.router.add_get(path, self._json_handler(fn))
        for path, raw in self._gets.items():
            app.router.add_get(path, self._raw_handler(raw))
        for path, afn in self._async_json_gets.items():
            app.router.add_get(path, self._async_json_handler(afn))
        app.router.add_post("/msg/{kind}", self._post_msg)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        http = self._runner.server
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                lambda: _FirstBytes(self, http), self.host, self.port, reuse_address=False)
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            raise OSError(e.errno, f"data plane cannot listen on {self.host}:{self.port}: {e.strerror}") from None
        self.port = self._listener.sockets[0].getsockname()[1]  # the real port when 0 was asked for

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._framed):
            conn.transport.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    def _json_handler(fn: Callable[[], dict]):
        async def handle(request: web.Request) -> web.Response:
            return web.json_response(fn())

        return handle

    @staticmethod
    def _async_json_handler(fn: Callable[[], Awaitable[dict]]):
        async def handle(request: web.Request) -> web.Response:
            return web.Response(body=json.dumps(_finite(await fn())).encode(), content_type="application/json")

        return handle

    @staticmethod
    def _raw_handler(fn: Callable[[], tuple[bytes, str]]):
        async def handle(request: web.Request) -> web.Response:
            body, content_type = fn()
            return web.Response(body=body, headers={"Content-Type": content_type})

        return handle

    def _refusal(self, kind: str, length: Optional[int]) -> Optional[tuple[int, str]]:
        """(status, reason) for a message refused before its body is read, else None."""
        if kind not in self._handlers:
            return 404, f"no handler for message kind {kind!r}"
        if length is not None and length > self.max_message_bytes:
            return 413, f"message of {length} bytes is over this peer's limit of {self.max_message_bytes}"
        return None

    async def _dispatch(self, kind: str, body: bytearray) -> tuple[int, "str | list[bytes | memoryview]"]:
        """Decodes a whole frame and runs its kind's handler: (status, reason or reply chunks)."""
        try:
            header, buffers = framing.decode(body, self.max_message_bytes)
            reply = await self._handlers[kind](header, buffers)
        except framing.FrameError as e:
            log.warning("rejected %s message: %s", kind, e)
            return 400, str(e)
        except Retry as e:
            return 503, str(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a handler's bug: the sender hears of it, this peer carries on
            log.exception("handler of %s messages failed", kind)
            return 500, f"the {kind} handler failed: {type(e).__name__}: {e}"[:500]
        if reply is None:
            return 204, ""
        return 200, framing.encode(*reply)

    async def _read_body(self, request: web.Request, length: Optional[int]) -> bytearray:
        """The whole body, received straight into one buffer of its announced length (no regrowing
        and no final copy, unlike ``request.read()``); the buffers decoded from it are writable views
        a tensor can own without another copy."""
        if length is None:
            return bytearray(await request.read())
        body = bytearray(length)
        view, got = memoryview(body), 0
        while got < length:
            chunk = await request.content.readany()
            if not chunk:
                raise framing.FrameError(f"message ended after {got} of its {length} bytes")
            if got + len(chunk) > length:
                raise framing.FrameError(f"message is longer than its announced {length} bytes")
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        return body

    async def _post_msg(self, request: web.Request) -> web.StreamResponse:
        kind = request.match_info["kind"]
        refused = self._refusal(kind, request.content_length)
        if refused is not None:
            return web.Response(status=refused[0], text=refused[1])
        try:
            body = await self._read_body(request, request.content_length)
        except web.HTTPRequestEntityTooLarge:
            return web.Response(
                status=413, text=f"message is over this peer's limit of {self.max_message_bytes} bytes"
            )
        except framing.FrameError as e:
            return web.Response(status=400, text=str(e))
        status, out = await self._dispatch(kind, body)
        if isinstance(out, str):
            return web.Response(status=status, text=out) if out else web.Response(status=status)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-spantrain-frame"})
        resp.content_length = framing.frame_size(out)
        await resp.prepare(request)
        for c in out:
            await resp.write(c)
        await resp.write_eof()
        return resp


class _FirstBytes(asyncio.BufferedProtocol):
    """A new connection's first four bytes say who it is for: the framed-TCP server or aiohttp's."""

    def __init__(self, server: DataPlaneServer, http: Callable[[], asyncio.Protocol]):
        self.server, self.http = server, http
        self.head, self.got = bytearray(len(REQUEST_MAGIC)), 0
        self.transport: Optional[asyncio.Transport] = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.head)[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got < len(self.head):
            return
        if self.head == REQUEST_MAGIC:
            conn = _FramedConnection(self.server, self.transport)
            self.transport.set_protocol(conn)
            conn.buffer_updated(conn.take(self.head))
        else:
            proto = self.http()
            self.transport.set_protocol(proto)
            proto.connection_made(self.transport)
            proto.data_received(bytes(self.head))

    def eof_received(self) -> None:
        return None  # closes the transport

    def connection_lost(self, exc: Optional[Exception]) -> None:
        pass


class _FramedConnection(asyncio.BufferedProtocol):
    """One client's connection to the framed-TCP server (see the module docstring): reads the
    request's fixed part, its kind, then its frame straight into a buffer of the announced size; runs
    the handler with reading paused (a request at a time), answers, and waits for the next. A kind or
    size refused up front is answered at once and its body dropped; a connection that breaks the
    protocol is answered 400 and closed."""

    def __init__(self, server: DataPlaneServer, transport: asyncio.Transport):
        self.server, self.transport = server, transport
        server._framed.add(self)
        self._expect_request()

    def _expect_request(self) -> None:
        self._stage = "request"
        self._buf = bytearray(REQUEST.size)
        self._want = memoryview(self._buf)
        self._drop = 0  # body bytes of a refused message still to come

    def take(self, data: bytes | bytearray) -> int:
        """Copies bytes read before this protocol took over into its buffer; returns their count."""
        self._want[: len(data)] = data
        return len(data)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._drop:
            return memoryview(self.server._scratch)[: min(self._drop, _RECV_BYTES)]
        return self._want[:_RECV_BYTES]

    def buffer_updated(self, nbytes: int) -> None:
        if self._stage == "closing":
            return
        if self._drop:
            self._drop -= nbytes
            if not self._drop:
                self._expect_request()
            return
        if self._stage == "busy":  # the client sent more before its answer: not this protocol
            self._fail("a second request arrived before the first was answered")
            return
        self._want = self._want[nbytes:]
        if self._want.nbytes:
            return
        if self._stage == "request":
            magic, kind_len, length = REQUEST.unpack(self._buf)
            if magic != REQUEST_MAGIC or not 0 < kind_len <= MAX_KIND_BYTES:
                self._fail("not a data-plane request (bad magic or kind length)")
                return
            self._length = length
            self._stage, self._buf = "kind", bytearray(kind_len)
            self._want = memoryview(self._buf)
        elif self._stage == "kind":
            try:
                self._kind = self._buf.decode("ascii")
            except UnicodeDecodeError:
                self._fail("message kind is not ASCII")
                return
            refused = self.server._refusal(self._kind, self._length)
            if refused is not None:
                self._answer(*refused)
                self._drop = self._length
                if not self._drop:
                    self._expect_request()
                return
            self._stage, self._buf = "body", bytearray(self._length)
            self._want = memoryview(self._buf)
            if not self._length:
                self._run()
        else:
            self._run()

    def _run(self) -> None:
        self._stage = "busy"
        self.transport.pause_reading()
        task = asyncio.get_running_loop().create_task(self._handle(self._kind, self._buf))
        self.server._tasks.add(task)
        task.add_done_callback(self.server._tasks.discard)

    async def _handle(self, kind: str, body: bytearray) -> None:
        status, out = await self.server._dispatch(kind, body)
        if self.transport.is_closing():
            return
        if isinstance(out, str):
            self._answer(status, out)
        else:
            size = framing.frame_size(out)
            head = ANSWER.pack(ANSWER_MAGIC, status, size)
            if size <= _SMALL_BYTES:
                self.transport.write(b"".join([head, *out]))
            else:
                self.transport.write(head)
                for c in out:
                    self.transport.write(c)
        self._expect_request()
        self.transport.resume_reading()

    def _answer(self, status: int, reason: str) -> None:
        text = reason.encode("utf-8")[:4096]
        self.transport.write(ANSWER.pack(ANSWER_MAGIC, status, len(text)) + text)

    def _fail(self, reason: str) -> None:
        """Answers 400 and ends our side; what the client still sends is dropped until it closes
        (closing with unread bytes would reset the connection, and the answer could be lost)."""
        log.warning("data-plane connection closed: %s", reason)
        self._answer(400, reason)
        self._stage, self._drop = "closing", 1 << 62
        self.transport.write_eof()
        self.transport.resume_reading()

    def eof_received(self) -> None:
        return None  # closes the transport

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.server._framed.discard(self)


class DataPlaneClient:
    """All outgoing data-plane traffic of a peer: messages over framed TCP (connections kept open
    per destination, at most ``max_connections`` at once), JSON pages over one pooled HTTP session."""

    MAX_IDLE_PER_DESTINATION = 8

    def __init__(self, max_message_bytes: int = framing.DEFAULT_MAX_MESSAGE_BYTES, max_connections: int = 64):
        self.max_message_bytes = max_message_bytes
        self._session: Optional[aiohttp.ClientSession] = None
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._writers: set[asyncio.StreamWriter] = set()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._idle.clear()
        writers, self._writers = self._writers, set()
        for w in writers:
            w.close()
        for w in writers:
            with contextlib.suppress(Exception):
                await w.wait_closed()

    @staticmethod
    def _address(url: str) -> tuple[str, int]:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname or u.port is None:
            raise ValueError(f"not a data-plane address: {url!r} (want http://HOST:PORT)")
        return u.hostname, u.port

    async def _connection(self, addr: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.get(addr, [])
        while idle:
            reader, writer = idle.pop()
            if not (reader.at_eof() or writer.is_closing()):
                return reader, writer
            self._discard(writer)  # the other side closed it while it waited
        reader, writer = await asyncio.open_connection(*addr, limit=1 << 20)
        writer.transport.set_write_buffer_limits(0)  # drain() waits until the socket took it all
        self._writers.add(writer)
        return reader, writer

    def _discard(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        writer.close()

    def _release(self, addr: tuple[str, int], conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self.MAX_IDLE_PER_DESTINATION and conn[1] in self._writers:
            idle.append(conn)
        else:
            self._discard(conn[1])

    async def send(
        self, url: str, kind: str, header: dict, buffers: Sequence[bytes | memoryview] = (), timeout: float = 30.0,
        link=None, compensate: bool = True, charge: float = 1.0, on_sent: Optional[Callable[[], None]] = None,
        reply_charge: float = 1.0,
    ) -> tuple[dict, list[memoryview]] | None:
        """Sends one frame; the reply frame, or None if the peer had nothing to say. A refusal raises
        ``RemoteError``; a peer that cannot be reached or breaks the connection, ``OSError``.

        ``link`` (an ``emulator.EmulatedLink``) shapes the exchange like a wide-area link: the body
        leaves at the link's rate after its delay, the reply comes back likewise. ``timeout`` bounds
        the whole exchange, emulated time included. ``compensate=False`` keeps the real loopback
        transport's own round trip on top of the emulated one (the emulator leaves it out by default):
        for a caller that takes off a baseline of its own, like the prober's paired pings.
        ``charge``: emulated bytes per real byte on ``link`` (``emulator.EmulatedLink.paced``).
        ``reply_charge``: the same for the reply (a layer copy fetched on recovery).
        ``on_sent()``: called once the request's last byte has left (on an emulated link: passed its
        bandwidth, before its delay), where a caller streaming messages in order may start the next.
        """
        addr = self._address(url)
        name = kind.encode("ascii")
        if not 0 < len(name) <= MAX_KIND_BYTES:
            raise ValueError(f"message kind must be 1-{MAX_KIND_BYTES} ASCII bytes, not {kind!r}")
        chunks = framing.encode(header, buffers)
        size = framing.frame_size(chunks)
        ex = link.exchange(compensate, charge, on_sent) if link is not None else None

        async def exchange():
            async with self._slots:
                conn = await self._connection(addr)
                reader, writer = conn
                reusable = False
                answer = asyncio.ensure_future(reader.readexactly(ANSWER.size))  # a refusal may come early
                try:
                    head = REQUEST.pack(REQUEST_MAGIC, len(name), size) + name
                    sent = 0
                    if ex is None and size <= _SMALL_BYTES:  # one segment: the peer reads it in one go
                        writer.write(b"".join([head, *chunks]))
                        sent = size
                        await writer.drain()
                    elif ex is None:
                        writer.write(head)
                        for c in chunks:
                            v = memoryview(c).cast("B")
                            for i in range(0, v.nbytes, _PIECE_BYTES):
                                writer.write(v[i:i + _PIECE_BYTES])
                                await writer.drain()
                            sent += v.nbytes
                    else:  # the head goes with the first paced piece, as one segment when small
                        async with contextlib.aclosing(ex.body(chunks)) as paced:
                            async for c in paced:
                                if answer.done():
                                    break
                                n = memoryview(c).nbytes
                                if head and n <= _SMALL_BYTES:
                                    writer.write(b"".join([head, c]))
                                else:
                                    if head:
                                        writer.write(head)
                                    writer.write(c)
                                head = b""
                                sent += n
                                await writer.drain()
                    if ex is None and on_sent is not None:
                        on_sent()
                    magic, status, length = ANSWER.unpack(await answer)
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
            return reply

        return await asyncio.wait_for(exchange(), timeout)

    async def get_json(self, url: str, path: str, max_bytes: int, timeout: float) -> dict:
        """``GET url+path`` as a JSON object, refused past ``max_bytes`` (a page from another peer is
        untrusted: ValueError when too large or not an object)."""
        async with self._get_session().get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            body = await resp.content.read(max_bytes + 1)
            if len(body) > max_bytes:
                raise ValueError(f"{path} is larger than {max_bytes} bytes")
            d = json.loads(body)
            if not isinstance(d, dict):
                raise ValueError(f"{path} is not a JSON object")
            return d

    async def status(self, url: str, timeout: float = 5.0, path: str = "/status") -> dict:
        async with self._get_session().get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            return json.loads(await resp.text())


def _finite(x: Any) -> Any:
    """``x`` with every NaN or infinity as None (JSON has neither; browsers refuse them)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


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
