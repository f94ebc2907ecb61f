#!/usr/bin/env python3
"""Issue 29's budget attacks against a training swarm, on loopback: samples/s of the members in a
clean window, then under each attack, then clean again (back to back, so the box's noise hits all
alike), and what each attack got in. The attackers send from their own loopback addresses
(127.0.0.66-68), the members from 127.0.0.1.

    .venv/bin/python scripts/budget_figures.py [--window 12] [--steps 6000] [--json]

- trickle: 2 identities with live member records (an open swarm lets anyone be a member), 4
  connections each, announcing 256 MiB frames (their whole 1 GiB budget each) and sending one byte
  every 5 s;
- idle-flood: 8 identities x 64 authenticated connections that never send a request;
- silent-sockets: 64 plain TCP connections from one address that never send a byte (reopened
  whenever the target closes one).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spantrain_p2p.launch import budget_attacks  # noqa: E402
from spantrain_p2p.launch.processes import PeerProcess, wait_until  # noqa: E402


async def rate(p: PeerProcess, window_s: float, samples_per_step: int) -> float:
    s0 = (await asyncio.to_thread(p.status))["train"]["steps_done"]
    t0 = time.monotonic()
    await asyncio.sleep(window_s)
    s1 = (await asyncio.to_thread(p.status))["train"]["steps_done"]
    return (s1 - s0) * samples_per_step / (time.monotonic() - t0)


async def members(address: str, swarm: str, n: int, run_dir: str):
    """``n`` bare peers (live member records, no trainer) and their identities."""
    from spantrain_p2p.peer.config import PeerConfig
    from spantrain_p2p.peer.node import Peer
    from spantrain_p2p.swarm.identity import Identity

    out = []
    for i in range(n):
        path = os.path.join(run_dir, f"attacker{i}.id")
        peer = Peer(PeerConfig(join=(address,), swarm=swarm, identity_path=path, name=f"attacker{i}"))
        await peer.start()
        out.append((peer, Identity.load(path)))
    return out


async def main_async(args) -> dict:
    run_dir = tempfile.mkdtemp(prefix="budget-")
    swarm = f"budget-{os.getpid()}"
    common = ["--swarm", swarm]
    a = PeerProcess("a", [*common, "--steps", str(args.steps), "--peers", "2", "--plan", "even", "--name", "a"],
                    run_dir).start()
    procs = [a]
    bare = []
    try:
        a.wait_ready(60)
        b = PeerProcess("b", [*common, "--join", a.info["address"], "--name", "b"], run_dir).start()
        procs.append(b)
        b.wait_ready(60)
        await asyncio.to_thread(wait_until, lambda: all(p.status()["state"] == "training" for p in (a, b)), 90)
        job = (await asyncio.to_thread(a.status, 5.0, "/report"))["job"]
        sps = job["micro_batch_size"] * job["num_micro_batches"]
        # the attackers would run on machines of their own: here they share the box's 2 cores with
        # the members, so they run at the lowest priority (what is measured is the members' loss)
        os.nice(19)
        bare = await members(a.info["address"], swarm, 2, run_dir)
        ids = [i for _, i in bare] + budget_attacks.identities(6)
        target = b  # it receives stage 0's activations
        host, port = target.info["data_url"].removeprefix("http://").rsplit(":", 1)
        rows = []
        for attack in budget_attacks.ATTACKS:
            clean = await rate(a, args.window, sps)
            stop = asyncio.Event()
            task = asyncio.create_task(budget_attacks.run(attack, host, int(port), stop, ids))
            await asyncio.sleep(3.0)  # the attack is in place
            attacked, gets_in = await asyncio.gather(rate(a, args.window, sps),
                                                     budget_attacks.newcomer_gets_in(host, int(port)))
            stop.set()
            outcome = await task
            after = await rate(a, args.window, sps)
            base = statistics.mean([clean, after])
            rows.append({"attack": attack, "clean_samples_s": round(base, 1), "attacked_samples_s": round(attacked, 1),
                         "ratio": round(attacked / base, 3) if base else None, "newcomer_gets_in": gets_in,
                         "attacker": outcome.to_dict()})
            print(f"{attack:15s} clean {clean:7.1f} / {after:7.1f} samples/s, under attack {attacked:7.1f} "
                  f"({attacked / base:.2f} of clean); a newcomer's handshake got in: {gets_in}; attacker: "
                  f"{outcome.to_dict()}", flush=True)
        refused = (await asyncio.to_thread(target.status))
        return {"hour_utc": time.strftime("%H:%M", time.gmtime()), "window_s": args.window, "rows": rows,
                "target_state": refused["state"]}
    finally:
        for peer, _ in bare:
            await peer.close()
        for p in procs:
            p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=12.0, help="seconds per measuring window")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not budget_attacks.loopback_source_ok("127.0.0.66"):
        print("this host cannot send from 127.0.0.66", file=sys.stderr)
        return 2
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
