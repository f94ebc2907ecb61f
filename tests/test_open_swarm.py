"""An open swarm keeps its records: what a DHT node of the swarm stores is validated at store time
(``swarm.validator``), so a process that never joined cannot overwrite, outlive or replay them."""
import asyncio
import time

import pytest
import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time

from spantrain_p2p.launch import wait_until
from spantrain_p2p.swarm import keys
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.swarm.records import sign_payload
from spantrain_p2p.swarm.sealing import SwarmKey
from spantrain_p2p.swarm.validator import SwarmValidator
from tests.test_hostile import _losses_match_one_process, _steps_so_far, _training_pair
from tests.test_train_swarm import wait_done

YEAR = 365 * 86400.0


def _record(v: SwarmValidator, dht_key: str, subkey: str, value, expiration: float, signer=None) -> DHTRecord:
    """The record hivemind would send for ``value``, signed (outer) by ``signer``'s validator."""
    rec = DHTRecord(DHTID.generate(source=dht_key).to_bytes(), msgpack.packb(subkey), msgpack.packb(value), expiration)
    signer = signer or v
    return DHTRecord(rec.key, rec.subkey, signer.sign_value(rec), expiration)


def test_a_node_keeps_only_values_signed_by_their_subkeys_owner_with_a_near_expiry():
    me, other = Identity.generate(), Identity.generate()
    v, thief = SwarmValidator("s", me), SwarmValidator("s", other)
    now = get_dht_time()
    mine = sign_payload({"x": 1}, me)
    genuine = _record(v, keys.member_key_of("s", me.peer_id), me.peer_id, mine, now + 10)
    assert v.validate(genuine)
    assert msgpack.unpackb(v.strip_value(genuine)) == mine  # readers see the value they always saw
    lease = _record(v, keys.lease_key("s"), keys.term_subkey(3, me.peer_id), mine, now + 6)
    assert v.validate(lease)
    assert v.validate(_record(v, keys.measure_key_of("s", keys.LINKS, me.peer_id), me.peer_id, mine, now + 10))
    assert v.validate(_record(v, keys.job_key_of("s", me.peer_id), me.peer_id, mine, now + 10))

    refused = {
        # replayed with a later expiry: the outer signature covers the expiry
        "replayed": DHTRecord(genuine.key, genuine.subkey, genuine.value, now + YEAR),
        "replayed-near": DHTRecord(genuine.key, genuine.subkey, genuine.value, now + 20),
        # moved under another peer's subkey, or signed by someone else under mine
        "moved": DHTRecord(genuine.key, msgpack.packb(other.peer_id), genuine.value, now + 10),
        "thief": _record(v, keys.member_key_of("s", me.peer_id), me.peer_id, sign_payload({"x": 2}, other), now + 10, thief),
        "thief-lease": _record(v, keys.lease_key("s"), keys.term_subkey(4, me.peer_id), mine, now + 6, thief),
        # its own subkey, an expiry a year away
        "far": _record(v, keys.member_key_of("s", other.peer_id), other.peer_id, sign_payload({}, other), now + YEAR, thief),
        # its own record, well signed, under a member key its peer id does not hash to
        "elsewhere": _record(v, keys.members_key("s", (keys.member_bucket(me.peer_id) + 1) % keys.MEMBER_BUCKETS),
                             me.peer_id, mine, now + 10),
        # its links under another of the 32 link keys, its copy of the job under another job key
        "links-elsewhere": _record(v, keys.measure_key("s", keys.LINKS, (keys.bucket_of(me.peer_id, 32) + 8) % 32),
                                   me.peer_id, mine, now + 10),
        "job-elsewhere": _record(v, keys.job_key("s", (keys.bucket_of(me.peer_id, 16) + 3) % 16),
                                 me.peer_id, mine, now + 10),
        # no outer signature at all, plain junk, another swarm's key, a payload signed by another key
        "unsigned": DHTRecord(genuine.key, genuine.subkey, msgpack.packb(mine), now + 10),
        "junk": DHTRecord(genuine.key, genuine.subkey, b"\x01\x02junk", now + 10),
        "not-ours": _record(v, keys.member_key_of("t", me.peer_id), me.peer_id, mine, now + 10),
        "payload-of-another": _record(v, keys.member_key_of("s", me.peer_id), me.peer_id, sign_payload({}, other), now + 10),
        # a map key no reader decodes (hivemind's serializer takes strings only): taken, it failed
        # every reader's search of the key
        "int-key": _record(v, keys.member_key_of("s", me.peer_id), me.peer_id, {**mine, 1: 0}, now + 10),
    }
    assert {name: v.validate(r) for name, r in refused.items()} == {name: False for name in refused}
    assert set(v.refused) == {"far-expiry", "not-owner", "unsigned", "not-this-swarm", "malformed", "wrong-bucket"}


def test_a_closed_swarm_node_refuses_values_sealed_with_its_key_that_do_not_open():
    me, key = Identity.generate(), SwarmKey.generate()
    v = SwarmValidator("s", me, closed=True)
    v.sealer_for = lambda dht_key: key
    now = get_dht_time()
    dk, sub = keys.member_key_of("s", me.peer_id), me.peer_id
    assert v.validate(_record(v, dk, sub, key.seal({"x": 1}, dk, sub, now + 10), now + 10))
    # sealed for another expiry (a replay), or altered: refused at store time
    assert not v.validate(_record(v, dk, sub, key.seal({"x": 1}, dk, sub, now + 5), now + 10))
    sealed = bytearray(key.seal({"x": 1}, dk, sub, now + 10))
    sealed[-1] ^= 1
    assert not v.validate(_record(v, dk, sub, bytes(sealed), now + 10))
    # sealed with another key: kept, so the guard can tell a joiner with that key why it sees nothing
    assert v.validate(_record(v, dk, sub, SwarmKey.generate().seal({"x": 1}, dk, sub, now + 10), now + 10))
    assert v.refused == {"forged": 2}


async def _attacker(address: str):
    """A bare hivemind DHT node (no validator: it keeps and serves whatever it is given) that joins
    through ``address``: it takes part in the DHT as any node does, but never joins the swarm."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    p2p = await P2P.create(initial_peers=[address], nat_port_map=False)
    node = await DHTNode.create(p2p=p2p, initial_peers=[address], wait_timeout=3)
    return p2p, node


async def _attack(node, swarm: str, victims: list[str], me: SwarmValidator, me_id: Identity) -> int:
    """Stores, under every key the swarm uses: junk and forged values under the victims' subkeys
    with an expiry a year away, the victims' own values replayed with that expiry, and well-formed
    values of its own (a lease of term 10**6, a stage map, another job) with a near expiry."""
    now = get_dht_time()
    n = 0
    own_payload = sign_payload({"term": 10**6, "peer_id": me_id.peer_id, "expires": now + 60}, me_id)
    for dht_key in (*keys.members_keys(swarm), keys.lease_key(swarm), *keys.job_keys(swarm), keys.stagemap_key(swarm),
                    keys.keyreq_key(swarm), keys.groupkey_key(swarm),
                    *(k for w in (keys.PROFILES, keys.LINKS, keys.PINGS, keys.GROUPS) for k in keys.measure_keys(swarm, w))):
        found = await node.get(dht_key, latest=True)
        genuine = found.value if found is not None and isinstance(found.value, dict) else {}
        subkeys = [*victims, *(keys.term_subkey(t, p) for t in (1, 2, 10**6) for p in victims),
                   *(keys.epoch_subkey(e, p) for e in (1, 2, 10**6) for p in victims)]
        stores = []
        for sub in subkeys:
            stores.append(node.store(dht_key, {"junk": True}, now + YEAR, subkey=sub))
            forged = me.sign_value(DHTRecord(DHTID.generate(source=dht_key).to_bytes(), msgpack.packb(sub),
                                             msgpack.packb(own_payload), now + 30))
            stores.append(node.store(dht_key, msgpack.unpackb(forged), now + 30, subkey=sub))
        for sub, item in genuine.items():  # the genuine values, replayed to live a year
            stores.append(node.store(dht_key, item.value, now + YEAR, subkey=sub))
        await asyncio.gather(*stores)  # concurrently, as an attacker would (and the suite's time)
        n += len(stores)
        # its own subkeys, well-formed, near expiry: kept by the DHT, ignored by readers (not a member)
        for sub in (me_id.peer_id, keys.term_subkey(10**6, me_id.peer_id), keys.epoch_subkey(10**6, me_id.peer_id)):
            rec = DHTRecord(DHTID.generate(source=dht_key).to_bytes(), msgpack.packb(sub),
                            msgpack.packb(own_payload), now + 30)
            await node.store(dht_key, msgpack.unpackb(me.sign_value(rec)), now + 30, subkey=sub)
            n += 1
    return n


@pytest.mark.heavy
def test_a_process_that_never_joined_cannot_overwrite_outlive_or_replay_the_swarms_records(peers):
    """Before the second peer joins and again while the swarm trains, a DHT node that never joined
    stores junk, forgeries and replays expiring in a year under every key the swarm uses: both
    peers join and train to the end, no step lost, losses equal to one process's, each lists the
    other as long as it lives, and its DHT node says what it refused."""
    swarm, steps = "dht-attack", 200
    a = peers("a", "--swarm", swarm, "--steps", str(steps), "--peers", "2", "--plan", "even")
    a.wait_ready(60)
    outsider = Identity.generate()
    signer = SwarmValidator(swarm, outsider)

    async def attack(victims: list[str]) -> int:
        p2p, node = await _attacker(a.info["address"])
        try:
            return await _attack(node, swarm, victims, signer, outsider)
        finally:
            await node.shutdown()
            await p2p.shutdown()

    stored = asyncio.run(attack([a.info["peer_id"]]))
    b = peers("b", "--swarm", swarm, "--join", a.info["address"])
    b.wait_ready(60)
    wait_until(lambda: all(p.status()["state"] == "training" for p in (a, b)), 90, interval=0.2)
    stored += asyncio.run(attack([a.info["peer_id"], b.info["peer_id"]]))
    t_attacked, ids = time.monotonic(), sorted(p.info["peer_id"] for p in (a, b))
    # past several heartbeats' TTLs: each still lists the other (a junk record with a year's expiry
    # refused every heartbeat before: the peer fell out of every view after ~15 s)
    while time.monotonic() - t_attacked < 10 and b.status()["state"] == "training":
        for p in (a, b):
            assert sorted(m["peer_id"] for m in p.status()["members"]) == ids
        time.sleep(1.0)
    refused = [p.status()["dht_refused"] for p in (a, b)]
    wait_done([a, b], 60 + steps / 5)
    _losses_match_one_process([a, b], steps)
    print(f"\n{stored} hostile stores; refused by a: {refused[0]}, by b: {refused[1]}")
    assert sum(refused[0].values()) + sum(refused[1].values()) >= stored // 2
    assert any(r.get("far-expiry") for r in refused) and any(r.get("not-owner") for r in refused)


# ---- budgets no one can capture -------------------------------------------------------------
def test_one_address_takes_only_its_share_of_slots_and_of_handshakes():
    from spantrain_p2p.net.budget import Budget, Limits

    now = [0.0]
    b = Budget(Limits(max_handshakes=8, per_address_handshakes=3, max_connections=16, per_address_connections=6,
                      handshakes_per_s=2.0), clock=lambda: now[0])
    assert [b.begin_handshake("11.0.0.9") for _ in range(4)][3] is not None  # a 4th at once from one host
    assert b.begin_handshake("11.0.0.1") is None  # another host still gets in
    # handshakes' RSA work: a burst of 3 per address, then 2 per second
    assert [b.handshake_allowed("11.0.0.9") is None for _ in range(4)] == [True, True, True, False]
    now[0] += 0.5
    assert b.handshake_allowed("11.0.0.9") is None and b.handshake_allowed("11.0.0.9") is not None
    assert b.handshake_allowed("11.0.0.1") is None
    for _ in range(3):
        b.end_handshake("11.0.0.9")
    # connections: 6 per address, whatever identity; non-members leave a quarter for members
    assert [b.connect(f"id{i}", "11.0.0.9", member=False) is None for i in range(7)] == [True] * 6 + [False]
    assert all(b.connect(f"x{i}", f"11.0.1.{i}", member=False) is None for i in range(6))
    assert b.connect("y", "11.0.2.1", member=False) is not None  # 12 of 16: the rest is for members
    assert b.connect("member", "11.0.2.1", member=True) is None
    b.disconnect("id0", "11.0.0.9")
    assert b.connect("id6", "11.0.0.9", member=True) is None
    assert Limits(stall_timeout_s=30, min_rate_bytes_s=1 << 20).frame_deadline_s(10 << 20) == 40


async def test_an_idle_connection_and_a_trickled_frame_are_closed():
    from spantrain_p2p.net.budget import Limits
    from spantrain_p2p.net.dataplane import DataPlaneServer
    from spantrain_p2p.net.handshake import Authenticator
    from spantrain_p2p.net.wire import REQUEST, REQUEST_MAGIC

    srv = DataPlaneServer("127.0.0.1", 0, lambda: {}, auth=Authenticator(Identity.generate()),
                          limits=Limits(idle_timeout_s=0.5, stall_timeout_s=2.0, min_rate_bytes_s=1000))
    srv.register("act", lambda header, buffers: None)
    await srv.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", srv.port)
        await Authenticator(Identity.generate()).client(r, w)
        t0 = time.monotonic()
        assert await asyncio.wait_for(r.read(), 5) == b""  # idle: closed (an EOF, not a reset)
        assert 0.4 < time.monotonic() - t0 < 2.0
        w.close()
        # a 1000-byte frame may take 2 s + 1 s; one byte every 0.3 s is inside the stall timeout
        r, w = await asyncio.open_connection("127.0.0.1", srv.port)
        await Authenticator(Identity.generate()).client(r, w)
        w.write(REQUEST.pack(REQUEST_MAGIC, 3, 1000) + b"act")
        t0 = time.monotonic()
        closed = None
        for _ in range(40):
            try:
                w.write(b"\0")
                await w.drain()
            except ConnectionError:
                closed = time.monotonic() - t0
                break
            if r.at_eof() or w.transport.is_closing():
                closed = time.monotonic() - t0
                break
            await asyncio.sleep(0.3)
        assert closed is not None and closed < 5.0, closed
        w.close()
        assert srv.budget.connections == 0 and srv.budget.total_bytes == 0
    finally:
        await srv.stop()


@pytest.mark.heavy
def test_budget_attacks_on_a_training_swarm_leave_the_members_training_and_newcomers_a_way_in(peers):
    """Trickling members (live records, not in the stage map), an idle flood of 8 identities and 64
    silent sockets, each from an address of its own, against a training pair: the members train on
    through each (steps advance), a newcomer's handshake gets in during each, and no step trained
    through them is lost; the run is left there. (samples/s under each: scripts/budget_figures.py)"""
    from spantrain_p2p.launch import budget_attacks
    from spantrain_p2p.peer.config import PeerConfig
    from spantrain_p2p.peer.node import Peer

    if not budget_attacks.loopback_source_ok("127.0.0.66"):
        import pytest
        pytest.skip("this host cannot send from 127.0.0.66")
    swarm, steps = "budget-attack", 450
    a, b = _training_pair(peers, swarm, steps)
    host, port = b.info["data_url"].removeprefix("http://").rsplit(":", 1)
    tmp = b.run_dir

    async def attacks() -> dict:
        bare = []
        try:
            for i in range(2):
                path = f"{tmp}/trickler{i}.id"
                peer = Peer(PeerConfig(join=(a.info["address"],), swarm=swarm, identity_path=path))
                await peer.start()
                bare.append(peer)
            ids = [Identity.load(f"{tmp}/trickler{i}.id") for i in range(2)] + budget_attacks.identities(6)
            out = {}
            for attack in budget_attacks.ATTACKS:
                stop = asyncio.Event()
                task = asyncio.create_task(budget_attacks.run(attack, host, int(port), stop, ids))
                await asyncio.sleep(2.0)
                s0 = (await asyncio.to_thread(a.status))["train"]["steps_done"]
                got_in = await budget_attacks.newcomer_gets_in(host, int(port))
                # the members' steps advance under the attack: waited for (up to 30 s: a loaded box's step
                # or a re-plan takes seconds; a fixed 2 s saw none in CI once), not read after a fixed 2 s
                for _ in range(60):
                    await asyncio.sleep(0.5)
                    st = await asyncio.to_thread(a.status)
                    s1 = st["train"]["steps_done"]
                    if s1 > s0 or st["state"] == "done":
                        break
                stop.set()
                out[attack] = (got_in, s1 - s0, (await task).to_dict())
            return out
        finally:
            for peer in bare:
                await peer.close()

    out = asyncio.run(attacks())
    print(f"\n{out}")
    for attack, (got_in, advanced, _) in out.items():
        assert got_in, attack
        assert advanced > 0 or b.status()["state"] == "done", attack
    # no step lost through the attacks (the losses' equality: the DHT test above); the run is left
    # there, its steps after them only outlasted them
    trained = min(p.status()["train"]["steps_done"] for p in (a, b))
    assert len(_steps_so_far([a, b])) >= trained
