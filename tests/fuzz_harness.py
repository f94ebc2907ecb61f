"""Hostile input for live peers: random and mutated frames, handshakes, HTTP requests and DHT values.

``fuzz(...)`` joins a swarm as a member of its own (an open swarm lets anyone in, so the worst
stranger is a member: its messages reach the handlers, past the member check) and sends ``n``
messages, each drawn at random from:
- framed messages on its authenticated connection: tensor headers mutated field by field (types,
  shapes, dtypes, steps, micro-batches, codecs, lengths), random msgpack headers, frames truncated
  or padded against their own length fields, every kind a peer takes;
- the same from a stranger's connection, and from no handshake at all;
- raw connections: random bytes, a framed prefix or a handshake followed by garbage;
- HTTP: random methods, paths, queries and bodies;
- DHT values stored under every key of the swarm (random msgpack, signed garbage).
It returns what the peers answered, by outcome. Used by ``tests/test_hostile.py`` and, for long
runs, by ``scripts/fuzz.sh`` (``python -m tests.fuzz_harness --help``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import struct
from collections import Counter

import aiohttp
import torch

from spantrain_p2p.net import framing, handshake
from spantrain_p2p.net.addresses import address_of
from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import RemoteError
from spantrain_p2p.net.handshake import Authenticator, HandshakeError
from spantrain_p2p.net.wire import ANSWER, REQUEST, REQUEST_MAGIC
from spantrain_p2p.peer import Peer, PeerConfig
from spantrain_p2p.pipeline.messages import encode_tensor
from spantrain_p2p.swarm import keys
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.swarm.records import sign_payload

KINDS = ["act", "grad", "gsum", "amp", "ckpt", "fetch", "mapnews", "manifest", "shard", "probe", "nosuch", "a" * 64]
PATHS = ["/status", "/report", "/measurements", "/inventory", "/swarm", "/metrics", "/", "/msg/act", "/x" * 40,
         "/status?" + "a=1&" * 200, "/../../etc/passwd", "/%00", "/report?step=-1"]


def random_value(rng: random.Random, depth: int = 0):
    """A random msgpack-able value: every type msgpack has, at odd sizes."""
    choice = rng.randrange(12 if depth < 3 else 8)
    if choice == 0:
        return rng.choice([0, -1, 1, 2**31, -2**63, 2**64 - 1, rng.randrange(-1000, 1000)])
    if choice == 1:
        return rng.choice([0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, rng.random()])
    if choice == 2:
        return rng.choice(["", "act", "float32", "x" * rng.randrange(0, 3000), "\u202e\x00"])
    if choice == 3:
        return rng.randbytes(rng.randrange(0, 300))
    if choice == 4:
        return None
    if choice == 5:
        return rng.choice([True, False])
    if choice == 6:
        return rng.randrange(-5, 5)
    if choice == 7:
        return "src"
    if choice in (8, 9):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {str(random_value(rng, depth + 1))[:20]: random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


def mutated_tensor_message(rng: random.Random, job: str, epoch: int, step: int, src: str):
    kind = rng.choice(["act", "grad", "gsum", "amp"])
    shape = rng.choice([(4, 32, 64), (1,), (0,), (3, 3), (4, 32, 64, 1)])
    t = torch.zeros(shape) if math.prod(shape) < 1 << 16 else torch.zeros(4, 32, 64)
    header, bufs = encode_tensor(kind, job, epoch, step + rng.randrange(-2, 3), rng.randrange(-1, 6), src, t,
                                 codec=rng.choice(["none", "none", "fp16", "int8", "topk:0.1"]))
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(list(header) + ["extra", "comp", "shape", "dtype"])
        op = rng.randrange(4)
        if op == 0:
            header.pop(field, None)
        elif op == 1:
            header[field] = random_value(rng)
        elif op == 2 and field == "shape":
            header["shape"] = [rng.choice([-1, 0, 1, 2**40, 64]) for _ in range(rng.randrange(0, 9))]
        else:
            header[field] = rng.choice(["float16", "bfloat16", "int64", "float32", "object", "", "<f4"])
    if rng.random() < 0.3:
        bufs = [rng.randbytes(rng.randrange(0, 4096)) for _ in range(rng.randrange(0, 4))]
    return kind, header, bufs


def frame_bytes(rng: random.Random, header: dict, bufs) -> bytes:
    """A frame, then (sometimes) cut, padded or with a byte flipped."""
    try:
        body = b"".join(bytes(c) for c in framing.encode(header, bufs))
    except (ValueError, TypeError):
        body = rng.randbytes(100)
    r = rng.random()
    if r < 0.2 and body:
        body = body[: rng.randrange(len(body))]
    elif r < 0.35:
        body += rng.randbytes(rng.randrange(1, 64))
    elif r < 0.5 and body:
        i = rng.randrange(len(body))
        body = body[:i] + bytes([body[i] ^ (1 << rng.randrange(8))]) + body[i + 1:]
    return body


async def send_raw_frame(client: DataPlaneClient, url: str, peer_id: str, kind: str, body: bytes) -> str:
    """Sends ``body`` as a frame of ``kind`` on an authenticated connection, as it is (no encoding)."""
    addr = address_of(url)
    reader, writer = await client._connection(addr, peer_id)
    try:
        name = kind.encode()
        writer.write(REQUEST.pack(REQUEST_MAGIC, len(name), len(body)) + name + body)
        await writer.drain()
        _, status, n = ANSWER.unpack(await asyncio.wait_for(reader.readexactly(ANSWER.size), 10))
        await asyncio.wait_for(reader.readexactly(min(n, 1 << 20)), 10)
        return str(status)
    finally:
        client._discard(writer)


async def raw_connection(rng: random.Random, host: str, port: int) -> str:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        prefix = rng.choice([b"", REQUEST_MAGIC, handshake.MAGIC, b"GET ", b"POST /msg/act HTTP/1.1\r\n"])
        if prefix == handshake.MAGIC and rng.random() < 0.5:
            junk = handshake.pack({"v": 1, "id": "x", "key": rng.randbytes(300), "nonce": rng.randbytes(32),
                                   "eph": rng.randbytes(rng.choice([31, 32])), "enc": random_value(rng),
                                   "want": random_value(rng)})
        elif prefix == REQUEST_MAGIC:
            junk = struct.pack(">BQ", rng.randrange(256), rng.choice([0, 5, 2**40, 2**63])) + rng.randbytes(20)
        else:
            junk = rng.randbytes(rng.randrange(1, 2000))
        writer.write(prefix + junk)
        await writer.drain()
        if rng.random() < 0.5:
            writer.write_eof()
        got = await asyncio.wait_for(reader.read(4096), 3)
        return "answered" if got else "closed"
    except asyncio.TimeoutError:
        return "waited"  # an incomplete message: the peer waits for more, up to its timeout
    finally:
        writer.close()


async def http_request(rng: random.Random, session: aiohttp.ClientSession, url: str) -> str:
    method = rng.choice(["GET", "GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"])
    path = rng.choice(PATHS)
    headers = rng.choice([{}, {"Authorization": "Bearer " + "x" * 40}, {"Content-Type": "application/json"},
                          {"Cookie": "spantrain_token=" + "y" * 100}])
    data = rng.randbytes(rng.randrange(0, 5000)) if method in ("POST", "PUT") else None
    async with session.request(method, url + path, headers=headers, data=data,
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
        await r.read()
        return str(r.status)


async def dht_value(rng: random.Random, me: Peer, swarm: str) -> str:
    key = rng.choice([keys.member_key_of(swarm, me.peer_id), keys.job_key_of(swarm, me.peer_id), keys.stagemap_key(swarm),
                      keys.lease_key(swarm), keys.measure_key_of(swarm, keys.PROFILES, me.peer_id),
                      keys.measure_key_of(swarm, keys.LINKS, me.peer_id), keys.measure_key_of(swarm, keys.GROUPS, me.peer_id)])
    r = rng.random()
    if r < 0.4:
        value = random_value(rng)
    elif r < 0.7:  # well signed by this member, garbage inside
        body = random_value(rng)
        value = sign_payload(body if isinstance(body, dict) else {"x": body}, me.identity, 1 << 16)
    else:
        value = {"body": rng.randbytes(50), "key": me.identity.public_der, "sig": rng.randbytes(256)}
    subkey = rng.choice([me.peer_id, "job", keys.epoch_subkey(rng.randrange(0, 50), me.peer_id),
                         keys.term_subkey(rng.randrange(0, 50), me.peer_id), str(random_value(rng))[:30]])
    from hivemind.utils import get_dht_time

    ok = await me.dht.node.store(key, value, get_dht_time() + rng.uniform(1, 20), subkey=subkey)
    return "stored" if ok else "not stored"


async def fuzz(targets: list[dict], join: str, swarm: str, n: int, seed: int = 0,
               job: str = "", epoch: int = 1, step: int = 0) -> Counter:
    """Sends ``n`` hostile messages to ``targets`` (``{"peer_id", "data_url"}`` each); what came
    back, by "what:outcome"."""
    rng = random.Random(seed)
    out: Counter = Counter()
    async with Peer(PeerConfig(swarm=swarm, join=(join,), name="fuzzer", heartbeat_s=0.5, poll_s=0.5)) as me:
        await asyncio.sleep(1.5)  # every target has seen our record (they look each second): we are a member
        stranger = DataPlaneClient(auth=Authenticator(Identity.generate()))
        bare = DataPlaneClient()
        session = aiohttp.ClientSession()
        try:
            for i in range(n):
                t = rng.choice(targets)
                url, pid = t["data_url"], t["peer_id"]
                host, port = url.removeprefix("http://").split(":")
                r = rng.random()
                try:
                    if r < 0.45:
                        what = "frame"
                        if rng.random() < 0.6:
                            kind, header, bufs = mutated_tensor_message(rng, job, epoch, step, me.peer_id)
                        else:
                            kind, header = rng.choice(KINDS), random_value(rng)
                            header = header if isinstance(header, dict) else {"v": header}
                            bufs = [rng.randbytes(rng.randrange(0, 2048))] if rng.random() < 0.5 else []
                        outcome = await send_raw_frame(me.client, url, pid, kind, frame_bytes(rng, header, bufs))
                    elif r < 0.55:
                        what = "outsider"
                        kind, header, bufs = mutated_tensor_message(rng, job, epoch, step, t["peer_id"])
                        client = rng.choice([stranger, bare])
                        try:
                            await client.send(url, kind, header, bufs, timeout=10)
                            outcome = "ACCEPTED"
                        except RemoteError as e:
                            outcome = str(e.status)
                    elif r < 0.7:
                        what, outcome = "raw", await raw_connection(rng, host, int(port))
                    elif r < 0.85:
                        what, outcome = "http", await http_request(rng, session, url)
                    else:
                        what, outcome = "dht", await dht_value(rng, me, swarm)
                except (RemoteError, HandshakeError, OSError, asyncio.TimeoutError, aiohttp.ClientError,
                        asyncio.IncompleteReadError) as e:
                    outcome = type(e).__name__
                out[f"{what}:{outcome}"] += 1
        finally:
            await session.close()
            await stranger.close()
            await bare.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description="send hostile messages to a live swarm's peers")
    p.add_argument("--join", required=True, help="a peer's multiaddr")
    p.add_argument("--swarm", default="default")
    p.add_argument("--targets", required=True, help='JSON: [{"peer_id": ..., "data_url": ...}, ...]')
    p.add_argument("--messages", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job", default="")
    a = p.parse_args()
    got = asyncio.run(fuzz(json.loads(a.targets), a.join, a.swarm, a.messages, a.seed, a.job))
    print(json.dumps(dict(sorted(got.items()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
