"""Whether others can reach this peer, learned at start (as Petals does: others dial it back), and
the paths to the peers that cannot be dialed (``net.paths``), kept while the peer runs.

At start a peer asks up to three members it can reach to dial each of its announced addresses back
(``dialback``; each also tries the address it sees the request come from, with the data port: a
forwarded port). One that got through makes it ``direct``, at the address that worked; none makes it
behind NAT: it then learns its public mapping from two of them (``STO1``), the same port for both
(``nat``: hole punching can work) or not (``nat-symmetric``: relays only), and keeps standing links
to the reachable members, through which they reach it. It says so in one line. A peer behind NAT
with no reachable member to go through, within ``NO_PATH_S`` of its start, stops (``PeerError``):
nobody could send it a tensor, and a member nobody can reach would stall every plan it is in.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import Optional

from ..net.addresses import address_of, url_of
from ..net.paths import Paths, observe
from ..net.connections import REMOTE
from ..net.client import PAGE_KIND
from ..net.wire import RemoteError
from .config import PeerError

log = logging.getLogger("spantrain.peer")

DIALBACK_KIND = "dialback"
HELPERS = 3
NO_PATH_S = 25.0  # from the peer's start: with the process's own start, the user hears within 30 s
LINK_EVERY_S = 2.0


def install(peer) -> Paths:
    """The ladder of paths on this peer's client and server, and the dial-back handler."""
    cfg = peer.config
    paths = Paths(peer.client, peer.dataplane, peer.peer_id, lambda: peer._view, lambda: peer.reach,
                  relay_circuits=cfg.relay_circuits, spawn=lambda c: peer.spawn(c, "paths"))

    async def dialback(header: dict, _):
        urls = [u for u in header.get("urls", []) if isinstance(u, str) and u.startswith("http://")][:4]
        remote = REMOTE.get()
        if remote and urls:
            port = address_of(urls[0])[1]
            urls.append(url_of(remote[0], port))  # a forwarded port, announced or not
        urls = list(dict.fromkeys(urls))

        async def one(url: str) -> Optional[str]:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(*address_of(url)), 3.0)
            except (OSError, asyncio.TimeoutError, ValueError):
                return None
            try:
                if peer.client.auth is not None:
                    await asyncio.wait_for(peer.client.auth.client(reader, writer, header["src"]), 5.0)
                return url
            except Exception:
                return None
            finally:
                writer.close()
        reached = [u for u in await asyncio.gather(*(one(u) for u in urls)) if u]
        return {"reached": reached}, ()

    async def page(header: dict, _):
        path = str(header.get("path", ""))
        d = await peer.dataplane.page(path) if path.startswith("/") else None
        if d is None:
            raise ValueError(f"no page {path[:80]!r}")
        return {}, [json.dumps(d, allow_nan=False, default=str).encode()]

    peer.dataplane.register(DIALBACK_KIND, dialback)
    peer.dataplane.register(PAGE_KIND, page)
    peer.status_extras["network"] = paths.status
    return paths


async def check(peer, final: bool, timeout: float = 12.0) -> str:
    """Asks up to ``HELPERS`` reachable members to dial this peer back; sets ``peer.reach`` (and puts
    the address that worked first); logs the one line. ``final``: a peer behind NAT with nobody to go
    through raises ``PeerError`` instead of waiting (the caller gives it until ``NO_PATH_S``)."""
    me = peer.peer_id
    linked = set(peer.paths.links) if peer.paths is not None else set()  # behind NAT, but reach us through them
    helpers = [r for r in peer.live_members() if r.peer_id != me and r.data_url
               and (r.reach in ("", "direct") or r.peer_id in linked)][:HELPERS]
    if not helpers:
        return peer.reach
    urls = list(peer.dataplane.announced) or [peer.dataplane.url]

    async def ask(r):
        try:
            reply = await peer.client.send(r.data_url, DIALBACK_KIND, {"urls": urls}, timeout=timeout, peer_id=r.peer_id)
            return r, (reply or ({},))[0]
        except (OSError, asyncio.TimeoutError, RemoteError) as e:
            return r, e
    answers = await asyncio.gather(*(ask(r) for r in helpers))
    heard = [(r, a) for r, a in answers if isinstance(a, dict)]
    reached = Counter(u for _, a in heard for u in a.get("reached", []) if isinstance(u, str))
    if reached:
        best = max(reached, key=lambda u: (reached[u], -urls.index(u) if u in urls else -99))
        peer.dataplane.announced = [best] + [u for u in peer.dataplane.announced if u != best]
        peer.reach = "direct"
        log.info("reachability: direct at %s (dialed back by %d of %d peers asked)", best,
                 sum(1 for _, a in heard if best in a.get("reached", [])), len(helpers))
        return peer.reach
    if not heard:
        if final:
            raise PeerError(no_path_message(peer, [f"{r.name or r.peer_id}: {str(a) or type(a).__name__}" for r, a in answers]))
        return peer.reach
    seen, port = [], 0
    for r, _ in heard[:2]:
        try:
            port, mapped = await observe(address_of(r.data_url), port)
            seen.append((port, mapped))
        except (OSError, asyncio.TimeoutError, ConnectionError):
            continue
    public = seen[0][1][0] if seen else ""
    if len(seen) >= 2:
        symmetric = len({m[1] for _, m in seen}) > 1
    else:
        symmetric = bool(seen) and seen[0][1][1] != seen[0][0]  # a router that kept our port keeps mappings
    peer.reach = "nat-symmetric" if symmetric else "nat"
    if public:  # where it is (unreachable, but unique, unlike 192.168.1.2)
        own = url_of(public, peer.dataplane.port)
        peer.dataplane.announced = [own] + [u for u in peer.dataplane.announced if u != own]
    log.info("reachability: behind NAT (%s mapping, public address %s): no peer could dial it back at %s; "
             "peers reach it through %d reachable peer(s): by reversal, %sor relay",
             "symmetric" if symmetric else "endpoint-independent", public or "unknown", ", ".join(urls),
             len(heard), "" if symmetric else "hole punching ")
    return peer.reach


def no_path_message(peer, tried: list[str]) -> str:
    port = peer.dataplane.port
    return (f"reachability: no peer can reach this one and no reachable peer answers to go through "
            f"(asked: {'; '.join(tried) or 'nobody: no member with a reachable address'}). Forward TCP port {port} "
            f"(the data plane; --data-port fixes it) on your router to this machine and start with "
            f"--announce YOUR_PUBLIC_IP:{port}, or join a swarm that has a peer with a public address")


async def at_start(peer, joining: bool) -> None:
    """The check before the peer announces itself (others must not dial an unreachable address).
    ``joining``: it joined others (a founder alone has nobody to ask yet)."""
    def left() -> float:
        return NO_PATH_S - (time.monotonic() - peer.started_at)

    await check(peer, final=False, timeout=max(3.0, min(12.0, left())))
    if peer.reach or not joining:
        return
    # nobody answered: wait for a reachable member, until NO_PATH_S from the start
    while left() > 6.0:
        await asyncio.sleep(2.0)
        await peer.members()
        if await check(peer, final=False, timeout=min(12.0, left() - 3.0)):
            return
    await check(peer, final=True, timeout=max(1.0, left()))
    if not peer.reach:
        raise PeerError(no_path_message(peer, []))


async def keep(peer, paths: Paths) -> None:
    """While the peer runs: checks again while its reachability is unknown (a founder alone at start),
    and keeps the standing links of a peer behind NAT."""
    while True:
        try:
            if not peer.reach and len(peer.live_members()) > 1:
                if await check(peer, final=False):
                    await peer._announce()
            await paths.keep_links()
        except Exception as e:
            log.warning("keeping paths failed: %s", e)
        await asyncio.sleep(LINK_EVERY_S)


