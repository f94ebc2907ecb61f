"""Member records split over ``keys.MEMBER_BUCKETS`` keys (issue 33): which nodes a read of them all
asks (``holders.pick``), and a record read under a key its peer id does not hash to."""
import random

from spantrain_p2p.swarm import keys, membership
from spantrain_p2p.swarm.holders import pick


def test_a_node_holding_every_key_is_asked_once_for_them_all():
    held = {k: ["n1", "n2", "n3", "n4", "n5"] for k in range(8)}
    for seed in range(20):
        calls = pick(held, 2, random.Random(seed))
        assert len(calls) == 2 and all(sorted(ks) == list(range(8)) for ks in calls.values())
    one = pick(held, 1, random.Random(0))
    assert len(one) == 1
    # across reads, different nodes: the load spreads
    assert len({tuple(pick(held, 1, random.Random(s))) for s in range(20)}) > 1


def test_keys_on_different_nodes_are_each_asked_of_their_own():
    held = {k: [f"n{k}-{i}" for i in range(5)] for k in range(8)}
    calls = pick(held, 2, random.Random(1))
    assert len(calls) == 16 and all(len(ks) == 1 for ks in calls.values())
    assert sorted(k for ks in calls.values() for k in ks) == sorted([*range(8)] * 2)
    # a key with fewer nodes than asked: all of them, no error
    assert pick({"k": ["a"]}, 2, random.Random(0)) == {"a": ["k"]}
    # a key with fewer nodes than ``whole_below`` (a swarm that small) is asked of every one
    small = pick({"k": ["a", "b", "c"], "l": ["a", "b", "c"]}, 1, random.Random(0), whole_below=5)
    assert sorted(small) == ["a", "b", "c"] and all(sorted(ks) == ["k", "l"] for ks in small.values())


def test_buckets_split_peer_ids_about_evenly_and_keys_name_them():
    ids = [f"Qm{i:06d}" for i in range(8000)]
    counts = [0] * keys.MEMBER_BUCKETS
    for p in ids:
        counts[keys.member_bucket(p)] += 1
    assert min(counts) > 0.85 * len(ids) / keys.MEMBER_BUCKETS
    assert len(set(keys.members_keys("s"))) == keys.MEMBER_BUCKETS


async def test_a_record_read_under_another_bucket_is_refused():
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from spantrain_p2p.swarm.identity import Identity
    from spantrain_p2p.swarm.records import PeerRecord, seal

    me = Identity.generate()
    rec = PeerRecord(me.peer_id, 1, get_dht_time(), "idle", "t", "", (), "i")
    value = {me.peer_id: ValueWithExpiration(seal(rec, me), get_dht_time() + 30)}
    mine = keys.member_key_of("s", me.peer_id)

    class Fake:
        def __init__(self, where):
            self.where = where

        async def get_many(self, names, latest=False, **kw):
            return {k: ValueWithExpiration(value, get_dht_time() + 30) if k == self.where else None for k in names}

    bad = []
    assert list(await membership.read_members(Fake(mine), "s", lambda k, why: bad.append(why))) == [me.peer_id]
    other = next(k for k in keys.members_keys("s") if k != mine)
    assert await membership.read_members(Fake(other), "s", lambda k, why: bad.append(why)) == {}
    assert bad and "not its own member key" in bad[0]


async def test_a_read_at_a_keys_holder_gets_the_values_without_the_neighbours():
    """``find_values``: the same validated values as hivemind's find, no neighbours; a node that does
    not serve it (a bare hivemind node) is asked with hivemind's find instead."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import P2P

    from spantrain_p2p.peer import Peer, PeerConfig
    from spantrain_p2p.swarm import find_values

    fast = dict(heartbeat_s=0.5, poll_s=0.25)
    async with Peer(PeerConfig(name="a", **fast)) as a:
        async with Peer(PeerConfig(name="b", join=(a.address,), **fast)) as b, \
                Peer(PeerConfig(name="c", join=(a.address,), **fast)) as c:
            await b.wait_members(3, 10)
            ids = [DHTID.generate(source=k) for k in keys.members_keys("default")]
            a_id = a._p2p.peer_id
            node = b.dht.node
            plain = await node._call_find_with_blacklist(a_id, ids)
            lean = await find_values.call(node, a_id, ids)
            assert set(lean) == set(ids) and all(near == {} for _, near in lean.values())
            assert any(near for _, near in plain.values())  # hivemind's carries a's neighbours (c)
            held = {k: sorted(s for s, _ in v.value.items()) for k, (v, _) in lean.items() if v is not None}
            assert held == {k: sorted(s for s, _ in v.value.items()) for k, (v, _) in plain.items() if v is not None}
            assert sorted(s for subs in held.values() for s in subs) == sorted([a.peer_id, b.peer_id, c.peer_id])
            rows = b.status()["control"]["out"]
            assert rows["find_values members"]["calls"] >= 1
            # a bare hivemind node serves no find_values: asked with rpc_find
            p2p = await P2P.create(initial_peers=[a.address], nat_port_map=False)
            bare = await DHTNode.create(p2p=p2p, initial_peers=[a.address], wait_timeout=3)
            try:
                got = await find_values.call(node, p2p.peer_id, ids)
                assert got is not None and set(got) == set(ids)
            finally:
                await bare.shutdown()
                await p2p.shutdown()


async def test_a_joiner_that_needs_a_few_members_reads_keys_one_at_a_time_until_it_has_them():
    """``membership.read_some`` (a SWIM joiner): member keys in a random order, one node each, until
    enough live members are found; every key where the swarm has fewer."""
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from spantrain_p2p.swarm.identity import Identity
    from spantrain_p2p.swarm.records import PeerRecord, seal

    ids = [Identity.generate() for _ in range(24)]
    by_key: dict = {}
    for me in ids:
        rec = PeerRecord(me.peer_id, 1, get_dht_time(), "idle", "t", "", (), "i")
        by_key.setdefault(keys.member_key_of("s", me.peer_id), {})[me.peer_id] = ValueWithExpiration(
            seal(rec, me), get_dht_time() + 30)
    asked = []

    class Fake:
        async def get_many(self, names, latest=False, holders=None):
            assert latest and holders == 1 and len(names) == 1
            asked.append(names[0])
            v = by_key.get(names[0])
            return {names[0]: ValueWithExpiration(v, get_dht_time() + 30) if v else None}

    got = await membership.read_some(Fake(), "s", lambda k, why: None, 3)
    assert len(got) >= 3 and len(asked) == len(set(asked)) < len(keys.members_keys("s"))
    asked.clear()
    everyone = await membership.read_some(Fake(), "s", lambda k, why: None, 100)  # more than there are
    assert set(everyone) == {i.peer_id for i in ids} and sorted(asked) == sorted(keys.members_keys("s"))
