"""``spantrain status``: the live members of a running swarm, read through a short-lived DHT client."""
from __future__ import annotations

import asyncio
import json
import sys

from ..swarm import discovery, membership


async def read_swarm_members(join: list[str], swarm: str, timeout: float, swarm_key_path: str = "") -> list:
    """Live member records of a swarm, read through a short-lived DHT client (serves nothing)."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    from ..swarm.daemon import tie_daemons_to_this_process

    tie_daemons_to_this_process()
    join = discovery.parse_join(join)
    p2p = await P2P.create(initial_peers=join, startup_timeout=timeout)
    node = None
    try:
        node = await asyncio.wait_for(
            DHTNode.create(p2p=p2p, initial_peers=join, client_mode=True, wait_timeout=3), timeout
        )
        from ..swarm.guard import GuardedDHT
        from ..swarm.sealing import SwarmKey

        guard = GuardedDHT(node, SwarmKey.load(swarm_key_path) if swarm_key_path else None)
        view = await membership.read_members(guard, swarm, membership.BadRecordLog())
        locked_out = guard.why_locked_out(swarm) if not view else None
        if locked_out:
            raise ValueError(locked_out)
        return sorted((r for r in view.values() if r.alive), key=lambda r: r.peer_id)
    finally:
        if node is not None:
            await node.shutdown()
        await p2p.shutdown()


async def status_command(args) -> int:
    try:
        members = await read_swarm_members(args.join, args.swarm, args.timeout, args.swarm_key or "")
    except asyncio.TimeoutError:
        print(f"spantrain status: error: no answer from {args.join} within {args.timeout:.0f}s", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"spantrain status: error: {e}", file=sys.stderr)
        return 1
    peers = [{"peer_id": r.peer_id, "name": r.name, "state": r.state, "address": r.maddrs[0] if r.maddrs else "",
              "data_url": r.data_url, "version": r.version} for r in members]
    if args.json:
        print(json.dumps({"swarm": args.swarm, "peers": peers}))
    else:
        print(f"swarm {args.swarm!r}: {len(peers)} live peer(s)")
        for p in peers:
            print(f"  {p['name'] or '-':<12} {p['state']:<10} v{p['version']:<8} {p['address']}")
    return 0
