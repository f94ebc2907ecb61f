"""Throughput of 16 MiB tensors over each path of the ladder (direct, reversed, hole-punched, relayed).

``python -m spantrain_p2p.cli.path_bench --join MADDR --to NAME[,NAME…] [--mib 16] [--reps 10]``: a
peer (no job) joins the swarm, waits for the named members, opens its connection to each (the path
the ladder takes: ``/status`` ``network``), then sends ``--reps`` tensors of ``--mib`` MiB one after
another (the bulk probe every peer answers: received into the frame's buffer, acknowledged) and
prints one JSON line per destination: the path, the relay or coordinator, MiB/s and Mbit/s.
``scripts/nat_world.py bench`` runs it from hosts of a virtual internet.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy

from ..net.addresses import default_binds
from ..net.probe_messages import PROBE_KIND, PROBE_VERSION


async def run(a) -> list[dict]:
    from ..peer import Peer, PeerConfig

    listen, host = default_binds(None, None, a.join)
    out = []
    async with Peer(PeerConfig(join=tuple(a.join), listen=listen, host=host, name=a.name, swarm=a.swarm)) as peer:
        want = a.to.split(",")
        deadline = time.monotonic() + a.timeout
        while True:
            named = {r.name: r for r in peer.live_members() if r.name}
            if all(n in named for n in want):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"path_bench: members {sorted(set(want) - set(named))} not seen")
            await asyncio.sleep(0.5)
            await peer.members()
        await asyncio.sleep(2 * peer.config.poll_s)  # until the others have seen our record
        payload = numpy.random.default_rng(0).integers(0, 255, a.mib << 20, dtype=numpy.uint8)
        for name in want:
            rec = named[name]
            header = {"v": PROBE_VERSION, "op": "bulk"}
            await peer.client.send(rec.data_url, PROBE_KIND, header, [payload], timeout=60, peer_id=rec.peer_id)
            t0 = time.perf_counter()
            for _ in range(a.reps):
                await peer.client.send(rec.data_url, PROBE_KIND, header, [payload], timeout=60, peer_id=rec.peer_id)
            took = time.perf_counter() - t0
            used = peer.paths.status()["paths"].get(name, {})
            mib_s = a.reps * a.mib / took
            out.append({"from": a.name, "to": name, "path": used.get("path"), "via": used.get("via"),
                        "mib": a.mib, "reps": a.reps, "mib_s": round(mib_s, 1), "mbit_s": round(mib_s * 8 * 1.048576, 1)})
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m spantrain_p2p.cli.path_bench", description=__doc__.splitlines()[0])
    p.add_argument("--join", action="append", required=True)
    p.add_argument("--to", required=True, help="names of the members to send to, comma-separated")
    p.add_argument("--name", default="bench")
    p.add_argument("--swarm", default="default")
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    asyncio.run(run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
