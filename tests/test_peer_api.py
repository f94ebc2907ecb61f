"""The Python peer API, with real peers (p2pd + DHT node) on loopback in this process."""
import asyncio

import pytest

from spantrain_p2p.peer import Peer, PeerConfig, PeerError
from spantrain_p2p.swarm import membership

FAST = dict(heartbeat_s=0.5, poll_s=0.25)


async def test_two_peers_see_each_other_and_a_leaver_drops_out_at_once():
    async with Peer(PeerConfig(name="a", **FAST)) as a:
        assert "/p2p/" + a.peer_id in a.address
        async with Peer(PeerConfig(name="b", join=(a.address,), **FAST)) as b:
            await a.wait_members(2, 10)
            await b.wait_members(2, 10)
            names = sorted(r.name for r in await b.members())
            assert names == ["a", "b"]
            assert {m["name"] for m in a.status()["members"]} == {"a", "b"}
        await a.wait_members(1, 3)  # tombstone: long before the record would expire


async def test_an_ephemeral_identitys_key_file_is_gone_once_the_daemon_has_read_it(monkeypatch):
    """Without --identity a peer writes a fresh key for its p2p daemon to read at its start; the file
    goes as soon as the daemon runs, so that a peer killed later (no clean-up) leaves no private key in
    /tmp. The peer keeps its identity and joins."""
    import os
    import tempfile

    from spantrain_p2p.peer import admission

    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(admission.tempfile, "mkdtemp", lambda **kw: made.append(real(**kw)) or made[-1])
    async with Peer(PeerConfig(name="a", **FAST)) as a:
        assert len(made) == 1 and not os.path.exists(made[0]) and a._tmpdir is None
        assert a.address.endswith("/p2p/" + a.peer_id) and a.identity.peer_id == a.peer_id
        async with Peer(PeerConfig(name="b", join=(a.address,), **FAST)) as b:
            await b.wait_members(2, 10)
    assert len(made) == 2 and not any(os.path.exists(d) for d in made)


async def test_close_cancels_every_task_and_stops_the_daemon():
    peer = Peer(PeerConfig(**FAST))
    await peer.start()
    tasks = list(peer._tasks)
    daemon = peer._p2p._child
    await peer.close()
    assert tasks and all(t.done() for t in tasks)
    assert daemon.returncode is not None


async def test_a_peer_on_loopback_asks_no_router_for_a_port():
    """A daemon asked to map its port (UPnP, NAT-PMP) multicasts SSDP on every interface and queries
    the default gateway as it starts: every peer of a local swarm did, on the host's own network
    (strace of a loopback peer's p2pd: 14 M-SEARCHes to 239.255.255.250:1900, 2 to the gateway)."""
    async with Peer(PeerConfig(**FAST)) as peer:
        with open(f"/proc/{peer._p2p._child.pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
    assert "-natPortMap=0" in argv, argv


async def test_a_bad_record_in_the_dht_is_ignored_and_the_peer_keeps_working(caplog):
    from hivemind.utils import get_dht_time

    async with Peer(PeerConfig(name="a", **FAST)) as a:
        async with Peer(PeerConfig(name="b", join=(a.address,), **FAST)) as b:
            await a.wait_members(2, 10)
            key = membership.member_key_of
            await b.dht.store(key("default", "QmFake"), {"body": b"evil", "key": b"k", "sig": b"s"}, get_dht_time() + 30,
                              subkey="QmFake")
            await b.dht.store(key("default", "QmJunk"), b"x" * 1000, get_dht_time() + 30, subkey="QmJunk")
            with caplog.at_level("WARNING"):
                await asyncio.sleep(1.0)
                members = await a.members()
            assert sorted(r.name for r in members) == ["a", "b"]
            # refused at store time by the nodes (swarm.validator), or ignored on read where one got in
            refused = sum(a.status()["dht_refused"].values()) + sum(b.status()["dht_refused"].values())
            assert refused >= 2 or any("ignoring peer record" in r.message for r in caplog.records)
            assert not any(t.done() for t in a._tasks)


async def test_an_identity_file_gives_a_stable_peer_id_and_cannot_be_used_twice(tmp_path):
    path = str(tmp_path / "peer.key")
    async with Peer(PeerConfig(identity_path=path, **FAST)) as first:
        first_id = first.peer_id
    async with Peer(PeerConfig(**FAST)) as seed:
        async with Peer(PeerConfig(identity_path=path, join=(seed.address,), **FAST)) as again:
            assert again.peer_id == first_id
            with pytest.raises(PeerError, match="already used by a live peer"):
                async with Peer(PeerConfig(identity_path=path, join=(seed.address,), **FAST)):
                    pass


async def test_a_duplicate_identity_the_swarm_cannot_call_back_is_named_in_the_error(tmp_path, monkeypatch):
    """With our identity live elsewhere, the bootstrap peer's call-back may reach the other process
    and hivemind's ping validation fails the join with "can't access this node": that must name the
    identity (and is not tried again: another try would meet the same live identity)."""
    import spantrain_p2p.peer.node as node

    path = str(tmp_path / "peer.key")
    async with Peer(PeerConfig(identity_path=path, **FAST)):
        pass

    async def refused(*args, **kwargs):
        raise RuntimeError("Peer QmX can't access this node. Probably, libp2p has failed to bypass the firewall")

    async with Peer(PeerConfig(**FAST)) as seed:
        monkeypatch.setattr(node, "bootstrap", refused)
        with pytest.raises(PeerError, match=r"peer\.key .*may be already used by a live peer"):
            async with Peer(PeerConfig(identity_path=path, join=(seed.address,), **FAST)):
                pass


async def test_a_malformed_join_address_is_named_in_the_error():
    with pytest.raises(ValueError, match="malformed multiaddr '/ip4/1.2.3/tcp/1'"):
        async with Peer(PeerConfig(join=("/ip4/1.2.3/tcp/1",))):
            pass
    with pytest.raises(ValueError, match="must end with /p2p/"):
        async with Peer(PeerConfig(join=("/ip4/127.0.0.1/tcp/1",))):
            pass
