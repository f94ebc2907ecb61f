"""Connections whose two ends are both on this machine are not encrypted; every other one is."""
import asyncio
import contextlib

import pytest

from spantrain_p2p import scenario as sc
from spantrain_p2p.net.addresses import address_of
from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer
from spantrain_p2p.net.handshake import Authenticator, dialed_straight, is_loopback
from spantrain_p2p.swarm.identity import Identity

A, B = Identity.generate(), Identity.generate()


def test_loopback_and_a_straight_dial_are_told_apart():
    assert is_loopback(("127.0.0.1", 5)) and is_loopback(("127.8.9.1", 5)) and is_loopback(("::1", 5, 0, 0))
    assert is_loopback(("::ffff:127.0.0.1", 5, 0, 0))
    assert not is_loopback(("11.0.0.2", 5)) and not is_loopback(("::ffff:11.0.0.2", 5, 0, 0))
    assert not is_loopback(None) and not is_loopback("/tmp/sock") and not is_loopback(("localhost", 5))
    assert dialed_straight(("127.0.0.1", 9000), ("127.0.0.1", 9000))
    assert not dialed_straight(("127.0.0.1", 9001), ("127.0.0.1", 9000))  # a relay's port, not the peer's
    assert not dialed_straight(("127.0.0.2", 9000), ("127.0.0.1", 9000))
    assert not dialed_straight(("127.0.0.1", 9000), ("localhost", 9000))  # a name: not checked, not straight
    assert not dialed_straight(("11.0.0.2", 9000), ("11.0.0.2", 9000))  # straight, but it leaves the machine
    assert not dialed_straight(("127.0.0.1", 9000), None)


def test_a_scenario_gives_its_peers_a_host_only_where_it_says_so():
    base = {"name": "s", "link_classes": {"l": {"rtt_ms": 1, "mbps": 100}},
            "device_classes": {"d": {"tflops": 1, "memory_gb": 8}}, "regions": {"r": {"link": "l"}}}
    s = sc.parse({**base, "peers": [{"name": "p0", "region": "r", "device": "d", "host": "box"},
                                    {"name": "p1", "region": "r", "device": "d"}]})
    assert s.peer("p0").host == "box" and s.peer("p1").host == ""  # none given: a machine of its own
    with pytest.raises(sc.ScenarioError, match="host"):
        sc.parse({**base, "peers": [{"name": "p", "region": "r", "device": "d", "host": 3}]})


async def _echo(header, buffers):
    return {"n": len(buffers[0])}, [bytes(buffers[0])]


@contextlib.asynccontextmanager
async def _server(host):
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {}, auth=Authenticator(A, encrypt=True, host=host))
    srv.register("echo", _echo)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def _writer_type(client: DataPlaneClient, url: str) -> str:
    header, bufs = await client.send(url, "echo", {}, [b"x" * 300_000], peer_id=A.peer_id)
    assert header["n"] == 300_000 and bytes(bufs[0]) == b"x" * 300_000
    (w,) = client._writers
    return type(w).__name__


@pytest.mark.parametrize("server_host,client_host,encrypted", [
    ("this machine", "this machine", False),  # both ends here and say so: plain
    ("this machine", None, True),  # a client that asks on every connection (``--encrypt``)
    (None, "this machine", True),  # a server that does
    ("scenario peer p0", "scenario peer p1", True),  # emulated peers that stand for machines of their own
    ("scenario host box", "scenario host box", False),  # ...unless their scenario puts them on one
])
async def test_only_a_connection_both_ends_keep_on_this_machine_goes_unencrypted(server_host, client_host, encrypted):
    def says(v):
        return None if v is None else (lambda: v)
    async with _server(says(server_host)) as srv:
        client = DataPlaneClient(auth=Authenticator(B, encrypt=True, host=says(client_host)))
        try:
            kind = await _writer_type(client, srv.url)
        finally:
            await client.close()
    assert kind == ("SecureWriter" if encrypted else "StreamWriter")


async def test_a_connection_through_a_relay_on_this_machine_is_encrypted():
    """The server sees a loopback address and the client one too, but not the address it meant to
    dial: a relay (here a plain forwarder) is in the way, and could read or change plain bytes."""
    async with _server(lambda: "this machine") as srv:
        target = address_of(srv.url)

        async def forward(reader, writer):
            up_r, up_w = await asyncio.open_connection(*target)

            async def pipe(r, w):
                with contextlib.suppress(ConnectionError):
                    while data := await r.read(1 << 16):
                        w.write(data)
                        await w.drain()
                w.close()
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        relay = await asyncio.start_server(forward, "127.0.0.1", 0)
        client = DataPlaneClient(auth=Authenticator(B, encrypt=True, host=lambda: "this machine"))
        try:
            r, w = await asyncio.open_connection(*relay.sockets[0].getsockname()[:2])
            r, w = await client.authenticate(r, w, A.peer_id, dialed=target)
            assert type(w).__name__ == "SecureWriter"
        finally:
            await client.close()
            relay.close()
