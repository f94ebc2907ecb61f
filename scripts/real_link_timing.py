"""How a send over a real link reads when its receiver answers late (root: network namespaces).

Host a sends 256 KiB messages to host b over a veth pair, a's uplink capped with tbf at
``--mbit``; b reads each whole, then answers ``--late`` ms later (``--hold``: waits before reading
it instead, so the bytes sit in its socket). Per message, the rate two ways: what the passive
estimate reads on a real link (send to answer, less the kernel's smoothed RTT), and the kernel's
own delivery rate (``TCP_INFO``'s ``tcpi_delivery_rate``, with how many samples it marked
application-limited). Prints the medians and ranges of messages 6-40.

    sudo .venv/bin/python scripts/real_link_timing.py --mbit 200 --late 20
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from spantrain_p2p.launch import hosts  # noqa: E402
from spantrain_p2p.osproc import enter_netns  # noqa: E402

SIZE = 256 << 10
PORT = 5555
SERVER = r'''
import asyncio, struct, sys
late, hold = float(sys.argv[1]) / 1000, sys.argv[2] == "hold"
async def handle(r, w):
    try:
        while True:
            (n,) = struct.unpack("!I", await r.readexactly(4))
            if hold and late:
                await asyncio.sleep(late)
            await r.readexactly(n)
            if late and not hold:
                await asyncio.sleep(late)
            w.write(b"k")
            await w.drain()
    except asyncio.IncompleteReadError:
        pass
async def main():
    s = await asyncio.start_server(handle, "0.0.0.0", %d, limit=1 << 20)
    print("up", flush=True)
    await s.serve_forever()
asyncio.run(main())
''' % PORT


def tcp_info(sock: socket.socket) -> tuple[float, int, float]:
    """(smoothed RTT in s, delivery rate sample app-limited (0/1), delivery rate in bytes/s)."""
    b = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 168)
    return struct.unpack_from("I", b, 68)[0] / 1e6, b[7] & 1, float(struct.unpack_from("Q", b, 160)[0])


def client(ns: str, addr: str, n: int, out: list) -> None:
    enter_netns(ns)  # this thread only

    async def main():
        r, w = await asyncio.open_connection(addr, PORT)
        sock = w.get_extra_info("socket")
        payload = struct.pack("!I", SIZE) + bytes(SIZE)
        for _ in range(n):
            t0 = time.monotonic()
            w.write(payload)
            await w.drain()
            await r.readexactly(1)
            out.append((time.monotonic() - t0, *tcp_info(sock)))
            await asyncio.sleep(0.05)
        w.close()

    asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbit", type=float, default=200.0, help="a's uplink, Mbit/s (tbf)")
    ap.add_argument("--late", type=float, default=20.0, help="ms b's answer comes late")
    ap.add_argument("--hold", action="store_true", help="b waits before reading the message, not after")
    ap.add_argument("--messages", type=int, default=40)
    a = ap.parse_args()
    why = hosts.why_not()
    if why is not None:
        print(f"no network namespaces here: {why}")
        return 2
    out: list = []
    with hosts.World("rl") as world:
        ha, hb = world.public("a"), world.public("b")
        world.shape(ha, a.mbit)
        srv = subprocess.Popen([*hb.wrap(), sys.executable, "-c", SERVER, str(a.late), "hold" if a.hold else "after"],
                               stdout=subprocess.PIPE, text=True)
        try:
            srv.stdout.readline()
            t = threading.Thread(target=client, args=(ha.ns, hb.address, a.messages, out))
            t.start()
            t.join()
        finally:
            srv.kill()
            srv.wait()
    rows = out[5:]
    timed = [SIZE * 8 / max(1e-9, el - rtt) / 1e6 for el, rtt, _, _ in rows]
    kernel = [rate * 8 / 1e6 for _, _, _, rate in rows]
    print(f"{a.mbit:g} Mbit/s uplink, answers {a.late:g} ms late ({'before' if a.hold else 'after'} reading), "
          f"RTT {rows[-1][1] * 1e3:.2f} ms, {len(rows)} messages of 256 KiB")
    print(f"  send to answer less RTT: median {statistics.median(timed):.0f} Mbit/s ({min(timed):.0f}-{max(timed):.0f})")
    print(f"  TCP_INFO delivery rate:  median {statistics.median(kernel):.0f} Mbit/s ({min(kernel):.0f}-{max(kernel):.0f}), "
          f"{sum(r[2] for r in rows)} of {len(rows)} marked application-limited")
    return 0


if __name__ == "__main__":
    sys.exit(main())
