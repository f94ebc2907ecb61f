"""Connections that are not what their direction says: the server's side of the path ladder (``paths``).

Besides the handshake, HTTP and unauthenticated frames, a data-plane connection may open with:
- ``STO1`` (observe): answered with its source address as seen here (``b"IP PORT\\n"``), then closed.
  A peer behind NAT learns its public mapping from it (as STUN does), and whether that mapping
  depends on the destination (symmetric NAT).
- ``STV1`` + a 16-byte token (reversed): a peer that cannot be dialed opened this connection because
  we asked it to (the token is ours, issued to that peer over an authenticated connection). We become
  its client: the connection is handed to whoever waits for the token and runs the usual handshake.
- ``STL1`` + a 16-byte token + a role byte (relay): one end of a circuit this peer relays. Both ends
  present the token this peer issued; once both are here each gets one byte (``b"\\x01"``) and the two
  connections are spliced, bytes both ways with back-pressure. The two ends then run the handshake
  end to end through the splice: the relay sees only what they send, ciphertext with ``--encrypt``.
Everything is bounded: a preamble has its deadline, tokens expire, circuits are counted.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .addresses import host_of
from .budget import LogBudget

log = logging.getLogger("spantrain_p2p.net.paths")
_quiet = LogBudget()  # what remotes make this peer log: a line a source address every 10 s at most

OBSERVE, REVERSE, RELAY = b"STO1", b"STV1", b"STL1"
TOKEN_BYTES = 16
ACK = b"\x01"
TOKEN_TTL_S = 20.0
PREAMBLE_TIMEOUT_S = 10.0
PIPE_HIGH_WATER = 4 << 20


def streams_of(transport: asyncio.Transport) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """asyncio streams over a transport another protocol had (no byte may have arrived since)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20, loop=loop)
    proto = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport.set_protocol(proto)
    proto.connection_made(transport)
    return reader, asyncio.StreamWriter(transport, proto, reader, loop)


def _warn(transport: asyncio.Transport, msg: str, *args) -> None:
    addr = host_of(transport.get_extra_info("peername"))
    _quiet.warning(log, addr, msg + " from %s", *args, addr or "an unknown address")


class Preamble(asyncio.Protocol):
    """Reads ``need`` bytes after the magic, then calls ``done(transport, data)`` (which takes the
    transport over); a connection that sends more, or not enough in time, is closed."""

    def __init__(self, transport: asyncio.Transport, need: int, done: Callable[[asyncio.Transport, bytes], None],
                 release: Callable[[], None] = lambda: None):
        self.transport, self.need, self.done, self._release = transport, need, done, release
        self.buf = bytearray()
        self._timer = asyncio.get_running_loop().call_later(PREAMBLE_TIMEOUT_S, transport.close)
        if need == 0:
            self._finish()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > self.need:
            _warn(self.transport, "closed a %d-byte preamble that went on", self.need)
            self._end()
            self.transport.close()
        elif len(self.buf) == self.need:
            self._finish()

    def _end(self) -> None:
        self._timer.cancel()
        release, self._release = self._release, lambda: None
        release()  # its place among connections not yet identified

    def _finish(self) -> None:
        self._end()
        try:
            self.done(self.transport, bytes(self.buf))
        except Exception:
            log.exception("preamble handler failed")
            self.transport.close()

    def eof_received(self) -> None:
        return None

    def connection_lost(self, exc) -> None:
        self._end()


def answer_observe(transport: asyncio.Transport, _: bytes) -> None:
    host, port = transport.get_extra_info("peername")[:2]
    transport.write(f"{host} {port}\n".encode())
    transport.close()


@dataclass
class Waiting:
    peer: str  # the peer the token was issued to
    future: asyncio.Future
    expires: float


class Reversals:
    """Tokens this peer issued for connections others open to it; ``arrive`` hands each to its waiter."""

    def __init__(self, max_waiting: int = 256):
        self.max_waiting = max_waiting
        self._waiting: dict[bytes, Waiting] = {}

    def issue(self, peer: str) -> tuple[bytes, asyncio.Future]:
        """A token for ``peer``'s connection, and the future that gets (peer, its streams)."""
        self._expire()
        if len(self._waiting) >= self.max_waiting:
            raise RuntimeError("too many reversed connections awaited")
        token = secrets.token_bytes(TOKEN_BYTES)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[token] = Waiting(peer, fut, time.monotonic() + TOKEN_TTL_S)
        return token, fut

    def cancel(self, token: bytes) -> None:
        self._waiting.pop(token, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for t in [t for t, w in self._waiting.items() if w.expires < now]:
            w = self._waiting.pop(t)
            if not w.future.done():
                w.future.cancel()

    def arrive(self, transport: asyncio.Transport, token: bytes) -> None:
        w = self._waiting.pop(token, None)
        if w is None or w.future.done():
            _warn(transport, "closed a reversed connection with an unknown or expired token")
            transport.close()
            return
        w.future.set_result((w.peer, streams_of(transport)))


class Pipe(asyncio.Protocol):
    """One side of a splice: what arrives here leaves on the other side's transport; when the other
    side cannot send as fast, this side stops reading."""

    def __init__(self, transport: asyncio.Transport, circuit: "Circuit"):
        self.transport, self.circuit = transport, circuit
        self.other: Optional["Pipe"] = None

    def data_received(self, data: bytes) -> None:
        self.circuit.bytes += len(data)
        self.other.transport.write(data)

    def pause_writing(self) -> None:
        self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.other.transport.is_closing():
            self.other.transport.resume_reading()

    def eof_received(self) -> bool:
        if self.other.transport.can_write_eof() and not self.other.transport.is_closing():
            self.other.transport.write_eof()
        return True

    def connection_lost(self, exc) -> None:
        self.other.transport.close()
        self.circuit.closed()


@dataclass
class Circuit:
    token: bytes
    a: str  # who asked for it
    b: str  # whom it reaches
    expires: float
    ends: dict = field(default_factory=dict)  # role -> transport
    bytes: int = 0
    started: float = 0.0
    on_close: Optional[Callable[["Circuit"], None]] = None
    _open: int = 0

    def closed(self) -> None:
        self._open -= 1
        if self._open == 0 and self.on_close is not None:
            self.on_close(self)


class Relay:
    """The circuits this peer relays: at most ``max_circuits`` at once (``--relay N``; 0: none)."""

    def __init__(self, max_circuits: int = 16):
        self.max_circuits = max_circuits
        self.circuits: dict[bytes, Circuit] = {}
        self.relayed_bytes = 0
        self.served = 0

    def offers(self) -> bool:
        return self.max_circuits > 0

    def issue(self, a: str, b: str) -> bytes:
        now = time.monotonic()
        for t in [t for t, c in self.circuits.items() if not c.started and c.expires < now]:
            for tr in self.circuits.pop(t).ends.values():
                tr.close()
        if len(self.circuits) >= self.max_circuits:
            raise RuntimeError(f"this peer relays {len(self.circuits)} circuits, its most")
        token = secrets.token_bytes(TOKEN_BYTES)
        self.circuits[token] = Circuit(token, a, b, now + TOKEN_TTL_S)
        return token

    def arrive(self, transport: asyncio.Transport, data: bytes) -> None:
        token, role = data[:TOKEN_BYTES], data[TOKEN_BYTES:]
        c = self.circuits.get(token)
        if c is None or c.started or role not in (b"a", b"b") or role in c.ends:
            _warn(transport, "closed a relay connection with an unknown token")
            transport.close()
            return
        c.ends[role] = transport
        if len(c.ends) < 2:
            return
        c.started, c._open = time.monotonic(), 2
        c.on_close = self._closed
        pa, pb = Pipe(c.ends[b"a"], c), Pipe(c.ends[b"b"], c)
        pa.other, pb.other = pb, pa
        for p in (pa, pb):
            p.transport.set_protocol(p)
            p.transport.set_write_buffer_limits(PIPE_HIGH_WATER)
            p.transport.write(ACK)
        self.served += 1
        log.info("relaying %s -> %s", c.a, c.b)

    def _closed(self, c: Circuit) -> None:
        self.relayed_bytes += c.bytes
        self.circuits.pop(c.token, None)

    def status(self) -> dict:
        live = [c for c in self.circuits.values() if c.started]
        return {"max_circuits": self.max_circuits, "circuits": len(live), "served": self.served,
                "relayed_bytes": self.relayed_bytes + sum(c.bytes for c in live)}
