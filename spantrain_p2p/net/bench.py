"""Data-plane throughput against raw asyncio TCP, between two processes on loopback.

``python -m spantrain_p2p.net.bench [--mib 16] [--reps 20]``: a server process answers both a raw
TCP socket (reads exactly the payload, acks one byte) and the data plane (a framed ACT message,
decoded and validated like a training peer does: shape, dtype, sizes); the client sends the same
tensor through each, one message at a time, and prints MiB/s of both and their ratio (JSON with
``--json``). The best of three rounds counts for each, so a moment of other load on the machine
does not decide the figure.
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
from .dataplane import DataPlaneClient, DataPlaneServer

JOB = "bench"


def _serve(nbytes: int, ready) -> None:
    async def main():
        numel = nbytes // 4
        expect = Expect(ACT, JOB, 1, frozenset({"client"}), (numel,), 1 << 20)

        async def on_act(header, buffers):
            _, _, t = decode_tensor(header, buffers, expect, (0, 1 << 30))
            assert t.numel() == numel
            return None

        async def on_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            try:
                while True:
                    (n,) = struct.unpack("!Q", await reader.readexactly(8))
                    buf = bytearray(n)
                    view, got = memoryview(buf), 0
                    while got < n:
                        chunk = await reader.read(min(n - got, 1 << 20))
                        if not chunk:
                            return
                        view[got:got + len(chunk)] = chunk
                        got += len(chunk)
                    writer.write(b"k")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        dp = DataPlaneServer("127.0.0.1", 0, status=lambda: {}, max_message_bytes=nbytes + (1 << 20))
        dp.register(ACT, on_act)
        await dp.start()
        raw = await asyncio.start_server(on_raw, "127.0.0.1", 0)
        ready.send((dp.url, raw.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


async def _client(url: str, raw_port: int, nbytes: int, reps: int, rounds: int) -> dict:
    t = torch.randn(nbytes // 4)
    payload = memoryview(t.numpy()).cast("B")
    reader, writer = await asyncio.open_connection("127.0.0.1", raw_port)
    client = DataPlaneClient(max_message_bytes=nbytes + (1 << 20))

    async def raw_once():
        writer.write(struct.pack("!Q", payload.nbytes))
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(1)

    async def dataplane_once(step):
        header, bufs = encode_tensor(ACT, JOB, 1, step, 0, "client", t)
        await client.send(url, ACT, header, bufs, timeout=60)

    async def timed(fn):
        await fn(0)  # warm: connections open, buffers sized
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(reps):
                await fn(i)
            best = min(best, time.perf_counter() - t0)
        return reps * nbytes / best / 2**20

    try:
        raw = await timed(lambda i: raw_once())
        dp = await timed(dataplane_once)
        raw2 = await timed(lambda i: raw_once())  # raw again: the machine's state did not drift in between
    finally:
        writer.close()
        await client.close()
    raw = max(raw, raw2)
    return {"mib": nbytes / 2**20, "reps": reps, "raw_mib_s": round(raw, 1), "dataplane_mib_s": round(dp, 1),
            "ratio": round(dp / raw, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spantrain_p2p.net.bench", description=__doc__.split("\n\n")[0])
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
        url, port = parent.recv()
        out = asyncio.run(_client(url, port, nbytes, args.reps, args.rounds))
    finally:
        server.terminate()
        server.join(5)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['mib']:g} MiB tensors on loopback: raw asyncio TCP {out['raw_mib_s']} MiB/s, "
              f"data plane {out['dataplane_mib_s']} MiB/s = {out['ratio']:.0%} of raw")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
