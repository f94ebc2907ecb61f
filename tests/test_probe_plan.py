"""Which links a peer pings and probes (``swarm.probe_plan``): every member up to 16, a bounded set
beyond, so that a swarm's measuring grows linearly with its size; and the groups and region figures
the planner gets from the sparse set. Plain functions over plain data, no clock."""
from spantrain_p2p.swarm.probe_plan import PING_MAX, ping_targets, probe_budget, probe_targets, sparse_probe_plan


def test_small_swarms_are_probed_as_a_full_mesh():
    peers = [f"p{i}" for i in range(16)]
    plan = sparse_probe_plan(peers, [peers[:8], peers[8:]])
    assert len(plan) == 16 * 15 and len(set(plan)) == len(plan)


def test_large_swarms_probe_inside_groups_plus_samples_across_so_cost_grows_linearly():
    sizes = {}
    for n in (32, 64, 128, 256):
        peers = [f"peer-{i:03d}" for i in range(n)]
        groups = [peers[i:i + 8] for i in range(0, n, 8)]
        plan = sparse_probe_plan(peers, groups, samples_across=2)
        sizes[n] = len(plan)
        group_of = {p: gi for gi, g in enumerate(groups) for p in g}
        inside = {(a, b) for g in groups for a in g for b in g if a != b}
        assert inside <= set(plan)  # every pair inside a group
        for p in peers:  # and each peer samples 2 peers of 2 other groups
            across = [b for a, b in plan if a == p and group_of[b] != group_of[p]]
            assert len(across) == 2 and len({group_of[b] for b in across}) == 2
        assert plan == sparse_probe_plan(list(reversed(peers)), [list(reversed(g)) for g in reversed(groups)])
    assert all(sizes[n] == n * (7 + 2) for n in sizes)  # exactly linear here
    assert sizes[256] < 256 * 255 / 25


def test_peers_outside_every_group_still_get_sampled():
    peers = [f"p{i:02d}" for i in range(40)]
    plan = sparse_probe_plan(peers, [peers[:20]], samples_across=3)
    lonely = peers[20:]
    assert all(sum(1 for a, _ in plan if a == p) == 3 for p in lonely)


def _two_regions(n: int) -> tuple[list[str], dict[str, str], dict[tuple[str, str], float]]:
    """n peers, the first half in region a, the rest in b: 1 ms inside a region, 50 ms across (+ noise)."""
    peers = [f"peer-{i:03d}" for i in range(n)]
    region = {p: "a" if i < n // 2 else "b" for i, p in enumerate(peers)}
    rtt = {(x, y): (0.001 if region[x] == region[y] else 0.050) * (1 + 0.01 * ((i * 7 + j * 3) % 5))
           for i, x in enumerate(peers) for j, y in enumerate(peers) if x != y}
    return peers, region, rtt


def test_each_peer_probes_every_member_up_to_16_and_a_bounded_set_beyond():
    peers, region, rtt = _two_regions(16)
    assert probe_targets(peers[0], peers, {}) == peers[1:]  # the full mesh, pinged or not
    assert probe_budget(16) == 15 and probe_budget(17) == 10 and probe_budget(1000) == 10
    for n in (48, 1000):
        peers, region, rtt = _two_regions(n)
        for me in (peers[0], peers[-1]):
            rtts = {p: rtt[(me, p)] for p in peers if p != me}
            got = probe_targets(me, peers, rtts)
            assert me not in got and len(got) == probe_budget(n) == 10
            near = [p for p in got if region[p] == region[me]]
            assert len(near) >= 8  # its 8 nearest are its region's; the 2 others by hash, anywhere
            assert got == probe_targets(me, list(reversed(peers)), rtts)  # not the members' order


def test_each_peer_pings_every_member_up_to_16_and_24_beyond_its_probes_picked_from_them():
    """A joiner of 1,000 pinged all 1,000 in turn (ten rounds): beyond the full mesh it pings 24 by a
    hash of the pair, a different sample for every peer, and probes its nearest among them."""
    peers, region, rtt = _two_regions(16)
    assert ping_targets(peers[3], peers) == [p for p in peers if p != peers[3]]
    for n in (48, 1000):
        peers, region, rtt = _two_regions(n)
        samples = [ping_targets(me, peers) for me in peers[:20]]
        assert all(len(t) == PING_MAX and me not in t for me, t in zip(peers, samples))
        assert len({tuple(t) for t in samples}) == 20 and ping_targets(peers[0], list(reversed(peers))) == samples[0]
        me = peers[0]
        rtts = {p: rtt[(me, p)] for p in samples[0]}
        got = probe_targets(me, peers, rtts)
        eighth = sorted(rtts.values())[7]
        assert len(got) == 10 and sum(rtts.get(p, 1.0) <= eighth for p in got) >= 8  # its 8 nearest pinged, 2 by hash


def test_members_without_a_ping_count_as_far_and_newcomers_barely_move_the_set():
    peers, region, rtt = _two_regions(48)
    me = peers[0]
    rtts = {p: rtt[(me, p)] for p in peers[1:40]}  # 8 joined after its pings
    got = probe_targets(me, peers, rtts)
    assert len(got) == 10 and sorted(got, key=lambda p: rtts.get(p, 1.0))[:8] == sorted(
        (p for p in got if p in rtts), key=lambda p: rtts[p])[:8]
    more = probe_targets(me, peers + [f"new-{i}" for i in range(8)], rtts)
    assert len(more) == 10 and len(set(more) - set(got)) <= 2  # only its far picks can change


def test_sparse_probes_leave_the_planner_the_same_groups_and_region_estimates():
    from spantrain_p2p.plan.layout import LinkTable
    from spantrain_p2p.plan.types import Snapshot
    from spantrain_p2p.swarm.grouping import group

    peers, region, rtt = _two_regions(48)
    mbps = {("a", "a"): 1000.0, ("b", "b"): 1000.0, ("a", "b"): 100.0, ("b", "a"): 100.0}

    def snapshot(pairs):
        return Snapshot.from_measurements({
            "devices": [{"peer": p, "tflops": 10.0, "memory_gb": 16.0} for p in peers],
            "links": [{"src": a, "dst": b, "rtt_ms": rtt[(a, b)] * 1e3, "mbps": mbps[(region[a], region[b])]}
                      for a, b in pairs]})

    sparse = [(a, b) for a in peers for b in probe_targets(a, peers, {p: rtt[(a, p)] for p in peers if p != a})]
    full = [(a, b) for a in peers for b in peers if a != b]
    assert len(sparse) == 48 * 10 and len(full) == 48 * 47
    assert sum(region[a] != region[b] for a, b in sparse) > 0  # the far picks measure across
    g_sparse, g_full = group(snapshot(sparse)), group(snapshot(full))
    assert [grp.peers for grp in g_sparse.groups] == [grp.peers for grp in g_full.groups]
    assert len(g_sparse.groups) == 2
    snap = snapshot(sparse)
    table = LinkTable(snap, g_sparse.group_of())
    measured = {frozenset(x) for x in sparse}
    inside = next((a, b) for a in peers for b in peers if a != b and region[a] == region[b]
                  and frozenset((a, b)) not in measured)
    across = next((a, b) for a in peers for b in peers if region[a] != region[b]
                  and frozenset((a, b)) not in measured)
    assert table.estimated(*inside) and table.get(*inside).bandwidth == 1000e6 / 8
    assert table.estimated(*across) and table.get(*across).bandwidth == 100e6 / 8
