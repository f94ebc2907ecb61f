"""The data-plane server's side of one connection, from its first byte to its last.

A connection's first four bytes say what it is: ``b"STH1"`` a handshake (``handshake``), after which
the connection carries framed requests from the peer it authenticated; ``b"STQ1"`` framed requests
without one (only on a server that has no ``Authenticator``: tests and the raw benchmark); anything
else HTTP, handed to aiohttp. Everything is bounded (``budget``): connections still in their first
bytes or handshake share a small pool and a deadline; a frame's bytes are reserved on announcement
within the budget, and a frame of 64 KiB or more is received into uninitialised memory (``numpy.empty``:
malloc without the zeroing a bytearray does: every byte is written by the socket or the decryption
before it is read, a large frame's pages are taken only as they are written, and a freed buffer's
serve the next frame without faulting again); a frame that stops
arriving closes its connection after ``stall_timeout_s``.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
import time
from typing import Any, Callable, Optional

import numpy

from . import framing, handshake, secure
from .addresses import host_of
from .handshake import HandshakeError, Session
from .preambles import Preamble
from .wire import ANSWER, ANSWER_MAGIC, MAX_KIND_BYTES, RECV_BYTES, REQUEST, REQUEST_MAGIC, SMALL_BYTES

Server = Any  # a dataplane.DataPlaneServer (which imports this module)

log = logging.getLogger("spantrain_p2p.net.dataplane")
# (host, port) a request being handled came from, as this peer sees it (a NAT's public side, say)
REMOTE: contextvars.ContextVar = contextvars.ContextVar("remote", default=None)
# (unix time the first byte of the request being handled came, and its frame was whole), for an inline
# handler (``DataPlaneServer.register(..., inline=True)``): how a pipeline's tensor came in (issue 31)
ARRIVED: contextvars.ContextVar = contextvars.ContextVar("arrived", default=None)
MAX_UNSENT_BYTES = 1 << 20  # answers a client leaves unread (beyond the kernel's buffers) before it is cut off
TAIL_BYTES = 64 << 10  # a frame's rest up to this much over a read's cap is read with it (``get_buffer``)
LAZY_BYTES = 64 << 10  # frames from this size are received into memory not zeroed first (a pipeline's
# 256 KiB tensor: 0.9 us to allocate, against 8.6 us for a bytearray that zeroes it)


def frame_buffer(n: int) -> bytearray | numpy.ndarray:
    """A writable buffer of ``n`` bytes whose memory is taken as it is written."""
    return numpy.empty(n, numpy.uint8) if n >= LAZY_BYTES else bytearray(n)


def _answer_bytes(status: int, reason: str) -> bytes:
    text = reason.encode("utf-8")[:4096]
    return ANSWER.pack(ANSWER_MAGIC, status, len(text)) + text


class FirstBytes(asyncio.BufferedProtocol):
    """Reads a new connection's first four bytes, then hands it to the protocol they name."""

    def __init__(self, server: Server, http: Callable[[], asyncio.Protocol]):
        self.server, self.http = server, http
        self.head, self.got = bytearray(4), 0
        self.transport: Optional[asyncio.Transport] = None
        self._counted = False
        self._timer: Optional[asyncio.TimerHandle] = None
        self.addr = ""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.addr = host_of(transport.get_extra_info("peername"))
        refused = self.server.budget.begin_handshake(self.addr)
        if refused:
            self.server.quiet.warning(log, self.addr, "refused a data-plane connection: %s", refused)
            transport.write(_answer_bytes(503, refused))
            transport.close()
            return
        self._counted = True
        self._timer = asyncio.get_running_loop().call_later(
            self.server.budget.limits.handshake_timeout_s, self._too_slow)

    def _too_slow(self) -> None:
        self.server.quiet.warning(log, self.addr, "closed a data-plane connection from %s that did not say what it is in time",
                                  self.addr or "an unknown address")
        self.transport.close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.server.budget.end_handshake(self.addr)
        if self._timer is not None:
            self._timer.cancel()

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.head)[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got < len(self.head):
            return
        auth = self.server.auth
        if self.head == handshake.MAGIC and auth is not None:
            self._timer.cancel()  # the handshake keeps the pool's place and has its own deadline
            proto = Handshaking(self.server, self.transport, bytes(self.head), self._counted, self.addr)
            self._counted = False
            self.transport.set_protocol(proto)
        elif self.head == REQUEST_MAGIC and auth is None:
            self._uncount()
            conn = FramedConnection(self.server, self.transport, None)
            self.transport.set_protocol(conn)
            conn.buffer_updated(conn.take(self.head))
        elif bytes(self.head) in self.server.preambles:
            self._timer.cancel()  # the preamble keeps the pool's place and has its own deadline
            counted, self._counted = self._counted, False
            need, done = self.server.preambles[bytes(self.head)]
            addr, budget = self.addr, self.server.budget
            self.transport.set_protocol(Preamble(self.transport, need, done,
                                                 (lambda: budget.end_handshake(addr)) if counted else lambda: None))
        elif self.head in (REQUEST_MAGIC, handshake.MAGIC):
            self._uncount()
            what = "authenticated connections only (handshake first)" if auth else "no handshake (it has no identity)"
            self.transport.write(_answer_bytes(401, f"this peer takes messages on {what}"))
            self.transport.close()
        else:
            self._uncount()
            proto = self.http()
            self.transport.set_protocol(proto)
            proto.connection_made(self.transport)
            proto.data_received(bytes(self.head))

    def eof_received(self) -> None:
        return None  # closes the transport

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._uncount()


class Handshaking(asyncio.Protocol):
    """The server's side of a handshake; on success the connection becomes a ``FramedConnection``
    bound to the authenticated peer. Any failure answers ``{error}`` and closes."""

    def __init__(self, server: Server, transport: asyncio.Transport, head: bytes, counted: bool, addr: str = ""):
        self.server, self.transport, self.addr = server, transport, addr
        self.buf = bytearray(head)
        self.pending: Optional[handshake.Pending] = None
        self._counted = counted
        self._timer = asyncio.get_running_loop().call_later(server.budget.limits.handshake_timeout_s, self._too_slow)

    def _too_slow(self) -> None:
        self._fail("the handshake took too long")

    def _done(self) -> None:
        if self._counted:
            self._counted = False
            self.server.budget.end_handshake(self.addr)
        self._timer.cancel()

    def _fail(self, reason: str) -> None:
        self.server.quiet.warning(log, self.addr, "data-plane handshake failed: %s", reason)
        self._done()
        if not self.transport.is_closing():
            self.transport.write(handshake.pack({"error": reason[:500]}))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        self.buf += data
        try:
            if len(self.buf) < handshake.PREFIX_BYTES:
                return
            n = handshake.message_length(bytes(self.buf[: handshake.PREFIX_BYTES]))
            end = handshake.PREFIX_BYTES + n
            if len(self.buf) < end:
                return
            message, self.buf = bytes(self.buf[:end]), self.buf[end:]
            auth = self.server.auth
            if self.pending is None:
                refused = self.server.budget.handshake_allowed(self.addr)  # before any RSA work
                if refused:
                    raise HandshakeError(refused)
                answer, self.pending = auth.server_hello(message, self.transport.get_extra_info("peername"))
                self.transport.write(answer)
            else:
                if self.buf:
                    raise HandshakeError("data after the handshake's last message")
                session = auth.server_finish(self.pending, handshake.unpack_map(message[handshake.PREFIX_BYTES:]))
                self._accept(session)
                return
        except HandshakeError as e:
            self._fail(str(e))
            return
        except Exception as e:  # a bug must not leave a half-open connection behind
            log.exception("handshake failed")
            self._fail(f"{type(e).__name__}")
            return
        if self.buf:
            self.data_received(b"")

    def _accept(self, session: Session) -> None:
        self._done()
        refused = self.server.budget.connect(session.peer_id, self.addr, self.server.is_member(session.peer_id))
        if refused:
            self._fail(refused)
            return
        self.transport.write(handshake.pack({"ok": True}))
        if session.encrypted:
            outer = secure.SecureProtocol(self.transport, session.recv_key)
            outer.inner = FramedConnection(self.server, secure.SecureWriter(self.transport, session.send_key), session)
            self.transport.set_protocol(outer)
        else:
            self.transport.set_protocol(FramedConnection(self.server, self.transport, session))

    def eof_received(self) -> None:
        return None

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._done()


class FramedConnection(asyncio.BufferedProtocol):
    """One client's connection to the framed-TCP server (see ``wire``): reads the request's fixed
    part, its kind, then its frame straight into a buffer of the announced size; runs the handler
    (an async one with reading paused, a request at a time; a plain one, ``inline``, at once, the
    connection cut if the client leaves over ``MAX_UNSENT_BYTES`` of answers unread), answers, and
    waits for the next; reading waits while the transport holds too many unsent bytes. A kind or size
    refused up front (or over the budget) is answered at once and its body dropped; a connection
    that breaks the protocol is answered 400 and closed; one whose frame stalls is closed."""

    def __init__(self, server: Server, transport: asyncio.Transport, session: Optional[Session]):
        self.server, self.transport, self.session = server, transport, session
        self.sender = session.peer_id if session is not None else None
        raw = getattr(transport, "transport", transport)  # under --encrypt's writer, the socket's transport
        self.remote = raw.get_extra_info("peername")  # where its requests come from (``REMOTE``)
        self.addr = host_of(self.remote)
        self._reserved, self._member = 0, True
        self._loop = asyncio.get_running_loop()
        self._progress = self._loop.time()
        self._deadline = float("inf")  # when the frame being read must be whole (``Limits.frame_deadline_s``)
        self._stall: Optional[asyncio.TimerHandle] = None
        self._writing_paused = False  # the transport holds too many answers unsent (``pause_writing``)
        server._framed.add(self)
        self._expect_request()

    def _expect_request(self) -> None:
        self._stage = "request"
        self._buf = bytearray(REQUEST.size)
        self._want = memoryview(self._buf)
        self._drop = 0  # body bytes of a refused message still to come
        self._deadline = float("inf")
        self._first_at: Optional[float] = None  # when the request's first byte came (``ARRIVED``)
        self._watch()  # from now on the connection is idle: closed after idle_timeout_s without a request

    def take(self, data: bytes | bytearray) -> int:
        """Copies bytes read before this protocol took over into its buffer; returns their count."""
        if data and self._first_at is None:
            self._first_at = time.time()
        self._want[: len(data)] = data
        return len(data)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._drop:
            return memoryview(self.server._scratch)[: min(self._drop, RECV_BYTES)]
        # the socket's reads take RECV_BYTES at most; an encrypted record opened in place, a record's
        # plain size (secure.MAX_PLAIN at most); a frame's last bytes within TAIL_BYTES of that come
        # with them (a pipeline's 256 KiB tensor and its frame's header, some 150 bytes, took a read,
        # a get_buffer and a buffer_updated more for those bytes: 4 reads a message, 3 now)
        cap = max(RECV_BYTES, min(sizehint, secure.MAX_PLAIN))
        return self._want if self._want.nbytes <= cap + TAIL_BYTES else self._want[:cap]

    # ---- stalls, slow frames and idle connections -------------------------------------------
    def _mid_frame(self) -> bool:
        return self._stage in ("kind", "body") or bool(self._drop) or (
            self._stage == "request" and self._want.nbytes < REQUEST.size)

    def _watch(self) -> None:
        self._progress = self._loop.time()
        if self._stall is None:
            lim = self.server.budget.limits
            self._stall = self._loop.call_later(min(lim.stall_timeout_s, lim.idle_timeout_s), self._check_stall)

    def _check_stall(self) -> None:
        """One timer for three limits: a frame with no byte for stall_timeout_s, a frame not whole
        by its deadline (a minimum rate: trickling a byte now and then holds no reservation for
        ever), and a connection with no request for idle_timeout_s (held slots cost the others)."""
        self._stall = None
        if self.transport.is_closing() or self._stage in ("busy", "closing"):
            return
        lim, now = self.server.budget.limits, self._loop.time()
        if self._mid_frame():
            left = min(self._progress + lim.stall_timeout_s, self._deadline) - now
            why = (f"its message stalled for {lim.stall_timeout_s:.0f}s" if now >= self._progress + lim.stall_timeout_s
                   else f"its message arrived slower than {lim.min_rate_bytes_s / 1024:.0f} KiB/s")
        else:
            left = self._progress + lim.idle_timeout_s - now
            why = f"idle for {lim.idle_timeout_s:.0f}s"
        if left > 0:
            self._stall = self._loop.call_later(left, self._check_stall)
            return
        if not self._mid_frame():  # an idle client reads our EOF before it next takes the connection
            log.info("closed a data-plane connection from %s: %s", self.sender or "an unauthenticated client", why)
            self.transport.close()
            return
        self._warn("closed a data-plane connection from %s: %s", why)
        self.transport.abort()

    # ---- requests -------------------------------------------------------------------------
    def buffer_updated(self, nbytes: int) -> None:
        if self._stage == "closing":
            return
        self._watch()
        if self._drop:
            self._drop -= nbytes
            if not self._drop:
                self._expect_request()
            return
        if self._stage == "busy":  # the client sent more before its answer: not this protocol
            self._fail("a second request arrived before the first was answered")
            return
        if self._first_at is None:
            self._first_at = time.time()
        self._want = self._want[nbytes:]
        if self._want.nbytes:
            return
        if self._stage == "request":
            magic, kind_len, length = REQUEST.unpack(self._buf)
            if magic != REQUEST_MAGIC or not 0 < kind_len <= MAX_KIND_BYTES:
                self._fail("not a data-plane request (bad magic or kind length)")
                return
            self._length = length
            self._deadline = self._loop.time() + self.server.budget.limits.frame_deadline_s(length)
            self._stage, self._buf = "kind", bytearray(kind_len)
            self._want = memoryview(self._buf)
        elif self._stage == "kind":
            try:
                self._kind = self._buf.decode("ascii")
            except UnicodeDecodeError:
                self._fail("message kind is not ASCII")
                return
            refused = self.server._refusal(self._kind, self._length) or self._reserve(self._length)
            if refused is not None:
                self._answer(*refused)
                self._drop = self._length
                if not self._drop:
                    self._expect_request()
                return
            self._stage, self._buf = "body", frame_buffer(self._length)
            self._want = memoryview(self._buf)
            if not self._length:
                self._run()
        else:
            self._run()

    def _reserve(self, length: int) -> Optional[tuple[int, str]]:
        if self.sender is None:
            return None
        member = self.server.is_member(self.sender)
        refused = self.server.budget.reserve(self.sender, length, member)
        if refused:
            return 503, refused
        self._reserved, self._member = length, member
        return None

    def _unreserve(self) -> None:
        if self._reserved:
            self.server.budget.release(self.sender, self._reserved, self._member)
            self._reserved = 0

    def _run(self) -> None:
        if self._kind in self.server._lanes:
            self._lane()
            return
        if self._kind in self.server._inline:  # a plain handler: at once, and reading goes on
            if self.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
                # a client waits for each answer before its next request: this one sends on unanswered
                self._warn("cut a data-plane connection from %s: over %d MiB of its answers unread", MAX_UNSENT_BYTES >> 20)
                self._unreserve()
                self._stage = "closing"
                self.transport.abort()
                return
            token, arrived = REMOTE.set(self.remote), ARRIVED.set((self._first_at, time.time()))
            try:
                self._finish(*self.server.dispatch_now(self._kind, self._buf, self.sender))
            finally:
                REMOTE.reset(token)
                ARRIVED.reset(arrived)
            return
        self._stage = "busy"
        self.transport.pause_reading()
        task = self._loop.create_task(self._handle(self._kind, self._buf))
        self.server._tasks.add(task)
        task.add_done_callback(self.server._tasks.discard)

    def _lane(self) -> None:
        """A lane request: refused, answered like any other; taken, the socket leaves the event loop
        (a duplicate of it, the transport's own closed without a word to the client), is answered
        204 on it and handed to what took it (``DataPlaneServer.register_lane``)."""
        encrypted = self.session is None or self.session.encrypted
        status, reason, take = self.server.dispatch_lane(self._kind, self._buf, self.sender, encrypted)
        raw = getattr(self.transport, "transport", self.transport)
        if take is not None and raw.get_write_buffer_size():
            status, reason, take = 503, "answers to earlier requests are still on their way", None
        if take is None:
            self._finish(status, reason)
            return
        self._unreserve()
        self._stage = "closing"
        raw.pause_reading()
        sock = socket.socket(fileno=os.dup(raw.get_extra_info("socket").fileno()))
        raw.abort()  # (its descriptor closed: the connection lives on in ``sock``)
        try:
            sock.setblocking(True)
            sock.sendall(_answer_bytes(204, ""))
        except OSError as e:
            sock.close()
            self._warn("lane from %s failed as it opened: %s", e)
            return
        take(sock)

    async def _handle(self, kind: str, body) -> None:
        REMOTE.set(self.remote)
        status, out = 500, "the handler did not answer"
        try:
            status, out = await self.server._dispatch(kind, body, self.sender)
        finally:  # (cancelled: the server is stopping, and the answer goes nowhere)
            self._finish(status, out)
            if not self._writing_paused:
                self.transport.resume_reading()

    def _finish(self, status: int, out: "str | list") -> None:
        """The request is handled: its bytes' reservation ends, it is answered, and the next awaited."""
        self._unreserve()
        if self.transport.is_closing():
            return
        if isinstance(out, str):
            self._answer(status, out)
        else:
            size = framing.frame_size(out)
            head = ANSWER.pack(ANSWER_MAGIC, status, size)
            if size <= SMALL_BYTES:
                self.transport.write(b"".join([head, *out]))
            else:
                self.transport.write(head)
                for c in out:
                    self.transport.write(c)
        self._expect_request()

    # ---- a client that sends faster than it reads its answers: reading waits for the writes ---
    def pause_writing(self) -> None:
        self._writing_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._stage != "busy":
            self.transport.resume_reading()

    def _answer(self, status: int, reason: str) -> None:
        self.transport.write(_answer_bytes(status, reason))

    def _warn(self, msg: str, *args) -> None:
        """``msg % (who, *args)`` within the server's log budget: a line a sender (an unauthenticated
        client's address) every 10 s at most."""
        self.server.quiet.warning(log, self.sender or self.addr, msg, self.sender or "an unauthenticated client", *args)

    def _fail(self, reason: str) -> None:
        """Answers 400 and ends our side; what the client still sends is dropped until it closes
        (closing with unread bytes would reset the connection, and the answer could be lost)."""
        self._warn("data-plane connection from %s closed: %s", reason)
        self._answer(400, reason)
        self._stage, self._drop = "closing", 1 << 62
        self.transport.write_eof()
        self.transport.resume_reading()

    def eof_received(self) -> None:
        return None  # closes the transport

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.server._framed.discard(self)
        if self._stall is not None:
            self._stall.cancel()
        if self._stage != "busy":
            self._unreserve()  # a frame that never came whole (a running handler releases its own)
        if self.sender is not None:
            self.server.budget.disconnect(self.sender, self.addr)
