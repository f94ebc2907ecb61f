"""A new stage map handed down the tree (train.run_records with train.map_tree): every live peer of
the map takes it without reading the DHT, a dead peer's subtree gets it from the dead peer's sender,
nobody sends more than the fan-out (plus a lost child's children), and a forged map is refused and
passed on to nobody. Fake peers: the data plane is a direct call."""
import asyncio
import time
import types

import pytest

from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.net.framing import FrameError
from spantrain_p2p.plan.stagemap import placeholder_map
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.train import map_tree
from spantrain_p2p.train.run_records import RunRecords


async def _until(done, limit_s: float = 20.0) -> None:
    """Waits for ``done()`` by polling (by event, not a set sleep: a loaded box's tasks run late)."""
    for _ in range(int(limit_s / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)


def _swarm(n: int, dead: set[int]):
    idents = [Identity.generate() for _ in range(n)]
    ids = [i.peer_id for i in idents]
    records: dict[str, RunRecords] = {}
    sent: dict[str, int] = {p: 0 for p in ids}
    job = JobSpec(steps=3).finalized()

    def make(k: int) -> RunRecords:
        me = ids[k]

        async def send(url, kind, header, buffers=(), timeout=30.0, link=None, peer_id=None, **kw):
            assert kind == "mapnews"
            sent[me] += 1
            if ids.index(url) in dead:
                raise ConnectionRefusedError("dead")
            return await records[url].on_news({**header, "src": me}, [memoryview(b) for b in buffers])

        async def no_read(*a, **kw):
            raise AssertionError("a peer handed the map read the DHT")

        async def store(*a, **kw):
            return True

        peer = types.SimpleNamespace(
            peer_id=me, identity=idents[k], config=types.SimpleNamespace(swarm="s"),
            dht=types.SimpleNamespace(store=store, get=no_read), spawn=lambda coro, name: asyncio.ensure_future(coro),
            client=types.SimpleNamespace(send=send), data_url_of=lambda p: p, last_data_url=lambda p: p,
            link_to=lambda p: None, name_of=lambda p: p[:8], ever_member=lambda p: p in ids, live_members=lambda: [],
            member_ids=lambda: frozenset(ids), swim=None)
        rr = RunRecords(peer, log_bad=lambda s, w: None)
        rr.start(job, n)
        return rr

    for k in range(n):
        records[ids[k]] = make(k)
    return ids, records, sent, job


async def test_every_live_peer_of_the_map_takes_it_down_the_tree_and_a_dead_ones_subtree_too():
    n, dead = 40, set()
    ids, records, sent, job = _swarm(n, dead)
    planner = ids[0]
    smap = placeholder_map(ids, n, job.job_id, epoch=2)
    tree = map_tree.order(ids, planner, smap.term, smap.epoch)
    lost = tree[1]  # an inner node, dead: whatever it would have handed on comes from its sender
    dead.add(ids.index(lost))
    lost_kids = map_tree.children(tree, lost, planner)
    assert lost_kids
    await records[planner].publish_map(smap)
    await _until(lambda: all(records[p]._map_read is not None for p in ids[1:] if p != lost))
    await asyncio.sleep(0.05)
    got = [p for p in ids[1:] if records[p]._map_read is not None]
    assert set(got) == set(ids[1:]) - {lost}
    for p in got:
        m = await records[p].newest_map()  # taken as read: no DHT read (the fake DHT raises)
        assert (m.term, m.epoch) == (smap.term, smap.epoch) and m.stages == smap.stages
    for p in ids:
        bound = map_tree.FANOUT + (len(lost_kids) if p == planner else 0)  # (tree[1]'s sender: the planner)
        assert sent[p] <= bound, (p == planner, sent[p])
    assert sent[planner] >= 1 and max(sent.values()) <= 2 * map_tree.FANOUT


async def test_a_forged_map_is_refused_and_passed_on_to_nobody():
    n = 12
    ids, records, sent, job = _swarm(n, set())
    smap = placeholder_map(ids, n, job.job_id, epoch=2)
    from spantrain_p2p.swarm.records import sign_payload

    signed = sign_payload(smap.to_dict(), Identity.generate(), 256 << 10)  # a stranger's key
    with pytest.raises(FrameError, match="signed by a member"):
        await records[ids[3]].on_news({"job": job.job_id, "term": 0, "epoch": 2},
                                      [signed["body"], signed["key"], signed["sig"]])
    good = sign_payload(smap.to_dict(), records[ids[0]].peer.identity, 256 << 10)
    with pytest.raises(FrameError):  # the body changed under its signature
        await records[ids[3]].on_news({"job": job.job_id}, [good["body"][:-1] + b"\0", good["key"], good["sig"]])
    with pytest.raises(FrameError, match="three buffers"):
        await records[ids[3]].on_news({"job": job.job_id}, [good["body"]])
    await asyncio.sleep(0.05)
    assert records[ids[3]]._map_read is None and sum(sent.values()) == 0


async def test_an_older_map_handed_again_is_neither_taken_nor_passed_on_and_a_repeat_is_parsed_once():
    """Any member could hand an old, validly signed map of the job again: it would go down a whole
    subtree each time. An older map than the one followed is dropped; the same map again is not even
    parsed (its body's digest)."""
    n = 20
    ids, records, sent, job = _swarm(n, set())
    from spantrain_p2p.swarm.records import sign_payload

    planner = records[ids[0]]
    old, new = (placeholder_map(ids, n, job.job_id, epoch=e) for e in (2, 3))
    await planner.publish_map(new)
    await _until(lambda: all(records[p]._map_read is not None for p in ids[1:]))
    await asyncio.sleep(0.05)
    before = dict(sent)
    me = ids[5]
    stale = sign_payload(old.to_dict(), planner.peer.identity, 256 << 10)
    await records[me].on_news({"job": job.job_id}, [stale["body"], stale["key"], stale["sig"]])
    await asyncio.sleep(0.05)
    assert sent == before and records[me]._map_read[2].epoch == 3
    calls = []
    real = records[me]._valid_map
    records[me]._valid_map = lambda *a: calls.append(1) or real(*a)
    again = sign_payload(new.to_dict(), planner.peer.identity, 256 << 10)
    for _ in range(3):  # (the same signed bytes, as every copy of it is)
        await records[me].on_news({"job": job.job_id}, [again["body"], again["key"], again["sig"]])
    assert len(calls) <= 1 and sent == before


async def test_a_head_heard_on_a_ping_waits_for_the_map_down_the_tree_before_the_key_is_read(monkeypatch):
    from spantrain_p2p.train import run_records

    monkeypatch.setattr(run_records, "PUSH_TIMEOUT_S", 1.0)
    n = 12
    ids, records, sent, job = _swarm(n, set())
    smap = placeholder_map(ids, n, job.job_id, epoch=4)
    me = records[ids[3]]
    me.heard_head(smap.term, smap.epoch, job.job_id)  # a ping told the head first
    assert me._maps_changed == 0
    await records[ids[0]].publish_map(smap)  # ... and the map comes down the tree
    await _until(lambda: me._map_read is not None)
    await asyncio.sleep(1.2)  # (past the head's wait)
    assert me._maps_changed == 1 and me._map_read[2].epoch == 4  # taken once: no read of the key
    other = records[ids[4]]
    other._hearsay = (other._hearsay[0] - run_records.HEARSAY_GAP_S, other._hearsay[1])
    other.heard_head(smap.term, smap.epoch + 1, job.job_id)  # a head whose map never comes
    await _until(lambda: other._maps_changed == 2)
    assert other._maps_changed == 2 and other._news.is_set()  # chased: the key is read next


async def test_a_followers_quiet_check_asks_a_member_not_the_key_and_takes_a_newer_map_it_holds():
    """Every follower read the key's one node once an hour: at 10,000 peers (a 559 KB map) 320 KB/s at
    each node of the key. A quiet check now asks one member at random ("mapget"): one that holds a
    newer map hands it over (checked as a read is); one that holds none says nothing; one that does
    not answer sends the asker to the key."""
    n = 6
    ids, records, sent, job = _swarm(n, set())
    gets = []
    for k, p in enumerate(ids):  # the fake data plane: "mapget" to the asked peer's on_get
        rr = records[p]
        real = rr.peer.client.send

        async def send(url, kind, header, buffers=(), timeout=30.0, link=None, peer_id=None, _real=real, **kw):
            if kind == "mapget":
                gets.append(url)
                if url == ids[5]:
                    raise ConnectionRefusedError("gone")
                return await records[url].on_get(header, buffers)
            return await _real(url, kind, header, buffers, timeout=timeout, link=link, peer_id=peer_id, **kw)

        rr.peer.client = types.SimpleNamespace(send=send)
    old, new = (placeholder_map(ids, n, job.job_id, epoch=e) for e in (2, 3))
    from spantrain_p2p.swarm.records import sign_payload

    signed = sign_payload(new.to_dict(), records[ids[0]].peer.identity, 256 << 10)
    me = records[ids[2]]
    # follows epoch 2, its read over an hour old (the clock is the host's monotonic one: 0.0 was not
    # an hour ago on a host booted less than an hour before, and no check was made)
    an_hour_ago = time.monotonic() - 3601
    me._map_read = (an_hour_ago, me._maps_changed, old)
    records[ids[1]]._hold((new.term, new.epoch), signed)  # ids[1] holds epoch 3
    import random

    for pick, want in ((ids[3], 2), (ids[1], 3)):  # ids[3] holds nothing newer; ids[1] does
        random.seed(0)
        me.peer.member_ids = lambda pick=pick: frozenset({pick, me.peer.peer_id})
        got = await me.newest_map(max_age_s=3600)  # (the fake DHT raises if read)
        assert got.epoch == want and gets[-1] == pick
        me._map_read = (an_hour_ago, me._maps_changed, got)
    me.peer.member_ids = lambda: frozenset({ids[5], me.peer.peer_id})  # no answer: the key is read
    with pytest.raises(AssertionError, match="read the DHT"):
        await me.newest_map(max_age_s=3600)
    with pytest.raises(FrameError):
        await me.on_get({"job": job.job_id, "term": "0", "epoch": 1}, [])
