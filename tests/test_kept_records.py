"""What a long run keeps in the DHT: the planner's stage map and every peer's measurements outlive
their TTL for as long as their writer runs (a run of more than 10 minutes with no new epoch found the
map key empty, and after an hour every profile and vote had expired)."""
import asyncio
import time
import types

from hivemind.utils import get_dht_time

from spantrain_p2p.swarm import keys, measure
from spantrain_p2p.swarm.identity import Identity


def fake_peer(stores: list):
    ident = Identity.generate()

    async def store(key, value, expiration_time, subkey=None):
        stores.append((key, subkey, value, expiration_time))
        return True

    return types.SimpleNamespace(peer_id=ident.peer_id, identity=ident, config=types.SimpleNamespace(swarm="s"),
                                 dht=types.SimpleNamespace(store=store), spawn=lambda coro, name: coro.close())


async def test_a_peer_keeps_publishing_its_latest_profile_links_and_vote_but_not_its_pings_or_accusations():
    stores: list = []
    peer = fake_peer(stores)
    peer.noted = []

    async def note_measured(what, mv, signed):  # the record announces each new version
        peer.noted.append((what, mv))

    peer.note_measured = note_measured
    await measure.publish(peer, measure.PROFILES, {"profile": 1})
    await measure.publish(peer, measure.LINKS, {"links": {"a": 1}})
    await measure.publish(peer, measure.LINKS, {"links": {"a": 2}})  # the latest is kept
    await measure.publish(peer, measure.PINGS, {"peers": 3})
    await measure.publish(peer, keys.ACCUSE, {"peers": ["x"]})
    first = len(stores)
    task = asyncio.ensure_future(measure.keep(peer, every_s=0.05))
    for _ in range(200):  # until two rounds, by event, not a set sleep (a loaded box's sleeps run long)
        if len(stores) - first >= 4:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    again = stores[first:]
    kinds = {k for k, *_ in again}
    assert kinds == {keys.measure_key_of("s", measure.PROFILES, peer.peer_id),
                     keys.measure_key_of("s", measure.LINKS, peer.peer_id)}
    assert len(again) >= 4  # more than one round
    links = [v for k, _, v, _ in again if k == keys.measure_key_of("s", measure.LINKS, peer.peer_id)]
    from spantrain_p2p.swarm.records import open_payload

    # the latest links, with their version (one counter, growing, from the clock's deciseconds: a peer
    # restarted under the same id goes on above its last life's): a copy re-published is no new version
    versions = [mv for _, mv in peer.noted]
    assert [w for w, _ in peer.noted] == [measure.PROFILES, measure.LINKS, measure.LINKS]
    assert versions == sorted(set(versions)) and versions[0] >= int(time.time() * 10) - 100
    assert all(open_payload(v, measure.MAX_BYTES)[1] == {"links": {"a": 2}, "mv": versions[-1]} for v in links)
    assert all(exp > get_dht_time() + measure.TTL_S - 5 for *_, exp in again)


async def test_the_planner_re_stores_its_last_map_while_it_leads_and_stops_when_it_does_not():
    from spantrain_p2p.job.spec import JobSpec
    from spantrain_p2p.plan.stagemap import placeholder_map
    from spantrain_p2p.train.run_records import RunRecords

    stores: list = []
    peer = fake_peer(stores)
    rr = RunRecords(peer, log_bad=lambda s, w: None)
    job = JobSpec(steps=3).finalized()
    rr.start(job, 4)
    smap = placeholder_map([peer.peer_id], 4, job.job_id, epoch=3)
    await rr.publish_map(smap)
    assert len(stores) == 1
    leading = [True]
    task = asyncio.ensure_future(rr.keep_map(lambda: leading[0], every_s=0.05))
    for _ in range(200):  # until two re-stores, by event (a loaded box's sleeps run long: 0.13 s once held one)
        if len(stores) >= 3:
            break
        await asyncio.sleep(0.05)
    leading[0] = False
    kept = len(stores)
    assert kept >= 3 and all(s[:3] == stores[0][:3] for s in stores)  # the same signed bytes, same subkey
    assert stores[-1][3] > stores[0][3]  # a later expiry
    await asyncio.sleep(0.2)
    task.cancel()
    assert len(stores) == kept
