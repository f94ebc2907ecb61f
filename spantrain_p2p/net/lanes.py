"""Lanes: one pipeline hop's tensors on a connection of its own, written and read off the event loop.

A lane is an authenticated, unencrypted data-plane connection (two peers of one machine: every
connection that leaves a machine is encrypted, ``handshake``) that the sender opened with a lane
request and that both ends then took off their event loops (``DataPlaneClient.open_lane``, the
server's ``register_lane``). On it the sender's compute thread writes the hop's messages as the
data plane frames them (``wire``: the request's head, its kind, the frame), unanswered; the
receiver's compute thread reads each one when its next op needs it. Issue 31: through the event
loops, a 256 KiB tensor cost its two peers' loops about 1.4 ms of CPU in the side-by-side's swarm
(the answer, the wake-ups, the schedule's hand-offs), a hand-off to a thread of its own about as
much (the lane prototype of 2026-11-30); read and written by the compute thread itself, about 0.3.

Every byte on a lane is as untrusted as any other: the reader checks the request's magic, the
kind's length and the frame's length against a limit before reading the frame into a buffer of that
size, a frame that stalls mid-way ends the lane, and what the frame says is checked by the caller
(``train.lane_hops``). Writing never blocks the compute thread on the network: what the socket does
not take at once waits, in order, for a writer thread of the lane's own (two peers that both send
to each other more than their sockets hold would otherwise wait on each other for ever).
"""
from __future__ import annotations

import collections
import select
import socket
import threading
import time
from typing import Optional, Sequence

from . import framing
from .wire import MAX_KIND_BYTES, REQUEST, REQUEST_MAGIC

STALL_S = 30.0  # a frame begun must go on arriving: no byte for this long ends the lane
SOCKET_BYTES = 4 << 20  # asked of the kernel for each lane's socket buffers (it may give less)


class LaneClosed(ConnectionError):
    """The lane ended (its other end closed it, it broke, or this end closed it); the message says why."""


def _tune(sock: socket.socket, send: bool) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF if send else socket.SO_RCVBUF, SOCKET_BYTES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def request_chunks(kind: str, header: dict, buffers: Sequence) -> list:
    """A message as the data plane frames a request: its head and frame header in one chunk, then the
    buffers uncopied."""
    chunks = framing.encode(header, buffers)
    name = kind.encode("ascii")
    head = REQUEST.pack(REQUEST_MAGIC, len(name), framing.frame_size(chunks)) + name
    return [head + bytes(chunks[0]), *chunks[1:]]


class LaneOut:
    """The sending end: ``write`` from one thread (the compute thread), in order; ``flush`` waits
    until the socket took everything written."""

    def __init__(self, sock: socket.socket, peer: str, max_backlog_bytes: int):
        _tune(sock, send=True)
        sock.setblocking(False)
        self.sock, self.peer, self.max_backlog = sock, peer, max_backlog_bytes
        self._backlog: collections.deque = collections.deque()  # views not yet taken by the socket
        self._backlog_bytes = 0
        self._cv = threading.Condition()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._writer: Optional[threading.Thread] = None
        self.bytes_sent = 0

    def _check(self) -> None:
        if self._error is not None:
            raise LaneClosed(f"lane to {self.peer[:16]}… failed: {self._error}")
        if self._closed:
            raise LaneClosed(f"lane to {self.peer[:16]}… is closed")

    def write(self, chunks: Sequence) -> None:
        """Sends ``chunks`` after what was written before: what the socket takes now, at once; the
        rest by the lane's writer thread. Waits only while the unsent backlog is over its limit."""
        views = [memoryview(c).cast("B") for c in chunks]
        with self._cv:
            self._check()
            while self._backlog_bytes > self.max_backlog:
                if not self._cv.wait(STALL_S):
                    raise LaneClosed(f"lane to {self.peer[:16]}… took nothing for {STALL_S:.0f}s")
                self._check()
            if not self._backlog:
                views = self._send_now(views)
            for v in views:
                self._backlog.append(v)
                self._backlog_bytes += v.nbytes
            if self._backlog:
                self._start_writer()
                self._cv.notify_all()

    def _send_now(self, views: list) -> list:
        """Sends what the socket takes without waiting; the views left (the first one cut)."""
        for i, v in enumerate(views):
            while v.nbytes:
                try:
                    n = self.sock.send(v)
                except (BlockingIOError, InterruptedError):
                    return [v, *views[i + 1:]]
                except OSError as e:
                    self._error = e
                    self._check()
                self.bytes_sent += n
                v = v[n:]
        return []

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_on, daemon=True, name="lane-writer")
            self._writer.start()

    def _write_on(self) -> None:
        poll = select.poll()
        poll.register(self.sock, select.POLLOUT)
        while True:
            with self._cv:
                while not self._backlog and not self._closed and self._error is None:
                    self._cv.wait()
                if self._closed or self._error is not None:
                    return
                v = self._backlog[0]
            last = time.monotonic()
            while v.nbytes:
                if not poll.poll(1000):
                    if self._closed:
                        return
                    if time.monotonic() - last > STALL_S:
                        self._fail(TimeoutError(f"the socket took nothing for {STALL_S:.0f}s"))
                        return
                    continue
                try:
                    n = self.sock.send(v)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    self._fail(e)
                    return
                last = time.monotonic()
                self.bytes_sent += n
                v = v[n:]
            with self._cv:
                self._backlog_bytes -= self._backlog[0].nbytes
                self._backlog.popleft()
                self._cv.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            self._error = e
            self._cv.notify_all()

    def flush(self, timeout: float) -> None:
        """Until the socket took everything written; LaneClosed if the lane failed or it took
        nothing for ``timeout`` seconds."""
        with self._cv:
            sent = self.bytes_sent
            while self._backlog:
                self._check()
                if not self._cv.wait(timeout) and self.bytes_sent == sent:
                    raise LaneClosed(f"lane to {self.peer[:16]}… took nothing for {timeout:.0f}s")
                sent = self.bytes_sent
            self._check()

    def close(self) -> None:
        """Ends the lane (from any thread): what was not sent is dropped, a ``write`` or ``flush``
        waiting raises LaneClosed, the writer thread ends, and the socket is closed once it has."""
        with self._cv:
            self._closed = True
            self._backlog.clear()
            self._backlog_bytes = 0
            self._cv.notify_all()
        _shutdown(self.sock)
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(5.0)
        self.sock.close()


class LaneIn:
    """The receiving end: ``read`` from one thread (the compute thread)."""

    def __init__(self, sock: socket.socket, peer: str, max_message_bytes: int):
        _tune(sock, send=False)
        sock.setblocking(True)
        self.sock, self.peer, self.max_bytes = sock, peer, max_message_bytes
        self._head = bytearray(REQUEST.size)
        self._closed = False
        self.bytes_received = 0

    def wait(self, timeout: float) -> bool:
        """Whether a message has begun to arrive within ``timeout`` seconds (or the lane ended:
        ``read`` says so)."""
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(r)

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:])
            except socket.timeout:
                raise LaneClosed(f"lane from {self.peer[:16]}…: a message stalled for {STALL_S:.0f}s") from None
            except OSError as e:
                raise LaneClosed(f"lane from {self.peer[:16]}… broke: {e}") from None
            if n == 0:
                raise LaneClosed(f"lane from {self.peer[:16]}… was closed" + (" mid-message" if got else ""))
            got += n
        self.bytes_received += got

    def read(self) -> tuple[str, dict, list[memoryview]]:
        """The next message: (kind, header, buffers), the frame checked against the size limit and
        decoded (``framing``); LaneClosed for a lane that ended or does not speak the protocol."""
        if self._closed:
            raise LaneClosed(f"lane from {self.peer[:16]}… is closed")
        self.sock.settimeout(STALL_S)
        self._read_into(memoryview(self._head))
        magic, kind_len, length = REQUEST.unpack(self._head)
        if magic != REQUEST_MAGIC or not 0 < kind_len <= MAX_KIND_BYTES:
            raise LaneClosed(f"lane from {self.peer[:16]}… does not speak the data plane (bad magic or kind length)")
        if length > self.max_bytes:
            raise LaneClosed(f"lane from {self.peer[:16]}… sent a {length}-byte message, over the {self.max_bytes}-byte limit")
        name = bytearray(kind_len)
        self._read_into(memoryview(name))
        try:
            kind = name.decode("ascii")
        except UnicodeDecodeError:
            raise LaneClosed(f"lane from {self.peer[:16]}…: message kind is not ASCII") from None
        from .connections import frame_buffer  # (connections imports much of the server)

        frame = frame_buffer(length)
        self._read_into(memoryview(frame).cast("B"))
        try:
            header, buffers = framing.decode(frame, self.max_bytes)
        except framing.FrameError as e:
            raise LaneClosed(f"lane from {self.peer[:16]}…: {e}") from None
        return kind, header, buffers

    def shutdown(self) -> None:
        """Ends the lane (from any thread): a ``wait`` or ``read`` blocked on it returns or raises
        LaneClosed. The socket stays open until ``close``: closed under a reading thread, its number
        could be another socket's by the time that thread reads."""
        self._closed = True
        _shutdown(self.sock)

    def close(self) -> None:
        """Ends the lane and closes its socket: by the reading thread, or once it no longer reads."""
        self.shutdown()
        self.sock.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
