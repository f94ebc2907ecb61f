"""The CPU one pipeline message costs, sender and receiver, against a plain blocking socket (issue 31).

A server process takes ACT messages (one micro-batch's activation of the side-by-side's job: 8 x 64
x 128 fp32, 256 KiB) through the data plane as a peer does: an authenticated connection, encrypted
or not, the frame decoded and checked (``decode_tensor``), answered; the client sends them one at a
time with ``DataPlaneClient.send``. Both run on the event loop a peer runs (``--event-loop``, as
``spantrain-peer``'s: uvloop by default; before 2026-12-01 this script ran asyncio's own, whatever
the peers ran). Then the same bytes through a blocking TCP socket (a length, the
payload, a one-byte answer), as a C++ transport like gloo's moves them. Printed: the CPU seconds
each process spent per message (``time.process_time`` for the client, ``/proc/PID/stat`` for the
server) and the wall time per message. Run it on an idle machine:

    .venv/bin/python scripts/message_cpu.py [--messages 2000] [--event-loop uvloop|asyncio]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import struct
import time

import torch

from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer
from spantrain_p2p.net.handshake import Authenticator
from spantrain_p2p.peer_command.main import _loop_factory
from spantrain_p2p.pipeline.messages import ACT, Expect, decode_tensor, encode_tensor
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.train.cpu_use import process_cpu_s

NUMEL = 8 * 64 * 128
JOB = "message-cpu"


def serve_dataplane(encrypt: bool, loop: str, ready) -> None:
    torch.set_num_threads(1)  # as in a peer

    async def main():
        def on_act(header, buffers):  # what the transport's inline handler does with a frame
            decode_tensor(header, buffers, Expect(ACT, JOB, 1, frozenset({header.get("src")}), (NUMEL,), 1 << 20),
                          (0, 1 << 30))

        server = DataPlaneServer("127.0.0.1", 0, status=lambda: {},
                                 auth=Authenticator(Identity.generate(), encrypt=encrypt))
        server.register(ACT, on_act, inline=True)
        await server.start()
        ready.send(server.url)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        runner.run(main())


def serve_socket(ready) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ready.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    buf = memoryview(bytearray(NUMEL * 4))
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        (n,) = struct.unpack("!Q", head)
        got = 0
        while got < n:
            got += conn.recv_into(buf[got:n])
        conn.sendall(b"k")


async def through_dataplane(url: str, messages: int) -> tuple[float, float]:
    """(client CPU s, wall s) for ``messages`` ACT messages, after 20 to warm up."""
    ident = Identity.generate()
    client = DataPlaneClient(auth=Authenticator(ident))
    t = torch.randn(NUMEL)
    try:
        for i in range(20 + messages):
            if i == 20:
                c0, w0 = time.process_time(), time.perf_counter()
            header, bufs = encode_tensor(ACT, JOB, 1, i, 0, ident.peer_id, t)
            await client.send(url, ACT, header, bufs)
        return time.process_time() - c0, time.perf_counter() - w0
    finally:
        await client.close()


def measured(ctx, target, args, run) -> dict:
    """Starts the server, runs the client (``run(address)`` -> (client CPU s, wall s)), per message in us."""
    parent, child = ctx.Pipe()
    server = ctx.Process(target=target, args=(*args, child), daemon=True)
    server.start()
    try:
        address = parent.recv()
        s0 = process_cpu_s(server.pid)
        client_s, wall_s, n = run(address)
        server_s = process_cpu_s(server.pid) - s0
    finally:
        server.terminate()
        server.join(5)
    return {"client_us": round(1e6 * client_s / n), "server_us": round(1e6 * server_s / n), "wall_us": round(1e6 * wall_s / n)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the data plane's event loop, both ends (a peer's --event-loop; default uvloop)")
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    n = a.messages

    def plain(port):
        sock = socket.create_connection(("127.0.0.1", port))
        payload = torch.randn(NUMEL).numpy().tobytes()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            sock.sendall(struct.pack("!Q", len(payload)))
            sock.sendall(payload)
            sock.recv(1)
        out = time.process_time() - c0, time.perf_counter() - w0, n
        sock.close()
        return out

    def client(url):
        with asyncio.Runner(loop_factory=_loop_factory(a.event_loop)) as runner:
            return (*runner.run(through_dataplane(url, n)), n)

    print(f"event loop: {a.event_loop}")
    for name, target, args, run in (
            ("data plane, encrypted", serve_dataplane, (True, a.event_loop), client),
            ("data plane, not encrypted", serve_dataplane, (False, a.event_loop), client),
            ("blocking socket", serve_socket, (), plain)):
        r = measured(ctx, target, args, run)
        print(f"{name:>26}: CPU a message {r['client_us']} us sending, {r['server_us']} us receiving; "
              f"{r['wall_us']} us a message")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
