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
