"""Joining the DHT through the ``--join`` peers, retried with backoff until the join timeout.

hivemind's ``DHTNode.create`` pings the initial peers once and gives up after ``bootstrap_timeout``
("none of the initial_peers responded to a ping"). A founder busy starting a large job, or a box
loaded by a launch of many peers at once, can miss that one window; a joiner then exited although
the swarm was there. Here the node is created without initial peers, and they are pinged again
with growing pauses (0.5 s, 1 s, 2 s, at most 4 s) until one answers or the join timeout passes; then
the node looks up its own neighbourhood as hivemind's bootstrap does.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("spantrain.join")
FIRST_PAUSE_S, MAX_PAUSE_S = 0.5, 4.0


class BootstrapFailed(RuntimeError):
    """No initial peer answered a DHT ping within the join timeout; the message says what was tried."""


async def bootstrap(node, join: list[str], timeout_s: float) -> int:
    """Pings the peers of ``join`` (multiaddrs ending in /p2p/ID) until one answers; returns the tries
    it took. ``BootstrapFailed`` after ``timeout_s``; a ``ValidationError`` of the answer (the peer
    cannot call this node back) is raised at once: trying again would not change it."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    clock = asyncio.get_running_loop().time
    peers = sorted({PeerID.from_base58(Multiaddr(a)["p2p"]) for a in join}, key=str)
    deadline = clock() + timeout_s
    tries, pause = 0, FIRST_PAUSE_S
    while True:
        tries += 1
        answers = await asyncio.gather(*(node.protocol.call_ping(p, validate=True, strict=True) for p in peers),
                                       return_exceptions=True)
        if any(a is not None and not isinstance(a, BaseException) for a in answers):
            break
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        left = deadline - clock()
        if left <= 0:
            raise BootstrapFailed(f"none of {len(peers)} peer(s) ({', '.join(join)}) answered a DHT ping in "
                                  f"{tries} tries over {timeout_s:.0f}s: is the address right, the peer running "
                                  f"and its port reachable from here?")
        log.info("no answer to the DHT ping from %s (try %d); trying again in %.1fs", ", ".join(join), tries,
                 min(pause, left))
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, MAX_PAUSE_S)
    # as hivemind's bootstrap: find this node's nearest neighbours, filling the routing table
    await node.find_nearest_nodes([node.node_id])
    if tries > 1:
        log.info("joined the DHT on try %d", tries)
    return tries

