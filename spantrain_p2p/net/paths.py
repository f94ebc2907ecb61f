"""The ladder of paths: how this peer opens a data-plane connection to a peer, per pair.

1. **direct**: TCP to the address the peer announces (its record says others reached it: ``reach``
   "direct", or not known yet);
2. **reversed**: the peer cannot be dialed, we can: it keeps a standing connection to us (a *control
   link*, which it opened and we are the client of); over it we ask it to dial us (``dialme``), and
   the connection it opens (``STV1`` + our token) becomes ours for messages;
3. **hole-punched**: both behind NAT with endpoint-independent mappings: each learns its public
   address from a reachable peer (``STO1``) on a port it then dials the other from, at once
   (TCP simultaneous open through both routers), coordinated through that peer (``punch``);
4. **relayed**: otherwise, through a reachable peer that relays (``relay``): both ends dial it and
   it splices the two connections.
Whatever the path, the usual handshake then runs end to end (the relay sees ciphertext with
``--encrypt``). Written here rather than taken from libp2p: the p2p daemon hivemind ships has no
hole-punching option (its ``-help`` lists none), and libp2p's streams would put every tensor
through the daemon's Unix socket; the data plane keeps its own TCP connections whatever the path.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import framing
from .addresses import address_of
from .preambles import ACK, OBSERVE, RELAY, REVERSE, Relay, Reversals, answer_observe
from .wire import ANSWER, ANSWER_MAGIC, REQUEST, REQUEST_MAGIC, RemoteError, Retry

log = logging.getLogger("spantrain_p2p.net.paths")

DIRECT, REVERSED, PUNCHED, RELAYED = "direct", "reversed", "hole-punched", "relayed"
CONNECT_S = 5.0
MAX_LINKS = 8  # standing links a peer behind NAT keeps to reachable peers
PUNCH_S = 8.0
MAX_PUNCHING = 8  # hole punches under way at once that others asked this peer for


def ip_port(v) -> tuple[str, int]:
    """An (IPv4 address, port) from untrusted ``[host, port]``; ValueError otherwise (a peer must not
    make another dial a name, or a port it made up)."""
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ValueError("an address is [ip, port]")
    host, port = v
    ipaddress.IPv4Address(host)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"bad port {port!r}")
    return str(host), port


async def observe(addr: tuple[str, int], local_port: int = 0, timeout: float = CONNECT_S) -> tuple[int, tuple[str, int]]:
    """(our local port, our address as ``addr`` sees it) over a fresh connection from ``local_port``."""
    loop = asyncio.get_running_loop()
    sock = _bound(local_port)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, addr), timeout)
        port = sock.getsockname()[1]
        await loop.sock_sendall(sock, OBSERVE)
        data = b""
        while not data.endswith(b"\n") and len(data) < 64:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 64), timeout)
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
    host, _, p = data.decode("ascii", "replace").strip().partition(" ")
    if not p.isdigit():
        raise ConnectionError(f"{addr[0]}:{addr[1]} did not say where it sees us from")
    return port, (host, int(p))


def _bound(local_port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setblocking(False)
    sock.bind(("0.0.0.0", local_port))
    return sock


async def dial(url: str, preamble: bytes, timeout: float = CONNECT_S) -> socket.socket:
    """A connection to the data plane at ``url`` that opens with ``preamble`` (``preambles``: a
    reversed connection, a relay's end), as a socket for ``DataPlaneServer.adopt``."""
    loop = asyncio.get_running_loop()
    sock = _bound(0)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, address_of(url)), timeout)
        await loop.sock_sendall(sock, preamble)
    except BaseException:
        sock.close()
        raise
    return sock


async def punch(local_port: int, remote: tuple[str, int], deadline_s: float = PUNCH_S) -> socket.socket:
    """Dials ``remote`` from ``local_port`` until the other side's dial meets ours (its router lets
    our SYN in once its own SYN to us went out); TimeoutError after ``deadline_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    last: Optional[BaseException] = None
    while loop.time() < end:
        sock = _bound(local_port)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, remote), min(2.0, max(0.1, end - loop.time())))
            return sock
        except (OSError, asyncio.TimeoutError) as e:
            last = e
            sock.close()
            await asyncio.sleep(0.2)
    raise asyncio.TimeoutError(f"hole punching to {remote[0]}:{remote[1]} did not meet within {deadline_s:.0f}s "
                               f"({last!r})")


@dataclass
class Link:
    """A standing connection a peer behind NAT opened to us; we are its client (for requests to it)."""
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def alive(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())


async def request(link: Link, kind: str, header: dict, timeout: float = 10.0) -> Optional[dict]:
    """One small request over a standing link: its reply header (None for 204); RemoteError if refused."""
    name = kind.encode("ascii")
    chunks = framing.encode(header, ())
    body = b"".join(bytes(c) for c in chunks)
    async with link.lock:
        async def exchange():
            link.writer.write(REQUEST.pack(REQUEST_MAGIC, len(name), len(body)) + name + body)
            await link.writer.drain()
            magic, status, length = ANSWER.unpack(await link.reader.readexactly(ANSWER.size))
            if magic != ANSWER_MAGIC or length > 1 << 20:
                raise ConnectionError("a standing link answered out of protocol")
            return status, await link.reader.readexactly(length)
        try:
            status, data = await asyncio.wait_for(exchange(), timeout)
        except BaseException:
            link.writer.close()  # a request cut off mid-way leaves the link out of step: drop it
            raise
    if status == 204:
        return None
    if status != 200:
        raise RemoteError(status, data[:500].decode("utf-8", "replace"))
    return framing.decode(bytearray(data), 1 << 20)[0]


class Paths:
    """This peer's side of the ladder: opens connections (``open``, the client's hook), keeps the
    standing links, answers the others' requests (handlers on the data-plane server), and says which
    path each pair took (``status``)."""

    def __init__(self, client, server, me: str, records: Callable[[], dict], my_reach: Callable[[], str],
                 relay_circuits: int = 16, spawn: Callable = asyncio.ensure_future):
        self.client, self.server, self.me = client, server, me
        self.records, self.my_reach, self.spawn = records, my_reach, spawn
        self.reversals = Reversals()
        self.relay = Relay(relay_circuits)
        self.links: dict[str, Link] = {}  # peer behind NAT -> its standing link to us
        self.links_out: dict[str, asyncio.Transport] = {}  # reachable peer -> our standing link to it
        self.used: dict[str, dict] = {}  # peer -> {"path", "via" (a peer id), "since"} of the last connection opened
        self._punching = 0
        self._indexed: Optional[dict] = None  # the view ``_by_addr`` was made from
        self._by_addr: dict[tuple[str, int], Optional[str]] = {}
        self._link_changed = asyncio.Event()
        server.preambles[OBSERVE] = (0, answer_observe)
        server.preambles[REVERSE] = (16, self.reversals.arrive)
        server.preambles[RELAY] = (17, self.relay.arrive)
        for kind, handler in (("reverse", self._on_reverse), ("dialme", self._on_dialme), ("punch", self._on_punch),
                              ("punched", self._on_punched), ("relay", self._on_relay), ("relayme", self._on_relayme)):
            server.register(kind, handler)
        client.paths = self

    # ---- who is where ---------------------------------------------------------------------
    def _rec(self, peer: str):
        return self.records().get(peer)

    def _peer_at(self, addr: tuple[str, int]) -> Optional[str]:
        """The live member serving at ``addr``: an index of the current view's addresses, made again
        when the peer takes a new view (asked at every connection and page; a member's record is
        untrusted, so an address that does not parse is left out, not raised, and an address two
        records claim names nobody: a record may claim another's address)."""
        view = self.records()
        if view is not self._indexed:
            self._by_addr = {}
            for pid, rec in view.items():
                if rec.alive and rec.data_url:
                    with contextlib.suppress(ValueError):
                        a = address_of(rec.data_url)
                        self._by_addr[a] = pid if a not in self._by_addr else None
            self._indexed = view
        return self._by_addr.get(addr)

    def peer_at(self, addr: tuple[str, int]) -> Optional[str]:
        """The peer id a connection to ``addr`` must authenticate as (None: no single live record
        serves there). Every client of a peer pins it (``DataPlaneClient``)."""
        return self._peer_at(addr)

    def indirect(self, url: str) -> bool:
        """Whether the peer at ``url`` cannot be dialed (behind NAT): HTTP cannot reach it either."""
        try:
            peer = self._peer_at(address_of(url))
        except ValueError:
            return False
        rec = self._rec(peer) if peer else None
        return rec is not None and rec.reach in ("nat", "nat-symmetric") and peer != self.me

    def _reachable_others(self, *skip: str) -> list:
        """Members others can dial (or not known not to be), this peer and ``skip`` left out, in the
        order of their names (every peer tries the same relay first)."""
        return sorted((r for r in self.records().values() if r.alive and r.data_url and r.peer_id != self.me
                       and r.peer_id not in skip and r.reach in ("", "direct")), key=lambda r: (r.name, r.peer_id))

    def _note(self, peer: str, path: str, via=None) -> None:
        self.used[peer] = {"path": path, "via": via.peer_id if via is not None else "", "since": round(time.time(), 1)}

    # ---- the client's hook ----------------------------------------------------------------
    async def open(self, addr: tuple[str, int], want: Optional[str]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A fresh connection to the peer at ``addr`` (``want`` when known), over the first path that works."""
        peer = want or self._peer_at(addr)
        rec = self._rec(peer) if peer else None
        if rec is None or rec.reach in ("", "direct") or peer == self.me:
            conn = await asyncio.open_connection(*addr, limit=1 << 20)
            if peer:
                self._note(peer, DIRECT)
            return conn
        for attempt in range(3):
            errors: list[str] = []
            busy = 0  # refusals that may pass (a peer that has not seen our record yet: 503)
            ladder = [("reversal", self._reversed)] if self.my_reach() in ("", "direct") else []
            if self.my_reach() == "nat" and rec.reach == "nat":
                ladder.append(("hole punching", self._punched))
            ladder.append(("relay", self._relayed))
            for what, rung in ladder:
                try:
                    return await rung(peer)
                except (OSError, asyncio.TimeoutError, RemoteError) as e:
                    errors.append(f"{what}: {e or type(e).__name__}")
                    busy += "503" in str(e)
            if busy < len(ladder):
                break
            await asyncio.sleep(1.0 + attempt)
        raise ConnectionError(f"no path to {rec.name or peer} (behind NAT): " + "; ".join(errors))

    async def _link(self, peer: str, wait: float) -> Link:
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        while True:
            link = self.links.get(peer)
            if link is not None and link.alive():
                return link
            if loop.time() >= end:
                raise ConnectionError(f"{peer} keeps no standing link to this peer")
            self._link_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._link_changed.wait(), end - loop.time())

    async def _reversed(self, peer: str):
        link = await self._link(peer, wait=6.0)
        token, fut = self.reversals.issue(peer)
        try:
            await request(link, "dialme", {"token": token.hex()}, timeout=CONNECT_S * 2)
            _, conn = await asyncio.wait_for(fut, CONNECT_S * 2)
        finally:
            self.reversals.cancel(token)
        self._note(peer, REVERSED)
        return conn

    async def _punched(self, peer: str):
        errors = []
        for r in self._reachable_others(peer)[:3]:
            try:
                local_port, mine = await observe(address_of(r.data_url))
                reply = await self.client.send(r.data_url, "punch", {"to": peer, "addr": list(mine)},
                                               timeout=CONNECT_S * 2, peer_id=r.peer_id)
                sock = await punch(local_port, ip_port(reply[0]["addr"]))
                conn = await asyncio.open_connection(sock=sock, limit=1 << 20)
                self._note(peer, PUNCHED, r)
                return conn
            except (OSError, asyncio.TimeoutError, RemoteError, KeyError, TypeError, ValueError) as e:
                errors.append(f"via {r.name or r.peer_id}: {e or type(e).__name__}")
        raise ConnectionError("; ".join(errors) or "no reachable peer to coordinate through")

    async def _relayed(self, peer: str):
        errors = []
        for r in self._reachable_others(peer)[:4]:
            try:
                reply = await self.client.send(r.data_url, "relay", {"to": peer}, timeout=CONNECT_S * 2,
                                               peer_id=r.peer_id)
                token = bytes.fromhex(reply[0]["token"])
                reader, writer = await asyncio.wait_for(asyncio.open_connection(*address_of(r.data_url), limit=1 << 20),
                                                        CONNECT_S)
                writer.write(RELAY + token + b"a")
                if await asyncio.wait_for(reader.readexactly(1), CONNECT_S * 2) != ACK:
                    writer.close()
                    raise ConnectionError("the relay did not splice")
                self._note(peer, RELAYED, r)
                return reader, writer
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, RemoteError, KeyError, TypeError,
                    ValueError) as e:
                errors.append(f"via {r.name or r.peer_id}: {e or type(e).__name__}")
        raise ConnectionError("; ".join(errors) or "no reachable peer relays")

    # ---- standing links (kept by a peer behind NAT) ---------------------------------------
    async def keep_links(self) -> None:
        """Opens a standing link to each reachable member that lacks one (at most ``MAX_LINKS``)."""
        if self.my_reach() not in ("nat", "nat-symmetric"):
            return
        for tr in [p for p, t in self.links_out.items() if t.is_closing()]:
            del self.links_out[tr]
        todo = [r for r in self._reachable_others() if r.peer_id not in self.links_out]
        for r in todo[: max(0, MAX_LINKS - len(self.links_out))]:
            try:
                reply = await self.client.send(r.data_url, "reverse", {}, timeout=CONNECT_S, peer_id=r.peer_id)
                sock = await dial(r.data_url, REVERSE + bytes.fromhex(reply[0]["token"]))
                self.links_out[r.peer_id] = await self.server.adopt(sock)
                log.info("standing link to %s open (it reaches this peer through it)", r.name or r.peer_id)
            except (OSError, asyncio.TimeoutError, RemoteError, KeyError, TypeError, ValueError) as e:
                log.debug("standing link to %s failed: %s", r.peer_id, e)

    # ---- handlers -------------------------------------------------------------------------
    async def _on_reverse(self, header: dict, _):
        """A peer behind NAT asks for a token to open its standing link to us with."""
        peer = header["src"]
        token, fut = self.reversals.issue(peer)
        self.spawn(self._take_link(fut))
        return {"token": token.hex()}, ()

    async def _take_link(self, fut: asyncio.Future) -> None:
        try:
            peer, (reader, writer) = await asyncio.wait_for(fut, CONNECT_S * 2)
            reader, writer = await self.client.authenticate(reader, writer, peer)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError, ConnectionError) as e:
            log.debug("a standing link did not come: %r", e)
            return
        old = self.links.get(peer)
        self.links[peer] = Link(reader, writer)
        if old is not None:
            old.writer.close()
        self._link_changed.set()

    def _src_url(self, header: dict) -> str:
        rec = self._rec(header["src"])
        if rec is None or not rec.data_url:
            raise Retry(f"{header['src']} is not a member this peer knows")
        return rec.data_url

    async def _on_dialme(self, header: dict, _):
        """A reachable peer asks us (over our standing link) to open a connection to it."""
        sock = await dial(self._src_url(header), REVERSE + bytes.fromhex(str(header["token"]))[:16])
        await self.server.adopt(sock)
        return None

    async def _on_punch(self, header: dict, _):
        """A peer behind NAT asks us to coordinate hole punching with another one."""
        to = str(header.get("to", ""))
        link = self.links.get(to)
        if link is None or not link.alive():
            raise Retry(f"{to} keeps no standing link to this peer")
        answer = await request(link, "punched", {"from": header["src"], "addr": list(ip_port(header.get("addr")))},
                               timeout=CONNECT_S * 2)
        return {"addr": list(ip_port((answer or {}).get("addr")))}, ()

    async def _on_punched(self, header: dict, _):
        """Through our standing link: a peer wants to punch through to us; we learn our own public
        address on a fresh port, start dialing it from there, and tell it where."""
        remote = ip_port(header.get("addr"))
        if self._punching >= MAX_PUNCHING:
            raise Retry("this peer is punching through to enough peers already")
        local_port, mine = await observe(address_of(self._src_url(header)))
        self.spawn(self._punch_and_serve(local_port, remote))
        return {"addr": list(mine)}, ()

    async def _punch_and_serve(self, local_port: int, remote: tuple[str, int]) -> None:
        self._punching += 1
        try:
            sock = await punch(local_port, remote)
        except (OSError, asyncio.TimeoutError) as e:
            log.info("hole punching towards %s:%d failed: %s", remote[0], remote[1], e)
            return
        finally:
            self._punching -= 1
        await self.server.adopt(sock)

    async def _on_relay(self, header: dict, _):
        to, src = str(header.get("to", "")), header["src"]
        if not self.relay.offers():
            raise Retry("this peer does not relay")
        link = self.links.get(to)
        if link is None or not link.alive():
            raise Retry(f"{to} keeps no standing link to this peer")
        try:
            token = self.relay.issue(src, to)
        except RuntimeError as e:
            raise Retry(str(e)) from None
        await request(link, "relayme", {"token": token.hex()}, timeout=CONNECT_S * 2)
        return {"token": token.hex()}, ()

    async def _on_relayme(self, header: dict, _):
        sock = await dial(self._src_url(header), RELAY + bytes.fromhex(str(header["token"]))[:16] + b"b")
        self.spawn(self._serve_relayed(sock))
        return None

    async def _serve_relayed(self, sock: socket.socket) -> None:
        try:
            ack = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), CONNECT_S * 3)
        except (OSError, asyncio.TimeoutError):
            ack = b""
        if ack != ACK:
            sock.close()
            return
        await self.server.adopt(sock)

    def status(self, brief: bool = False) -> dict:
        names = {pid: (r.name or pid) for pid, r in self.records().items()}
        return {"reach": self.my_reach(),
                "paths": {names.get(p, p): {**u, "via": names.get(u["via"], u["via"])}
                          for p, u in sorted(self.used.items())},
                "standing_links_in": sorted(names.get(p, p) for p, lk in self.links.items() if lk.alive()),
                "standing_links_out": sorted(names.get(p, p) for p, t in self.links_out.items() if not t.is_closing()),
                "relay": self.relay.status()}
