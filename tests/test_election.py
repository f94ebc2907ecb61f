import asyncio

from spantrain_p2p.peer import Peer, PeerConfig
from spantrain_p2p.swarm.election import Election, Lease, claim_delay, current_leader, parse_leases
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.swarm.records import sign_payload


def test_the_highest_unexpired_term_leads():
    leases = [Lease(1, "a", 100), Lease(2, "b", 50), Lease(3, "c", 20)]
    assert current_leader(leases, 10, "abc").peer_id == "c"
    assert current_leader(leases, 30, "abc").peer_id == "b"  # term 3 lapsed
    assert current_leader(leases, 200, "abc") is None


def test_two_claims_of_one_term_resolve_to_the_best_ranked_candidate_everywhere():
    leases = [Lease(4, "zed", 100), Lease(4, "amy", 100)]
    assert current_leader(leases, 0, ["zed", "amy"]).peer_id == "amy"
    assert current_leader(list(reversed(leases)), 0, ["amy", "zed"]).peer_id == "amy"


def test_candidates_claim_in_rank_order():
    cands = ["c", "a", "b"]
    assert claim_delay("a", cands, lapsed_at=10, now=10, slot_s=2) == 0
    assert claim_delay("b", cands, lapsed_at=10, now=10, slot_s=2) == 2
    assert claim_delay("c", cands, lapsed_at=10, now=13, slot_s=2) == 1
    assert claim_delay("x", cands, lapsed_at=10, now=99, slot_s=2) == float("inf")


def test_forged_and_misfiled_leases_are_ignored():
    class V:
        def __init__(self, v):
            self.value = v

    a, b = Identity.generate(), Identity.generate()
    good = sign_payload({"term": 2, "peer_id": a.peer_id, "expires": 9.0}, a)
    forged = sign_payload({"term": 3, "peer_id": a.peer_id, "expires": 9.0}, b)  # b claims in a's name
    misfiled = sign_payload({"term": 4, "peer_id": a.peer_id, "expires": 9.0}, a)
    bad = []
    leases = parse_leases({f"{2:012d}/{a.peer_id}": V(good), f"{3:012d}/{a.peer_id}": V(forged),
                           f"{9:012d}/{a.peer_id}": V(misfiled), "x": V(b"?")}, lambda s, r: bad.append(r))
    assert leases == [Lease(2, a.peer_id, 9.0)] and len(bad) == 3


async def test_a_lease_read_counts_a_member_cut_off_but_not_one_that_left_or_a_made_up_expiry():
    """A lease counts while its holder is a member (a live record seen: SWIM may hold it dead across
    a cut, where it still renews its lease), not once SWIM says it left, nor when it runs further
    ahead than two leases (its holder would block every claim until then, gone or not)."""
    import types

    from hivemind.utils import get_dht_time

    from spantrain_p2p.swarm.swim import LEFT

    class V:
        def __init__(self, v):
            self.value = v

    cut, left, liar = Identity.generate(), Identity.generate(), Identity.generate()
    now = get_dht_time()
    raw = {f"{1:012d}/{cut.peer_id}": V(sign_payload({"term": 1, "peer_id": cut.peer_id, "expires": now + 5}, cut)),
           f"{2:012d}/{left.peer_id}": V(sign_payload({"term": 2, "peer_id": left.peer_id, "expires": now + 5}, left)),
           f"{3:012d}/{liar.peer_id}": V(sign_payload({"term": 3, "peer_id": liar.peer_id, "expires": now + 1e9}, liar))}

    async def get(key, latest=True, holders=5):
        return V(raw)

    members = {cut.peer_id, left.peer_id, liar.peer_id}  # records seen, none tombstoned
    states = {left.peer_id: types.SimpleNamespace(state=LEFT)}
    swim = types.SimpleNamespace(swim=types.SimpleNamespace(departed=lambda p: p in states))
    peer = types.SimpleNamespace(peer_id="me", config=types.SimpleNamespace(swarm="s"), dht=types.SimpleNamespace(get=get),
                                 is_member=lambda p: p in members, swim=swim, live_members=lambda: [])
    e = Election(peer, lease_s=6.0)
    assert [l.peer_id for l in await e._read()] == [cut.peer_id]


async def test_peers_agree_on_one_planner_and_a_successor_takes_the_next_term():
    fast = dict(heartbeat_s=0.5, poll_s=0.25)
    async with Peer(PeerConfig(**fast)) as a:
        async with Peer(PeerConfig(join=(a.address,), **fast)) as b, Peer(PeerConfig(join=(a.address,), **fast)) as c:
            await a.wait_members(3, 10)
            await b.wait_members(3, 10)
            await c.wait_members(3, 10)
            elections = [Election(p, lease_s=1.5) for p in (a, b, c)]
            tasks = [asyncio.create_task(e.run(0.25)) for e in elections]
            try:
                for _ in range(40):
                    await asyncio.sleep(0.25)
                    leaders = {(e.leader.term, e.leader.peer_id) if e.leader else None for e in elections}
                    if len(leaders) == 1 and None not in leaders:
                        break
                (term, first), = leaders
                assert sum(e.is_leader for e in elections) == 1
                # the planner stops (as if killed): the others elect a successor with term + 1
                i = next(i for i, e in enumerate(elections) if e.is_leader)
                tasks[i].cancel()
                rest = [e for j, e in enumerate(elections) if j != i]
                for e in rest:
                    e._candidates = lambda e=e, dead=first: [p.peer_id for p in (a, b, c) if p.peer_id != dead]
                for _ in range(60):
                    await asyncio.sleep(0.25)
                    new = {(e.leader.term, e.leader.peer_id) if e.leader else None for e in rest}
                    if len(new) == 1 and None not in new and next(iter(new))[0] > term:
                        break
                (new_term, successor), = new
                assert new_term == term + 1 and successor != first
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)


def test_a_live_lease_is_read_and_renewed_a_third_of_a_lease_apart_a_lapsed_one_every_tick():
    """The leader and the close candidates read (and the leader renews) a live lease three times a
    lease, not every tick: a four-peer training run spent 60 % of its control calls on it. Where
    no leader is seen, every tick (the claims' slots); the far candidates as before."""
    import types

    ids = [f"p{i:02d}" for i in range(10)]
    peer = types.SimpleNamespace(peer_id=ids[0], live_members=lambda: [])
    e = Election(peer, lease_s=6.0, candidates=lambda: ids)
    assert e.interval_s(1.0) == 1.0  # no leader seen: every tick
    e.leader = Lease(1, ids[0], 100.0)  # this peer leads
    assert e.interval_s(1.0) == 2.0
    e.leader = Lease(1, ids[5], 100.0)  # this peer claims first should it lapse
    assert e.interval_s(1.0) == 2.0 and e.interval_s(3.0) == 3.0
    peer.peer_id = ids[9]  # a far candidate: a quarter of a second a candidate
    assert e.interval_s(1.0) == 2.5
