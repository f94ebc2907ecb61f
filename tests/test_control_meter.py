"""The control plane's meter (``swarm.control_meter``): real peers on loopback count their DHT calls
per method and key, both ends of a call agree on its bytes, and a value's size is what was stored."""
import asyncio

from spantrain_p2p.peer import Peer, PeerConfig
from spantrain_p2p.swarm.control_meter import ControlMeter, rates

FAST = dict(heartbeat_s=0.5, poll_s=0.25)


async def test_two_peers_count_heartbeats_and_member_reads_under_the_members_key():
    async with Peer(PeerConfig(name="a", **FAST)) as a:
        async with Peer(PeerConfig(name="b", join=(a.address,), **FAST)) as b:
            await a.wait_members(2, 10)
            await b.wait_members(2, 10)
            before = b.status()["control"]
            await asyncio.sleep(1.5)
            after = b.status()["control"]
            ca = a.status()["control"]
    # b reads the member keys (its watch loop: asking a, the only other node, with find_values) and
    # stores its heartbeat there, both through a's node
    assert after["out"]["find_values members"]["calls"] > before["out"].get("find_values members", {"calls": 0})["calls"]
    assert after["out"]["rpc_store members"]["calls"] >= 2
    # what b sent to a is what a got from b, and the other way round (only these two talk)
    b_out = sum(r["bytes_out"] for r in after["out"].values())
    a_in = sum(r["bytes_out"] for r in ca["served"].values())
    assert a_in > 0 and abs(a_in - b_out) <= max(r["bytes_out"] for r in after["out"].values())
    # a member record is ~1 KB signed: the key's largest value is one record or the whole dictionary
    assert 300 < after["largest_value"]["members"] < 16_000
    r = rates(before, after)
    assert r["window_s"] > 1.0 and r["bytes_received_per_s"] > 0 and r["calls_out_per_s"] > 0
    assert after["bytes_sent"] >= b_out


def test_requests_are_named_by_the_swarm_key_they_touch():
    from hivemind.dht.routing import DHTID
    from hivemind.proto import dht_pb2

    meter = ControlMeter("s1")
    members = DHTID.generate(source="spantrain/s1/members.03").to_bytes()
    members_7 = DHTID.generate(source="spantrain/s1/members.07").to_bytes()
    stagemap = DHTID.generate(source="spantrain/s1/stagemap").to_bytes()
    other = DHTID.generate(source="spantrain/s2/members.03").to_bytes()  # another swarm's key
    find = dht_pb2.FindRequest(keys=[members, members_7])  # member buckets read together: one row
    meter._count(meter.out, "DHTProtocol.rpc_find", find,
                 dht_pb2.FindResponse(results=[dht_pb2.FindResult(value=b"x" * 700)]), True)
    meter._count(meter.out, "DHTProtocol.rpc_find", dht_pb2.FindRequest(keys=[members, stagemap]), None, False)
    meter._count(meter.served, "DHTProtocol.rpc_store", dht_pb2.StoreRequest(keys=[other], values=[b"y" * 50]),
                 dht_pb2.StoreResponse(store_ok=[True]), True)
    snap = meter.snapshot()
    assert snap["out"]["rpc_find members"]["calls"] == 1
    assert snap["out"]["rpc_find several"] == {"calls": 1, "failed": 1, "bytes_out": snap["out"]["rpc_find several"]["bytes_out"], "bytes_back": 0}
    assert snap["served"]["rpc_store routing"]["calls"] == 1
    assert snap["largest_value"] == {"members": 700, "routing": 50}
    assert snap["bytes_received"] == snap["out"]["rpc_find members"]["bytes_back"] + snap["served"]["rpc_store routing"]["bytes_out"]
    assert snap["out"]["rpc_find members"]["bytes_out"] == find.ByteSize()


async def test_a_read_visits_the_nodes_a_key_is_stored_on_not_the_whole_bucket():
    from spantrain_p2p.swarm.guard import REPLICAS, GuardedDHT

    calls = []

    class Node:
        async def get(self, key, latest=False, **kwargs):
            calls.append(kwargs)
            return None

    dht = GuardedDHT(Node())
    await dht.get("spantrain/s/members", latest=True)
    await dht.get("spantrain/s/members", latest=True, beam_size=20)  # a caller may still ask for more
    assert calls == [{"beam_size": REPLICAS}, {"beam_size": 20}]


def test_a_waiting_peer_reads_the_job_key_when_a_member_shows_a_job():
    from types import SimpleNamespace as R

    from spantrain_p2p.train.run_records import job_in_sight

    idle = R(state="idle", progress={})
    assert not job_in_sight([idle, R(state="joining", progress={})])
    assert job_in_sight([idle, R(state="idle", progress={"job": "ab12"})])  # published, still setting up
    assert job_in_sight([idle, R(state="measuring", progress={})])
    assert not job_in_sight([])


def test_run_rates_are_the_totals_over_the_meters_life():
    from spantrain_p2p.swarm.control_meter import run_rates

    snap = {"since_s": 10.0, "bytes_sent": 3000, "bytes_received": 7000, "calls_out": 50, "calls_served": 20,
            "largest_value": {"members": 1200}}
    assert run_rates(snap) == {"seconds": 10.0, "bytes_per_s": 1000.0, "calls_out_per_s": 5.0,
                               "calls_served_per_s": 2.0, "largest_value": {"members": 1200}}


async def test_a_read_some_replicas_miss_still_gives_what_an_earlier_read_saw_until_it_expires():
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from spantrain_p2p.swarm.guard import GuardedDHT

    now = get_dht_time()
    answers = []

    class Node:
        async def get(self, key, latest=False, **kwargs):
            return answers.pop(0)

        async def store(self, key, value, expiration_time, subkey=None, **kwargs):
            return True

    def entry(v, exp):
        return ValueWithExpiration(v, exp)

    dht = GuardedDHT(Node())
    answers.append(ValueWithExpiration({"a": entry(b"a1", now + 60), "b": entry(b"b1", now + 60), "c": entry(b"c1", now - 1)}, now + 60))
    got = (await dht.get("k", latest=True)).value
    assert set(got) == {"a", "b"}  # an expired entry is never given
    # the next read reaches only a replica that lacks b, and has an older a
    answers.append(ValueWithExpiration({"a": entry(b"a0", now + 30)}, now + 30))
    got = (await dht.get("k", latest=True)).value
    assert {k: v.value for k, v in got.items()} == {"a": b"a1", "b": b"b1"}
    # nothing answers at all: still the unexpired entries; a newer entry replaces an older one
    answers.append(None)
    assert set((await dht.get("k", latest=True)).value) == {"a", "b"}
    answers.append(ValueWithExpiration({"b": entry(b"b2", now + 90)}, now + 90))
    assert (await dht.get("k", latest=True)).value["b"].value == b"b2"
    # this peer's own store is in its next read whatever answers
    assert await dht.store("k", b"mine", now + 60, subkey="me")
    answers.append(None)
    assert (await dht.get("k", latest=True)).value["me"].value == b"mine"


async def test_an_idle_peers_job_poll_asks_one_of_the_job_keys_nodes_and_a_job_in_sight_all(monkeypatch):
    """With no member showing a job, the backstop poll reads one of the job key's 5 nodes (every idle
    peer asking all five made the key's nodes the busiest of 48); once a member shows one, two."""
    import types

    from hivemind.utils import ValueWithExpiration, get_dht_time

    from spantrain_p2p.job.spec import JobSpec
    from spantrain_p2p.swarm.identity import Identity
    from spantrain_p2p.swarm.records import sign_payload
    from spantrain_p2p.train import run_records

    monkeypatch.setattr(run_records, "JOB_IDLE_POLL_S", 0.0)
    me, other = Identity.generate(), Identity.generate()
    idle = types.SimpleNamespace(peer_id=other.peer_id, state="idle", progress={})
    asked = []
    job = JobSpec(steps=3).finalized()
    copy = {other.peer_id: ValueWithExpiration(sign_payload(job.to_dict(), other), get_dht_time() + 60)}

    from spantrain_p2p.swarm import keys

    read = []

    async def get_many(ks, latest=False, **kw):
        asked.append(kw.get("holders"))
        read.append(sorted(ks))
        if len(asked) < 3:
            return dict.fromkeys(ks)
        idle.state = "training"  # a member shows a job: the next read asks every node, and finds it
        found = ValueWithExpiration(copy, get_dht_time() + 60) if len(asked) > 3 else None
        return {k: found if k == keys.job_key_of("s", other.peer_id) else None for k in ks}

    peer = types.SimpleNamespace(peer_id=me.peer_id, dht=types.SimpleNamespace(get_many=get_many),
                                 live_members=lambda: [idle], member_ids=lambda: frozenset({me.peer_id, other.peer_id}),
                                 config=types.SimpleNamespace(swarm="s"))
    found = await run_records.RunRecords(peer, log_bad=lambda s, w: None, poll_s=0.01).await_job()
    assert found.job_id == job.job_id
    assert asked[:3] == [1, 1, 1] and asked[3:] == [2]  # in sight: 2 of each key's nodes
    # its first read every key; then one a poll, the key its one other member's copy would be in; in
    # sight, every key again
    theirs = keys.job_key_of("s", other.peer_id)
    assert read[0] == read[3] == keys.job_keys("s") and read[1] == read[2] == [theirs]


async def test_a_joiner_of_a_large_swarm_reads_the_job_copies_one_bucket_at_a_time_until_enough_agree():
    """Copies lie in 16 keys by member id: with more than 16 copies a key in sight, a joiner reads one
    key at a time (a random order) and stops at 16 valid copies; a copy under another member's bucket
    is refused."""
    import types

    from hivemind.utils import ValueWithExpiration, get_dht_time

    from spantrain_p2p.job.spec import JobSpec
    from spantrain_p2p.swarm import keys
    from spantrain_p2p.swarm.identity import Identity
    from spantrain_p2p.swarm.records import sign_payload
    from spantrain_p2p.train import run_records

    job = JobSpec(steps=3).finalized()
    ids = [Identity.generate() for _ in range(40)]
    by_key: dict = {}
    for i in ids:
        by_key.setdefault(keys.job_key_of("s", i.peer_id), {})[i.peer_id] = ValueWithExpiration(
            sign_payload(job.to_dict(), i), get_dht_time() + 60)
    stray = ids[0]  # its copy also under a key it does not hash to
    wrong = next(k for k in keys.job_keys("s") if k != keys.job_key_of("s", stray.peer_id))
    by_key.setdefault(wrong, {})[stray.peer_id] = by_key[keys.job_key_of("s", stray.peer_id)][stray.peer_id]
    reads, bad = [], []

    async def get_many(ks, latest=False, **kw):
        reads.append(list(ks))
        return {k: ValueWithExpiration(by_key[k], get_dht_time() + 60) if k in by_key else None for k in ks}

    members = frozenset(i.peer_id for i in ids) | {f"Qm{n}" for n in range(400)}  # a large swarm
    peer = types.SimpleNamespace(peer_id="QmMe", dht=types.SimpleNamespace(get_many=get_many),
                                 member_ids=lambda: members, config=types.SimpleNamespace(swarm="s"))
    rr = run_records.RunRecords(peer, log_bad=lambda s, why: bad.append(why))
    votes, _ = await rr._read_copies(sight=False, bad="")  # (a joiner's first read, or in sight: alike)
    assert all(len(r) == 1 for r in reads)
    got = sum(map(len, votes.values()))
    assert got >= run_records.JOB_VOTES or len(reads) == len(keys.job_keys("s"))
    assert len(reads) < len(keys.job_keys("s")) and list(votes) == [job.job_id]
    if any(wrong in r for r in reads):
        assert any("another bucket" in w for w in bad)


async def test_copies_that_disagree_make_a_joiner_read_every_job_key():
    """One bucket filled with copies of another job (ids made to hash there) cannot decide for a
    joiner of a large swarm: where copies disagree it reads every key, and the job most copies run wins."""
    import types

    from hivemind.utils import ValueWithExpiration, get_dht_time

    from spantrain_p2p.job.spec import JobSpec
    from spantrain_p2p.swarm import keys
    from spantrain_p2p.swarm.identity import Identity
    from spantrain_p2p.swarm.records import sign_payload
    from spantrain_p2p.train import run_records

    good, bad = JobSpec(steps=3).finalized(), JobSpec(steps=4).finalized()
    honest = [Identity.generate() for _ in range(48)]
    while not any(keys.job_key_of("s", i.peer_id) == keys.job_keys("s")[0] for i in honest):
        honest.append(Identity.generate())  # at scale every bucket holds honest copies (N / 16 each)
    # ids that hash into one bucket, as an attacker would make them: twice its honest copies and more
    # (each is ~16 keys of 52 ms to make: 20 of them took 15 CPU-s of the suite)
    there = sum(keys.job_key_of("s", i.peer_id) == keys.job_keys("s")[0] for i in honest)
    liars = []
    while len(liars) < 2 * there + 2:
        i = Identity.generate()
        if keys.job_key_of("s", i.peer_id) == keys.job_keys("s")[0]:
            liars.append(i)
    by_key: dict = {}
    for ids, job in ((honest, good), (liars, bad)):
        for i in ids:
            by_key.setdefault(keys.job_key_of("s", i.peer_id), {})[i.peer_id] = ValueWithExpiration(
                sign_payload(job.to_dict(), i), get_dht_time() + 60)
    reads = []

    async def get_many(ks, latest=False, **kw):
        reads.extend(ks)
        return {k: ValueWithExpiration(by_key[k], get_dht_time() + 60) if k in by_key else None for k in ks}

    members = frozenset(i.peer_id for i in honest + liars) | {f"Qm{n}" for n in range(400)}
    peer = types.SimpleNamespace(peer_id="QmMe", dht=types.SimpleNamespace(get_many=get_many),
                                 member_ids=lambda: members, config=types.SimpleNamespace(swarm="s"))
    rr = run_records.RunRecords(peer, log_bad=lambda s, why: None)
    for _ in range(5):  # whichever key comes first
        reads.clear()
        votes, _ = await rr._read_copies(sight=True, bad="")
        if len(votes) > 1:
            assert sorted(reads) == keys.job_keys("s") and len(votes[good.job_id]) == len(honest)
        assert max(votes.values(), key=len)[0].job_id == good.job_id
