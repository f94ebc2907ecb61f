"""Closed swarms: the swarm key, sealed DHT values, the allow-list and the data plane's handshake."""
import asyncio
import json
import os
import stat
import time

import aiohttp
import pytest

from spantrain_p2p.cli.main import main as spantrain
from spantrain_p2p.net import handshake
from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer, RemoteError
from spantrain_p2p.net.handshake import Authenticator, HandshakeError
from spantrain_p2p.peer import Peer, PeerConfig, PeerError
from spantrain_p2p.swarm import group_key, keys, membership
from spantrain_p2p.swarm.guard import GuardedDHT
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.swarm.records import BadRecord
from spantrain_p2p.swarm.sealing import GroupKey, SealError, SwarmKey

FAST = dict(heartbeat_s=0.5, poll_s=0.25)


# ---- the key and sealed values (pure) ---------------------------------------------------------
def test_identity_makes_an_identity_once_and_prints_the_id_an_allow_list_names(tmp_path, capsys):
    path = str(tmp_path / "me.id")
    assert spantrain(["identity", path]) == 0
    first = capsys.readouterr().out.strip()
    assert first == Identity.load(path).peer_id
    assert spantrain(["identity", path]) == 0 and capsys.readouterr().out.strip() == first  # read, not remade
    (tmp_path / "bad.id").write_bytes(b"x")
    assert spantrain(["identity", str(tmp_path / "bad.id")]) == 1


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


def test_a_group_key_reaches_only_the_peer_it_is_wrapped_for_and_its_values_only_its_holders():
    swarm, other_swarm = SwarmKey.generate(), SwarmKey.generate()
    member, listed, outsider = (Identity.generate() for _ in range(3))
    group = GroupKey.generate(swarm.key_id)
    sealed = group.seal({"x": 1}, "spantrain/s/members", "Qm1", 100.0)
    assert group.open(sealed, "spantrain/s/members", "Qm1", 100.0) == {"x": 1}
    for key, kind in ((swarm, "group-sealed"), (GroupKey.generate(swarm.key_id), "other-group"),
                      (other_swarm, "other-key"), (GroupKey.generate(other_swarm.key_id), "other-key")):
        with pytest.raises(SealError) as e:
            key.open(sealed, "spantrain/s/members", "Qm1", 100.0)
        assert e.value.kind == kind, (kind, str(e.value))
    with pytest.raises(SealError, match="swarm key alone"):
        group.open(swarm.seal({"x": 1}, "k", None, 1.0), "k", None, 1.0)

    asking, public_key = group_key.open_request(listed.peer_id, group_key.request_payload(listed))
    assert asking == listed.peer_id
    wrap = group_key.wrap_payload(member, group, listed.peer_id, public_key)
    signer, got = group_key.open_wrap(listed.peer_id, wrap, listed, swarm.key_id)
    assert signer == member.peer_id and got.key_id == group.key_id
    assert got.open(sealed, "spantrain/s/members", "Qm1", 100.0) == {"x": 1}
    assert got.operator_token == group.operator_token != swarm.operator_token
    with pytest.raises(BadRecord):  # another peer's wrap, even filed under its own id, does not open
        group_key.open_wrap(outsider.peer_id, dict(wrap), outsider, swarm.key_id)
    with pytest.raises(BadRecord):  # a request filed under another peer's id
        group_key.open_request(listed.peer_id, group_key.request_payload(outsider))


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
async def test_only_key_holders_on_the_allow_list_join_a_closed_swarm(tmp_path, capsys):
    key_path, other_path = str(tmp_path / "k"), str(tmp_path / "other")
    SwarmKey.write_new(key_path)
    SwarmKey.write_new(other_path)
    ids = {n: Identity.generate() for n in ("a", "b", "e", "op")}
    for n, ident in ids.items():
        ident.save(str(tmp_path / f"{n}.id"))
    allow = (ids["a"].peer_id, ids["b"].peer_id, ids["op"].peer_id)  # op: the operator's own id
    closed = dict(swarm_key_path=key_path, **FAST)
    async with Peer(PeerConfig(name="a", identity_path=str(tmp_path / "a.id"), allow=allow, **closed)) as a:
        async with Peer(PeerConfig(name="b", join=(a.address,), identity_path=str(tmp_path / "b.id"), allow=allow,
                                   **closed)) as b:
            await a.wait_members(2, 10)
            await b.wait_members(2, 10)
            outsiders = [
                (PeerConfig(name="nokey", join=(a.address,), **FAST), "is closed"),
                (PeerConfig(name="wrong", join=(a.address,), swarm_key_path=other_path, **FAST), "another swarm key"),
                (PeerConfig(name="wrong", join=(a.address,), swarm_key_path=other_path, allow=allow, **FAST),
                 "another swarm key"),
                # the key, but off the list: it reads nothing, so it never learns where to connect
                (PeerConfig(name="e", join=(a.address,), identity_path=str(tmp_path / "e.id"), **closed),
                 "closed to the peers on its allow-list"),
                (PeerConfig(name="e", join=(a.address,), identity_path=str(tmp_path / "e.id"), allow=allow,
                            group_key_timeout_s=4, **closed), "no member handed this peer"),
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
            # what e can read with the swarm key: no record, and a member's group key it cannot open
            e_view = GuardedDHT(a._dht.node, SwarmKey.load(key_path))
            assert await membership.read_members(e_view, "default", membership.BadRecordLog()) == {}
            assert e_view.refused["group-sealed"] >= 2
            wraps = (await e_view.get(keys.groupkey_key("default"))).value
            for_b = [sub for sub in wraps if sub.startswith(ids["b"].peer_id + "/")]
            assert for_b and not any(sub.startswith(ids["e"].peer_id + "/") for sub in wraps)
            with pytest.raises(BadRecord):
                group_key.open_wrap(ids["e"].peer_id, wraps[for_b[0]].value, ids["e"], e_view.key.key_id)

            # the operator reads it as a listed member, and its pages take the group's token only
            argv = ["status", "--join", a.address, "--swarm-key", key_path, "--json"]
            assert await asyncio.to_thread(spantrain, argv) == 1
            capsys.readouterr()
            argv += ["--identity", str(tmp_path / "op.id")] + [x for i in allow for x in ("--allow", i)]
            assert await asyncio.to_thread(spantrain, argv) == 0
            out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert sorted(p["name"] for p in out["peers"]) == ["a", "b"]
            assert out["operator_token"] == a._dht.group.operator_token
            async with aiohttp.ClientSession() as http:
                for token, status in ((SwarmKey.load(key_path).operator_token, 401), (out["operator_token"], 200)):
                    async with http.get(f"{a.dataplane.url}/status?token={token}") as r:
                        assert r.status == status


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
