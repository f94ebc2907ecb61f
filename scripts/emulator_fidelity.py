"""How long the link emulator takes to carry one message, against what its link promises, on a
loaded host: ``--hogs`` busy processes share the cores with it (as a swarm of 16 peers and their
daemons does on this 2-core box), and ``--loop-block-ms`` holds the sender's own event loop now and
then (as a peer's other work does: decoding a tensor, a status page, the DHT, the compute thread's
turns with the GIL). A sender that wakes late holds the emulated link idle unless the emulator gives
that time back (``net.emulator``: a late flow's credit).

    python scripts/emulator_fidelity.py --hogs 0 8 --loop-block-ms 0 10 30 60 --mbit 50 --mib 8 --runs 5
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from spantrain_p2p.net.emulator import LinkEmulator  # noqa: E402
from spantrain_p2p.scenario import parse  # noqa: E402


def _hog(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _scenario(mbit: float, rtt_ms: float):
    return parse({"name": "fidelity", "link_classes": {"l": {"rtt_ms": rtt_ms, "mbps": mbit}},
                  "device_classes": {"d": {"tflops": 1.0, "memory_gb": 1}}, "regions": {"r": {"link": "l"}},
                  "peers": [{"name": "a", "region": "r", "device": "d"}, {"name": "b", "region": "r", "device": "d"}]})


async def _blocker(block_s: float, every_s: float) -> None:
    """Holds the event loop ``block_s`` every ``every_s`` (other work of the same peer)."""
    while True:
        await asyncio.sleep(every_s)
        end = time.monotonic() + block_s
        while time.monotonic() < end:
            pass


async def _transfers(mbit: float, rtt_ms: float, mib: float, runs: int, charge: float,
                     block_s: float, every_s: float) -> list[float]:
    link = LinkEmulator(_scenario(mbit, rtt_ms), "a").link_for("b")
    payload = bytes(int(mib * 2**20 / charge))
    blocker = asyncio.create_task(_blocker(block_s, every_s)) if block_s > 0 else None
    out = []
    for _ in range(runs):
        t0 = time.monotonic()
        async for _piece in link.paced([payload], sent_at=t0, charge=charge):
            await asyncio.sleep(0)  # the HTTP client's write of the piece: the loop turns
        out.append(time.monotonic() - t0)
    if blocker is not None:
        blocker.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, 4, 8], help="busy processes beside it")
    ap.add_argument("--mbit", type=float, default=50.0)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--mib", type=float, default=8.0, help="message size")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--charge", type=float, default=1.0, help="emulated bytes per real byte (a workload's proxy)")
    ap.add_argument("--loop-block-ms", type=float, nargs="+", default=[0.0],
                    help="the sender's event loop held this long now and then")
    ap.add_argument("--loop-every-ms", type=float, default=100.0, help="how often (default 100 ms)")
    args = ap.parse_args()
    ideal = args.mib * 2**20 / (args.mbit * 1e6 / 8) + args.rtt_ms / 2000
    print(f"{args.mib} MiB at {args.mbit} Mbit/s, RTT {args.rtt_ms} ms: ideal {ideal:.3f} s "
          f"({time.strftime('%H:%M UTC', time.gmtime())}, {os.cpu_count()} cores)")
    for n in args.hogs:
        stop = mp.Event()
        hogs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(n)]
        for h in hogs:
            h.start()
        try:
            for block in args.loop_block_ms:
                times = asyncio.run(_transfers(args.mbit, args.rtt_ms, args.mib, args.runs, args.charge,
                                               block / 1e3, args.loop_every_ms / 1e3))
                print(f"  {n:>2} busy processes, loop held {block:>4.0f} ms every {args.loop_every_ms:.0f} ms: "
                      f"median {statistics.median(times):.3f} s = {statistics.median(times) / ideal:.3f} x ideal "
                      f"(worst {max(times) / ideal:.3f})")
        finally:
            stop.set()
            for h in hogs:
                h.join(5)


if __name__ == "__main__":
    main()
