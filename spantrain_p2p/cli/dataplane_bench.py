"""Data-plane throughput against raw asyncio TCP, between two processes on loopback.

``python -m spantrain_p2p.cli.dataplane_bench [--mib 16] [--reps 20]``: a server process answers two raw
TCP sockets (each reads exactly the payload, acks one byte) and the data plane (a framed ACT message,
decoded and validated like a training peer does: shape, dtype, sizes); the client sends the same
tensor through each, one message at a time, and prints MiB/s of each and the data plane's ratio to
the faster raw one (JSON with ``--json``). Then the same with the handshake every peer's data plane
now starts with (``authenticated``) and with ``--encrypt``'s records (``encrypted``), both ways: a
message to the server (``send``), and a 16 MiB reply pulled from it (``pull``, as a recovery fetch). The raw servers are asyncio's two ways to read a socket:
a ``StreamReader`` loop (whose 64 KiB default limit pauses the socket often), and a
``BufferedProtocol`` that receives straight into the payload's buffer (no copy at all: the most
plain asyncio TCP can move). The best of the rounds counts for each, so a moment of other load on
the machine does not decide the figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import struct
import time

import torch

from ..pipeline.messages import ACT, Expect, decode_tensor, encode_tensor
from ..net.client import DataPlaneClient, read_exactly
from ..net.dataplane import DataPlaneServer
from ..net.handshake import Authenticator
from ..swarm.identity import Identity

JOB = "bench"
PULL = "pull"
MODES = ("plain", "authenticated", "encrypted")


def _serve(nbytes: int, ready) -> None:
    torch.set_num_threads(1)  # as in a peer process

    async def main():
        numel = nbytes // 4
        expect = Expect(ACT, JOB, 1, frozenset({"client"}), (numel,), 1 << 20)

        async def on_act(header, buffers):
            e = expect if header.get("src") == "client" else Expect(ACT, JOB, 1, frozenset({header.get("src")}), (numel,), 1 << 20)
            _, _, t = decode_tensor(header, buffers, e, (0, 1 << 30))
            assert t.numel() == numel
            return None

        reply = encode_tensor(ACT, JOB, 1, 0, 0, "server", torch.randn(numel))

        async def on_pull(header, buffers):
            return reply

        async def on_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            try:
                while True:
                    (n,) = struct.unpack("!Q", await reader.readexactly(8))
                    await read_exactly(reader, n)
                    writer.write(b"k")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        class RecvInto(asyncio.BufferedProtocol):
            """Length prefix, then the payload received straight into its own bytearray."""

            def connection_made(self, transport):
                self.transport, self.head, self.body, self.got = transport, bytearray(8), None, 0

            def get_buffer(self, sizehint):
                if self.body is None:
                    return memoryview(self.head)[self.got:]
                return memoryview(self.body)[self.got:]

            def buffer_updated(self, nbytes):
                self.got += nbytes
                if self.body is None:
                    if self.got == 8:
                        (n,) = struct.unpack("!Q", self.head)
                        self.body, self.got = bytearray(n), 0
                elif self.got == len(self.body):
                    self.body, self.got = None, 0
                    self.transport.write(b"k")

        ident = Identity.generate()
        urls = []
        for auth in (None, Authenticator(ident), Authenticator(ident, encrypt=True)):
            dp = DataPlaneServer("127.0.0.1", 0, status=lambda: {}, max_message_bytes=nbytes + (1 << 20), auth=auth)
            dp.register(ACT, on_act)
            dp.register(PULL, on_pull)
            await dp.start()
            urls.append(dp.url)
        raw = await asyncio.start_server(on_raw, "127.0.0.1", 0)
        into = await asyncio.get_running_loop().create_server(RecvInto, "127.0.0.1", 0)
        ready.send((urls, raw.sockets[0].getsockname()[1], into.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


async def _client(urls: list[str], raw_ports: tuple[int, int], nbytes: int, reps: int, rounds: int) -> dict:
    t = torch.randn(nbytes // 4)
    payload = memoryview(t.numpy()).cast("B")
    conns = [await asyncio.open_connection("127.0.0.1", port) for port in raw_ports]
    ident = Identity.generate()
    clients = [DataPlaneClient(max_message_bytes=nbytes + (1 << 20), auth=a) for a in (None, Authenticator(ident),
                                                                                      Authenticator(ident))]

    def raw_once(reader, writer):
        async def once(_step):
            writer.write(struct.pack("!Q", payload.nbytes))
            writer.write(payload)
            await writer.drain()
            await reader.readexactly(1)

        return once

    def sender(i: int):
        src = "client" if i == 0 else ident.peer_id

        async def once(step):
            header, bufs = encode_tensor(ACT, JOB, 1, step, 0, src, t)
            await clients[i].send(urls[i], ACT, header, bufs, timeout=60)

        return once

    def puller(i: int):
        async def once(step):
            got = await clients[i].send(urls[i], PULL, {}, timeout=60)
            assert got is not None and got[1][0].nbytes == nbytes

        return once

    async def timed(fn):
        await fn(0)  # warm: connections open, buffers sized
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(reps):
                await fn(i)
            best = min(best, time.perf_counter() - t0)
        return reps * nbytes / best / 2**20

    stream, into = (raw_once(*c) for c in conns)
    try:
        raws = [await timed(stream), await timed(into)]
        dp = await timed(sender(0))  # the plain data plane, as before the handshake existed
        raws += [await timed(stream), await timed(into)]  # raw again: the machine's state did not drift in between
        modes = {}
        for i, mode in enumerate(MODES):  # interleaved, twice, best of each: drift hits all alike
            modes[mode] = {"send": await timed(sender(i)), "pull": await timed(puller(i))}
        for i, mode in enumerate(MODES):
            modes[mode] = {k: max(v, await timed((sender if k == "send" else puller)(i))) for k, v in modes[mode].items()}
    finally:
        for _, writer in conns:
            writer.close()
        for c in clients:
            await c.close()
    raw_stream, raw_into = max(raws[0], raws[2]), max(raws[1], raws[3])
    raw = max(raw_stream, raw_into)
    return {"mib": nbytes / 2**20, "reps": reps, "raw_mib_s": round(raw, 1),
            "raw_streamreader_mib_s": round(raw_stream, 1), "raw_recv_into_mib_s": round(raw_into, 1),
            "dataplane_mib_s": round(dp, 1), "ratio": round(dp / raw, 3),
            "modes_mib_s": {m: {k: round(v, 1) for k, v in d.items()} for m, d in modes.items()},
            "authenticated_over_plain": {k: round(modes["authenticated"][k] / modes["plain"][k], 3) for k in ("send", "pull")},
            "encrypted_over_plain": {k: round(modes["encrypted"][k] / modes["plain"][k], 3) for k in ("send", "pull")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spantrain_p2p.cli.dataplane_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=16.0, help="tensor size in MiB (default 16)")
    ap.add_argument("--reps", type=int, default=20, help="messages per timed round (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds; the best counts (default 3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    nbytes = int(args.mib * 2**20) // 4 * 4
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(nbytes, child), daemon=True)
    server.start()
    try:
        if not parent.poll(60):
            raise SystemExit("benchmark server did not start")
        urls, *ports = parent.recv()
        out = asyncio.run(_client(urls, tuple(ports), nbytes, args.reps, args.rounds))
    finally:
        server.terminate()
        server.join(5)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['mib']:g} MiB tensors on loopback: raw asyncio TCP {out['raw_mib_s']} MiB/s "
              f"(StreamReader {out['raw_streamreader_mib_s']}, BufferedProtocol {out['raw_recv_into_mib_s']}), "
              f"data plane {out['dataplane_mib_s']} MiB/s = {out['ratio']:.0%} of the faster raw")
        for m, d in out["modes_mib_s"].items():
            rel = "" if m == "plain" else (f" ({out[m + '_over_plain']['send']:.0%} and "
                                           f"{out[m + '_over_plain']['pull']:.0%} of plain)")
            print(f"  {m:>13}: send {d['send']} MiB/s, pull {d['pull']} MiB/s{rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
