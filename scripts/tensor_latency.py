"""How long one activation takes from one process to the next on loopback, idle: this project's data
plane (an encrypted tensor message to a ``DataPlaneServer`` that decodes and checks it, and its
answer) against gloo's ``send`` of the same tensor (``torch.distributed``, half a ping-pong).

A pipeline waits on this way a few times a micro-batch (1F1B's bottleneck waits for the gradient that
went through the stages after it and back), so on a host whose cores are all busy it is where our
side of ``scripts/pipelining_side_by_side.py`` loses to torch's (issue 31). The tensor is the
side-by-side's activation: 8 x 64 x 128 float32, 256 KiB. Messages go 1 ms apart, as in a step.

    .venv/bin/python scripts/tensor_latency.py --messages 500
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer
from spantrain_p2p.net.handshake import Authenticator
from spantrain_p2p.pipeline.messages import ACT, Expect, decode_tensor, encode_tensor
from spantrain_p2p.swarm.identity import Identity

from pipelining_side_by_side import file_store  # (scripts/, beside this one: the side-by-side's rendezvous)

SHAPE = (8, 64, 128)
WARMUP = 50


def _serve(ready, done) -> None:
    torch.set_num_threads(1)

    async def main():
        def on_act(header, buffers):  # the receiver's own checks, as a peer's transport makes them
            decode_tensor(header, buffers, Expect(ACT, "bench", 1, frozenset({header.get("src")}), SHAPE, 1 << 20),
                          (0, 1 << 30))

        dp = DataPlaneServer("127.0.0.1", 0, status=lambda: {}, max_message_bytes=4 << 20,
                             auth=Authenticator(Identity.generate(), encrypt=True))
        dp.register(ACT, on_act, inline=True)
        await dp.start()
        ready.send(dp.url)
        await asyncio.get_running_loop().run_in_executor(None, done.recv)
        await dp.stop()

    asyncio.run(main())


def ours(n: int) -> list[float]:
    """Seconds from the start of a send to its answer, for each of ``n`` messages after the warm-up."""
    a, b = mp.Pipe()
    d1, d2 = mp.Pipe()
    server = mp.Process(target=_serve, args=(b, d2))
    server.start()

    async def client(url):
        ident = Identity.generate()
        c = DataPlaneClient(max_message_bytes=4 << 20, auth=Authenticator(ident))
        t, out = torch.randn(*SHAPE), []
        for i in range(WARMUP + n):
            t0 = time.perf_counter()
            header, bufs = encode_tensor(ACT, "bench", 1, i, 0, ident.peer_id, t)
            await c.send(url, ACT, header, bufs, timeout=60)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.001)
        await c.close()
        return out[WARMUP:]

    try:
        return asyncio.run(client(a.recv()))
    finally:
        d1.send(1)
        server.join(10)
        if server.is_alive():
            server.terminate()


def _gloo_rank(rank: int, folder: str, n: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=file_store(folder), rank=rank, world_size=2)
    t, rtts = torch.zeros(*SHAPE), []
    for _ in range(WARMUP + n):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(t, 1)
            dist.recv(t, 1)
            rtts.append(time.perf_counter() - t0)
            time.sleep(0.001)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
    if rank == 0:
        out.send([x / 2 for x in rtts[WARMUP:]])
    dist.destroy_process_group()


def gloo(n: int) -> list[float]:
    """Half of each round trip of the tensor there and back (one send), ``n`` after the warm-up."""
    folder = tempfile.mkdtemp(prefix="gloo-")
    a, b = mp.Pipe()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_gloo_rank, args=(r, folder, n, b)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return a.recv()
    finally:
        for p in procs:
            p.join(30)
        shutil.rmtree(folder, ignore_errors=True)


def describe(name: str, xs: list[float]) -> str:
    v = sorted(xs)
    return (f"{name}: median {statistics.median(v) * 1e3:.3f} ms, 90th percentile {v[9 * len(v) // 10] * 1e3:.3f} ms "
            f"over {len(v)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=500, help="timed messages a side (default 500)")
    a = p.parse_args()
    print(describe("this project: a 256 KiB tensor message and its answer", ours(a.messages)))
    print(describe("gloo: a 256 KiB tensor sent (half a ping-pong)", gloo(a.messages)))


if __name__ == "__main__":
    main()
