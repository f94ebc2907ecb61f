"""``spantrain status``: the live members of a running swarm, read through a short-lived DHT client."""
from __future__ import annotations

import asyncio
import json
import sys
from typing import Optional

from ..swarm import discovery, membership


async def read_swarm_members(join: list[str], swarm: str, timeout: float, swarm_key_path: str = "",
                             identity_path: str = "", allow: tuple[str, ...] = ()) -> tuple[list, Optional[str]]:
    """(live member records, the pages' operator token or None) of a swarm, read through a
    short-lived DHT client (serves nothing). A closed swarm with an allow-list is read as a listed
    member: ``identity_path`` must be on ``allow``, and a member hands it the group key."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    from ..swarm import daemon_wire
    from ..swarm.daemon import tie_daemons_to_this_process

    daemon_wire.install()
    tie_daemons_to_this_process()
    join = discovery.parse_join(join)
    p2p = await P2P.create(initial_peers=join, startup_timeout=timeout, nat_port_map=False)  # nobody dials a reader
    node = None
    try:
        from ..swarm import group_key
        from ..swarm.guard import GuardedDHT
        from ..swarm.identity import Identity
        from ..swarm.sealing import SwarmKey
        from ..swarm.validator import SwarmValidator

        key = SwarmKey.load(swarm_key_path) if swarm_key_path else None
        validator = SwarmValidator(swarm, closed=key is not None)  # what members' nodes return is checked too
        node = await asyncio.wait_for(DHTNode.create(p2p=p2p, initial_peers=join, client_mode=True, wait_timeout=3,
                                                     record_validator=validator), timeout)
        guard = GuardedDHT(node, key, frozenset(allow) if allow else None)
        if guard.grouped:
            if not identity_path:
                raise ValueError("a closed swarm with an allow-list is read with --identity PATH (an id on its list)")
            identity = validator.identity = Identity.load(identity_path)
            try:
                guard.group = await group_key.request(guard, swarm, identity, timeout, 0.5, membership.BadRecordLog())
            except group_key.GroupKeyTimeout as e:
                raise ValueError(str(e)) from None
        view = await membership.read_members(guard, swarm, membership.BadRecordLog())
        reason = guard.why_locked_out(swarm) if not view else None
        if reason:
            raise ValueError(reason)
        token = guard.group.operator_token if guard.group is not None else key.operator_token if key else None
        return sorted((r for r in view.values() if r.alive), key=lambda r: r.peer_id), token
    finally:
        if node is not None:
            await node.shutdown()
        await p2p.shutdown()


async def status_command(args) -> int:
    try:
        from ..peer_command.main import allow_list

        members, token = await read_swarm_members(args.join, args.swarm, args.timeout, args.swarm_key or "",
                                                  args.identity or "", allow_list(args.allow))
    except asyncio.TimeoutError:
        print(f"spantrain status: error: no answer from {args.join} within {args.timeout:.0f}s", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"spantrain status: error: {e}", file=sys.stderr)
        return 1
    peers = [{"peer_id": r.peer_id, "name": r.name, "state": r.state, "address": r.maddrs[0] if r.maddrs else "",
              "data_url": r.data_url, "version": r.version} for r in members]
    grouped = bool(args.swarm_key and args.allow)
    if args.json:
        print(json.dumps({"swarm": args.swarm, "peers": peers, **({"operator_token": token} if grouped else {})}))
    else:
        print(f"swarm {args.swarm!r}: {len(peers)} live peer(s)")
        for p in peers:
            print(f"  {p['name'] or '-':<12} {p['state']:<10} v{p['version']:<8} {p['address']}")
        if grouped:  # its pages take the group key's token, which `spantrain keygen` could not print
            print(f"operator token of its pages (keep it secret): {token}")
    return 0
