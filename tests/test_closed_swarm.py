"""Closed swarms: the swarm key, sealed DHT values, the allow-list and the data plane's handshake."""
import asyncio
import os
import stat
import time

import pytest

from spantrain_p2p.cli.main import main as spantrain
from spantrain_p2p.net import handshake
from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer, RemoteError
from spantrain_p2p.net.handshake import Authenticator, HandshakeError
from spantrain_p2p.peer import Peer, PeerConfig, PeerError
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.swarm.sealing import SealError, SwarmKey

FAST = dict(heartbeat_s=0.5, poll_s=0.25)


# ---- the key and sealed values (pure) ---------------------------------------------------------
def test_keygen_writes_a_private_key_file_once_and_prints_the_operator_token(tmp_path, capsys):
    path = str(tmp_path / "swarm.key")
    assert spantrain(["keygen", path]) == 0
    key = SwarmKey.load(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert key.operator_token in capsys.readouterr().out
    assert spantrain(["keygen", path]) == 1  # never overwritten
    assert SwarmKey.load(path).key_id == key.key_id
    (tmp_path / "bad").write_text("hello")
    with pytest.raises(ValueError, match="not a swarm key file"):
        SwarmKey.load(str(tmp_path / "bad"))


def test_a_sealed_value_opens_only_with_its_key_under_its_key_subkey_and_expiry():
    k, other = SwarmKey.generate(), SwarmKey.generate()
    v = {"body": b"x" * 10, "key": b"k", "sig": b"s"}
    sealed = k.seal(v, "spantrain/s/members", "Qm1", 100.5)
    assert b"body" not in sealed  # encrypted, not only signed
    assert k.open(sealed, "spantrain/s/members", "Qm1", 100.5) == v
    cases = [
        (other, sealed, "spantrain/s/members", "Qm1", 100.5, "other-key"),
        (k, sealed, "spantrain/s/members", "Qm2", 100.5, "forged"),  # moved to another subkey
        (k, sealed, "spantrain/s/job", "Qm1", 100.5, "forged"),  # moved to another key
        (k, sealed, "spantrain/s/members", "Qm1", 200.0, "forged"),  # replayed with a later expiry
        (k, sealed[:-1] + bytes([sealed[-1] ^ 1]), "spantrain/s/members", "Qm1", 100.5, "forged"),
        (k, sealed[:20], "spantrain/s/members", "Qm1", 100.5, "malformed"),
        (k, v, "spantrain/s/members", "Qm1", 100.5, "unsealed"),
    ]
    for key, value, dk, sk, exp, kind in cases:
        with pytest.raises(SealError) as e:
            key.open(value, dk, sk, exp)
        assert e.value.kind == kind, (kind, str(e.value))


# ---- the handshake on loopback ------------------------------------------------------------------
async def _echo(header, buffers):
    return {"src": header["src"]}, []


async def _server(auth, **kw):
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {"ok": 1}, auth=auth, **kw)
    srv.register("echo", _echo)
    await srv.start()
    return srv


async def test_the_handshake_binds_a_connection_to_both_identities_and_the_sender_cannot_lie():
    a, b = Identity.generate(), Identity.generate()
    srv = await _server(Authenticator(a))
    client = DataPlaneClient(auth=Authenticator(b))
    try:
        assert await client.hello(srv.url) == a.peer_id
        header, _ = await client.send(srv.url, "echo", {}, peer_id=a.peer_id)
        assert header["src"] == b.peer_id  # filled in from the handshake
        with pytest.raises(RemoteError) as e:
            await client.send(srv.url, "echo", {"src": a.peer_id})  # claims to be the server itself
        assert e.value.status == 403 and "authenticated as" in e.value.reason
        with pytest.raises(HandshakeError, match="not"):
            await client.send(srv.url, "echo", {}, peer_id=Identity.generate().peer_id)  # someone else is there
        raw = DataPlaneClient()  # no handshake at all
        with pytest.raises(RemoteError) as e:
            await raw.send(srv.url, "echo", {"src": b.peer_id})
        assert e.value.status == 401
        await raw.close()
    finally:
        await client.close()
        await srv.stop()


async def test_a_closed_swarm_handshake_needs_the_key_and_the_allow_list():
    key = SwarmKey.generate()
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    srv = await _server(Authenticator(a, key, admit=lambda p: None if p == b.peer_id else f"{p} not allowed"))
    try:
        for ident, k, why in ((b, None, "does not hold"), (b, SwarmKey.generate(), "does not hold"),
                              (c, key, "not allowed")):
            client = DataPlaneClient(auth=Authenticator(ident, k))
            with pytest.raises(HandshakeError, match=why):
                await client.hello(srv.url)
            await client.close()
        client = DataPlaneClient(auth=Authenticator(b, key))
        assert await client.hello(srv.url) == a.peer_id
        # the pages of a closed swarm need the operator token; a member's client sends it
        assert (await client.get_json(srv.url, "/status", 1 << 16, 5)) == {"ok": 1}
        await client.close()
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.get(f"{srv.url}/status") as r:
                assert r.status == 401 and "operator token" in await r.text()
            async with s.get(f"{srv.url}/status?token={key.operator_token}") as r:
                assert r.status == 200
    finally:
        await srv.stop()


async def test_garbage_and_silence_in_a_handshake_are_answered_and_closed():
    from spantrain_p2p.net.budget import Limits

    srv = await _server(Authenticator(Identity.generate()), limits=Limits(handshake_timeout_s=0.5))
    try:
        r, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(handshake.MAGIC + b"\xff\xff\xff\xff")  # a hello of 4 GiB
        assert "error" in await handshake.read_message(r)
        assert await r.read() == b""
        w.close()
        r, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(handshake.MAGIC)  # then nothing
        t0 = time.monotonic()
        await asyncio.wait_for(r.read(), 5)
        assert time.monotonic() - t0 < 2
        w.close()
        assert srv.budget.handshakes == 0 and srv.budget.connections == 0
    finally:
        await srv.stop()


# ---- peers ----------------------------------------------------------------------------------
async def test_only_key_holders_on_the_allow_list_join_a_closed_swarm(tmp_path):
    key_path, other_path = str(tmp_path / "k"), str(tmp_path / "other")
    SwarmKey.write_new(key_path)
    SwarmKey.write_new(other_path)
    ids = {n: Identity.generate() for n in ("a", "b", "e")}
    for n, ident in ids.items():
        ident.save(str(tmp_path / f"{n}.id"))
    allow = (ids["a"].peer_id, ids["b"].peer_id)
    closed = dict(swarm_key_path=key_path, **FAST)
    async with Peer(PeerConfig(name="a", identity_path=str(tmp_path / "a.id"), allow=allow, **closed)) as a:
        async with Peer(PeerConfig(name="b", join=(a.address,), identity_path=str(tmp_path / "b.id"), allow=allow,
                                   **closed)) as b:
            await a.wait_members(2, 10)
            await b.wait_members(2, 10)
            outsiders = [
                (PeerConfig(name="nokey", join=(a.address,), **FAST), "is closed"),
                (PeerConfig(name="wrong", join=(a.address,), swarm_key_path=other_path, **FAST), "another swarm key"),
                (PeerConfig(name="e", join=(a.address,), identity_path=str(tmp_path / "e.id"), **closed),
                 "not on this swarm's allow-list"),
            ]
            for cfg, why in outsiders:
                t0 = time.monotonic()
                with pytest.raises(PeerError, match=why):
                    async with Peer(cfg):
                        pass
                assert time.monotonic() - t0 < 30
            await asyncio.sleep(1.0)  # several polls: nobody else ever shows up
            assert sorted(r.name for r in await a.members()) == ["a", "b"]
            assert sorted(r.name for r in await b.members()) == ["a", "b"]


async def test_an_encrypted_connection_carries_big_frames_unchanged():
    async def echo_back(header, buffers):
        return {"n": len(buffers[0])}, [bytes(buffers[0])]

    key = SwarmKey.generate()
    a, b = Identity.generate(), Identity.generate()
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {}, auth=Authenticator(a, key, encrypt=True))
    srv.register("echo", echo_back)
    await srv.start()
    client = DataPlaneClient(auth=Authenticator(b, key))  # the server asks for encryption: enough
    try:
        payload = os.urandom(3 << 20) + b"tail" * 1000
        for _ in range(2):  # the second goes on the same connection (record numbers go on)
            header, bufs = await client.send(srv.url, "echo", {"x": 1}, [payload], peer_id=a.peer_id)
            assert header["n"] == len(payload) and bytes(bufs[0]) == payload
        (conn,) = [w for w in client._writers]
        assert type(conn).__name__ == "SecureWriter"
    finally:
        await client.close()
        await srv.stop()
