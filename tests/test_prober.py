import asyncio
import dataclasses
import socket
import statistics
import time

import pytest

from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer, RemoteError
from spantrain_p2p.net.emulator import LinkEmulator
from spantrain_p2p.net.passive import FlapDamper, PassiveEstimator, link_update
from spantrain_p2p.net.ping import paired_rtt, ping_link, ping_links
from spantrain_p2p.net.probe_messages import PROBE_KIND, handle_probe
from spantrain_p2p.net.prober import LinkMeasurement, probe_link
from spantrain_p2p.swarm.probe_plan import PING_MAX, ping_targets, probe_budget, probe_targets, sparse_probe_plan
from spantrain_p2p.scenario import parse

pytestmark = pytest.mark.serial  # measures times or rates: run alone (scripts/test.sh)

# three link classes, as in cee-3region (jitter kept where it does not blur a 10 % check)
LINKS = {
    "wan": {"rtt_ms": 40, "mbps": 100, "jitter_ms": 2},
    "metro": {"rtt_ms": 5, "mbps": 1000},
    "slow": {"rtt_ms": 100, "mbps": 20, "jitter_ms": 5},
}


def star_scenario(trace=None):
    """Peer "me" in region "home"; one peer per link class in a region reached over that class."""
    regions = {"home": {"link": "metro"}, **{f"r-{k}": {"link": "metro"} for k in LINKS}}
    rl = [{"regions": ["home", f"r-{k}"], "link": k} for k in LINKS]
    if trace:
        rl[0]["trace"] = trace
    peers = [{"name": "me", "region": "home", "device": "d"}] + [
        {"name": f"peer-{k}", "region": f"r-{k}", "device": "d"} for k in LINKS
    ]
    return parse({"name": "probe-test", "link_classes": LINKS, "device_classes": {"d": {"tflops": 1, "memory_gb": 1}},
                  "regions": regions, "region_links": rl, "peers": peers, "default_link": "metro"})


@pytest.fixture
async def probe_server():
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {})
    srv.register(PROBE_KIND, handle_probe)
    await srv.start()
    client = DataPlaneClient()
    yield srv, client
    await client.close()
    await srv.stop()


@pytest.mark.parametrize("cls", ["wan", "metro", "slow"])
async def test_probing_measures_bandwidth_and_rtt_within_10_percent(probe_server, cls):
    srv, client = probe_server
    emu = LinkEmulator(star_scenario(), "me")
    m = await probe_link(client, srv.url, f"peer-{cls}", emu, deadline_s=10)
    assert m.status == "ok" and m.error == "", m
    c = LINKS[cls]
    print(f"FIGURE probe {cls} ({c['mbps']} Mbit/s, {c['rtt_ms']} ms): RTT {m.rtt_ms:.2f} ms ({m.rtt_ms / c['rtt_ms'] - 1:+.1%}), "
          f"bandwidth {m.mbps:.1f} Mbit/s ({m.mbps / c['mbps'] - 1:+.1%}), {m.bulk_bytes / 2**20:.1f} MiB bulk, {m.seconds:.2f} s")
    # within 10 %, or 1 ms over: the event loop's poll waits whole ms, and the 5 ms link read 5.77 ms in
    # one of the day's six suites' serial parts (2026-12-02 03:08 UTC; 5.12-5.22 alone and in the serial part rerun)
    rtt = LINKS[cls]["rtt_ms"]
    assert 0.9 * rtt <= m.rtt_ms <= max(1.1 * rtt, rtt + 1.0), m
    assert m.mbps == pytest.approx(LINKS[cls]["mbps"], rel=0.10), m
    assert m.seconds < 2.5, m
    assert LinkMeasurement.from_dict(m.to_dict()) == m


async def test_a_long_link_that_answers_gets_round_trips_beyond_the_deadline(probe_server):
    """The "slow" link (100 ms, 20 Mbit/s) in a world 4 times slower: 400 ms round trips. Four pings
    and a bulk transfer take more than the 1.5 s deadline; the first answer stretches it."""
    srv, client = probe_server
    emu = LinkEmulator(dataclasses.replace(star_scenario(), time_dilation=4.0), "me")
    m = await probe_link(client, srv.url, "peer-slow", emu, ping_count=3, deadline_s=1.5)
    assert m.status == "ok", m
    assert m.rtt_ms == pytest.approx(400, rel=0.15) and m.mbps == pytest.approx(5, rel=0.3), m
    assert m.seconds > 1.5


async def test_an_rtt_pinged_earlier_in_a_quiet_moment_is_used_instead_of_new_pings(probe_server):
    srv, client = probe_server
    emu = LinkEmulator(star_scenario(), "me")
    m = await probe_link(client, srv.url, "peer-metro", emu, rtt_s=0.0123)  # made up, to see it is kept
    assert m.status == "ok" and m.rtt_ms == pytest.approx(12.3), m
    assert m.mbps == pytest.approx(1000, rel=0.10), m
    for bad in (float("nan"), float("inf"), -1.0, 0.0):  # no usable RTT: it pings by itself
        m = await probe_link(client, srv.url, "peer-metro", emu, rtt_s=bad)
        # the link's 5 ms and our own stack's round trip, which a busy moment only lengthens (5.76 ms
        # once in the suite's serial part, 2026-12-02 01:45 UTC): none of the bad values it was given
        assert m.status == "ok" and 0.95 * 5.0 <= m.rtt_ms <= 5.0 + 1.5, (bad, m)


async def test_pings_less_a_baseline_ping_to_our_own_server_leave_the_link_alone(probe_server):
    """The ping through our own HTTP stack (no link) is taken off each sample of the link's."""
    srv, client = probe_server
    emu = LinkEmulator(star_scenario(), "me")
    own = DataPlaneServer("127.0.0.1", 0, lambda: {})
    own.register(PROBE_KIND, handle_probe)
    await own.start()
    try:
        raw = await ping_link(client, srv.url, "peer-metro", emu, count=12)
        paired = await ping_link(client, srv.url, "peer-metro", emu, count=12, gap_s=0.002, min_s=0.2,
                                 baseline_url=own.url)
        around = await ping_link(client, srv.url, "peer-metro", emu, count=12, gap_s=0.002, min_s=0.2,
                                 baseline_url=own.url, around_emulator=True)
    finally:
        await own.stop()
    assert len(raw) == 12 and 12 <= len(paired) <= 48 and 12 <= len(around) <= 48, (raw, paired, around)
    print(f"\nFIGURE 5 ms link: raw median {statistics.median(raw) * 1e3:.3f} ms, "
          f"less our own stack's round trip {paired_rtt(paired) * 1e3:.3f} ms, "
          f"less the same server's unshaped round trip {paired_rtt(around) * 1e3:.3f} ms")
    # with a baseline the emulator does not take the loopback's round trip off the link's ping
    # as well (it did before: 3.7-4.5 ms, a CI run failed on it)
    assert paired_rtt(paired) == pytest.approx(0.005, rel=0.2)
    assert paired_rtt(around) == pytest.approx(0.005, rel=0.2)


async def test_pinging_several_links_in_rounds_gives_each_its_samples_and_drops_a_dead_one(probe_server):
    srv, client = probe_server
    emu = LinkEmulator(star_scenario(), "me")
    with socket.socket() as dead:  # listens, never answers
        dead.bind(("127.0.0.1", 0))
        dead.listen()
        t = time.perf_counter()
        found = await ping_links(client, [("peer-metro", srv.url), ("peer-wan", srv.url),
                                          ("peer-slow", f"http://127.0.0.1:{dead.getsockname()[1]}")],
                                 emu, count=5, min_s=0.3, ping_timeout_s=0.5)
        took = time.perf_counter() - t
    assert found["peer-slow"] == [] and took < 2.0, (found, took)
    assert 5 <= len(found["peer-wan"]) <= 20, found
    # the 5 ms link is pinged up to 4 times a round, the 40 ms one once
    assert len(found["peer-wan"]) < len(found["peer-metro"]) <= 4 * len(found["peer-wan"]), found
    assert statistics.median(found["peer-metro"]) == pytest.approx(0.005, rel=0.2)
    assert statistics.median(found["peer-wan"]) == pytest.approx(0.040, rel=0.1)


async def test_pinging_links_several_at_a_time_takes_the_longest_round_trip_not_their_sum(probe_server):
    """``at_once``: a joiner of a large swarm pings its sample 8 at a time; the same samples come
    back, each round taking about the slowest link's round trip instead of all of them in turn."""
    srv, client = probe_server
    emu = LinkEmulator(star_scenario(), "me")
    targets = [("peer-wan", srv.url), ("peer-slow", srv.url)]
    t = time.perf_counter()
    apart = await ping_links(client, targets, emu, count=6)
    in_turn = time.perf_counter() - t
    t = time.perf_counter()
    both = await ping_links(client, targets, emu, count=6, at_once=2)
    together = time.perf_counter() - t
    assert all(len(v) >= 6 for v in (*apart.values(), *both.values())), (apart, both)
    assert statistics.median(both["peer-wan"]) == pytest.approx(0.040, rel=0.15)
    assert statistics.median(both["peer-slow"]) == pytest.approx(0.100, rel=0.15)
    assert together < 0.9 * in_turn, (in_turn, together)  # rounds of ~100 ms instead of ~140
    with pytest.raises(ValueError):
        await ping_links(client, targets, emu, at_once=0)


def test_paired_rtt_is_the_median_and_shrugs_off_stalls_either_way():
    assert paired_rtt([0.005] * 10 + [0.4, -0.3]) == pytest.approx(0.005)
    assert paired_rtt([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == pytest.approx(3.5)
    with pytest.raises(ValueError):
        paired_rtt([])


async def test_pinging_a_peer_that_never_answers_gives_no_samples_by_the_deadline():
    with socket.socket() as s:  # listens, never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        client = DataPlaneClient()
        try:
            t = time.perf_counter()
            samples = await ping_link(client, f"http://127.0.0.1:{s.getsockname()[1]}", "x", count=3, deadline_s=0.5)
            assert samples == [] and time.perf_counter() - t < 1.5
        finally:
            await client.close()


async def test_a_peer_that_never_answers_is_unknown_within_the_deadline(probe_server):
    srv, client = probe_server
    release = asyncio.Event()

    async def stuck(header, buffers):
        await release.wait()  # never answers until the test is over
        return None

    srv.register("probe", stuck)
    try:
        t = time.perf_counter()
        m = await probe_link(client, srv.url, "peer-wan", LinkEmulator(star_scenario(), "me"), deadline_s=1.0)
        assert time.perf_counter() - t < 1.5
        assert m.status == "unknown" and m.rtt_ms is None and m.mbps is None and "deadline" in m.error
    finally:
        release.set()  # else stopping the server waits for the stuck handler


async def test_a_peer_that_stops_answering_mid_probe_is_unknown_and_keeps_what_was_measured(probe_server):
    srv, client = probe_server
    release = asyncio.Event()

    async def pings_only(header, buffers):
        if header.get("op") == "bulk":
            await release.wait()
        return await handle_probe(header, buffers)

    srv.register("probe", pings_only)
    try:
        m = await probe_link(client, srv.url, "peer-metro", LinkEmulator(star_scenario(), "me"), deadline_s=1.0)
        assert m.status == "unknown" and m.mbps is None and m.rtt_ms == pytest.approx(5, rel=0.2)
    finally:
        release.set()


async def test_a_closed_port_or_a_peer_without_a_prober_is_unknown_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nobody listens there
    client = DataPlaneClient()
    try:
        t = time.perf_counter()
        m = await probe_link(client, f"http://127.0.0.1:{port}", "x", None, deadline_s=5)
        assert m.status == "unknown" and m.error and time.perf_counter() - t < 1.0
        srv = DataPlaneServer("127.0.0.1", 0, lambda: {})  # serves no "probe" kind: 404
        await srv.start()
        try:
            m = await probe_link(client, srv.url, "x", None, deadline_s=5)
            assert m.status == "unknown" and "404" in m.error
        finally:
            await srv.stop()
    finally:
        await client.close()


async def test_the_probe_handler_refuses_malformed_probes_with_a_reason(probe_server):
    srv, client = probe_server
    for header, bufs, why in [
        ({"v": 1, "op": "ping", "seq": 1}, [b"x" * 5000], "at most"),
        ({"v": 1, "op": "dance"}, [], "op"),
        ({"v": 9, "op": "ping", "seq": 1}, [], "version"),
        ({"op": "ping", "seq": 1}, [], "'v'"),
        ({"v": 1, "op": "ping"}, [], "seq"),
    ]:
        with pytest.raises(RemoteError) as e:
            await client.send(srv.url, PROBE_KIND, header, bufs)
        assert e.value.status == 400 and why in e.value.reason
    assert (await client.send(srv.url, PROBE_KIND, {"v": 1, "op": "bulk"}, [b"y" * 100000]))[0]["nbytes"] == 100000


def test_link_measurements_from_the_network_are_validated():
    good = LinkMeasurement("b", "ok", 40.0, 100.0, "", 1 << 20, 0.8).to_dict()
    assert LinkMeasurement.from_dict(good).ok
    for change in ({"status": "great"}, {"rtt_ms": -1.0}, {"mbps": float("nan")}, {"status": "ok", "mbps": None},
                   {"dst": ""}, {"error": "x" * 600}, {"seconds": -1}, {"bulk_bytes": 1.5}, {"spam": 1}, {"version": 7}):
        with pytest.raises((ValueError, TypeError)):
            LinkMeasurement.from_dict({**good, **change})
    assert LinkMeasurement.from_dict({**good, "status": "unknown", "mbps": None}).status == "unknown"


# ---- which pairs to probe ----------------------------------------------------------------------------


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


# ---- passive estimate ----------------------------------------------------------------------------------


def detection_time(est_at, drop_t, pre, factor=0.2):
    """Seconds after ``drop_t`` until the estimate first falls to ``factor`` × ``pre``."""
    for t, e in est_at:
        if t >= drop_t and e <= factor * pre:
            return t - drop_t
    return None


def test_the_passive_estimate_sees_a_10x_drop_within_5_seconds_fake_clock():
    est = PassiveEstimator(tau_s=1.0)
    seen, t = [], 0.0
    while t < 20.0:  # back-to-back 1 MB transfers; 100 MB/s until t=10, then 10 MB/s
        rate = 100e6 if t < 10.0 else 10e6
        dur = 1e6 / rate
        t += dur
        est.observe("b", 1_000_000, dur, now=t)
        seen.append((t, est.estimate("b", now=t)))
    pre = [e for t, e in seen if t <= 10.0][-1]
    assert pre == pytest.approx(100e6, rel=0.01)
    d = detection_time(seen, 10.0, pre)
    assert d is not None and d < 5.0, d
    print(f"FIGURE passive estimate (fake clock): a 10x drop shows as a 5x lower estimate {d:.2f} s after it")
    assert seen[-1][1] == pytest.approx(10e6, rel=0.05)
    assert est.estimate("b", now=100.0) is None and est.estimate("zzz") is None  # old data expires


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_passive_estimate_is_not_fooled_by_a_fifth_of_transfers_stalling(seed):
    """A busy receiver makes some transfers slow: with every fifth one (at random) 10x slower,
    the estimate stays the link's 100 MB/s, and a real 10x drop still shows within 3 s."""
    import random

    rnd = random.Random(seed)
    est = PassiveEstimator()
    seen, t = [], 0.0
    while t < 20.0:
        rate = 100e6 if t < 10.0 else 10e6
        dur = 1e6 / rate * (10 if rnd.random() < 0.2 else 1)
        t += dur
        est.observe("b", 1_000_000, dur, now=t)
        seen.append((t, est.estimate("b", now=t)))
        t += 0.02  # idle moments between sends: each transfer its own busy period
    steady = [e for t_, e in seen if 3.0 < t_ <= 10.0]
    assert min(steady) == pytest.approx(100e6, rel=0.1)
    d = detection_time(seen, 10.0, 100e6)
    assert d is not None and d < 3.0, d


def test_latency_bound_transfers_give_a_lower_bound_that_shows_a_recovered_link():
    est = PassiveEstimator(tau_s=1.0)
    # degraded: 32 KiB takes 26 ms of bytes after 20 ms of latency: counted
    est.observe("b", 32 << 10, 0.046, latency_s=0.02, now=1.0)
    assert est.estimate("b", now=1.0) == pytest.approx((32 << 10) / 0.026)
    assert est.lower_bound("b", now=1.0) is None
    # restored: 2.6 ms of bytes in 22.6 ms: mostly latency, so not counted, but the link carries
    # at least 32 KiB / (0.2 x 22.6 ms)
    est.observe("b", 32 << 10, 0.0226, latency_s=0.02, now=2.0)
    assert est.estimate("b", now=2.0) == pytest.approx((32 << 10) / 0.026)  # the old sample is all it has
    assert est.lower_bound("b", now=2.0) == pytest.approx((32 << 10) / (0.2 * 0.0226))
    assert est.lower_bound("b", now=6.0) is None  # stale evidence says nothing


async def test_the_passive_estimate_sees_a_trace_drop_on_real_traffic_within_5_seconds(probe_server):
    srv, client = probe_server
    drop_at = 0.8
    sc = star_scenario(trace=[[0, 1.0], [drop_at, 0.1]])  # the wan link: 100 -> 10 Mbit/s
    emu = LinkEmulator(sc, "me")
    link = emu.link_for("peer-wan")
    est = PassiveEstimator(tau_s=1.0, clock=emu.clock)
    rtt_s = LINKS["wan"]["rtt_ms"] / 1e3  # as a probe would have measured it
    seen, pre = [], None
    while emu.clock() - emu.t0 < drop_at + 5.0:
        t = time.perf_counter()
        await client.send(srv.url, PROBE_KIND, {"v": 1, "op": "bulk"}, [bytes(256 << 10)], link=link)
        est.observe("peer-wan", 256 << 10, time.perf_counter() - t, latency_s=rtt_s)
        now = emu.clock() - emu.t0
        e = est.estimate("peer-wan")
        seen.append((now, e))
        if now < drop_at:
            pre = e
        d = detection_time(seen, drop_at, pre, factor=0.25)
        if d is not None:
            break
    assert pre is not None and pre * 8 / 1e6 == pytest.approx(100, rel=0.15)
    assert d is not None and d < 5.0, seen
    print(f"FIGURE passive estimate: {pre * 8 / 1e6:.1f} Mbit/s before the drop, 1/4 of it {d:.2f} s after the drop")


async def test_a_pipelines_estimate_of_an_emulated_link_leaves_out_a_late_answering_receiver():
    """A receiver whose event loop answers 20 ms late (a host's cores busy): the bytes' time through
    an emulated 1 Gbit/s link is what the estimate reads, not the wait for the answer (which read
    LAN links at 54-311 Mbit/s, and merged two regions over their 40 ms WAN: 2026-12-01), for the
    passive estimate and adaptive compression's alike. The same link cut to a tenth still shows."""
    import types

    import torch

    from spantrain_p2p.job.spec import JobSpec
    from spantrain_p2p.pipeline.messages import ACT
    from spantrain_p2p.plan.stagemap import StageMap
    from spantrain_p2p.plan.types import Stage
    from spantrain_p2p.train.transport import PipelineTransport

    async def late(header, buffers):
        await asyncio.sleep(0.02)

    srv = DataPlaneServer("127.0.0.1", 0, lambda: {})
    srv.register(ACT, late)
    await srv.start()
    emu = LinkEmulator(star_scenario(), "me")
    peer = types.SimpleNamespace(peer_id="a", client=DataPlaneClient(), link_to=lambda dst: emu.link_for("peer-metro"),
                                 data_url_of=lambda dst: srv.url)
    rtt = types.SimpleNamespace(rtt_ms=LINKS["metro"]["rtt_ms"])  # as probed
    try:
        figures = []
        for factor in (1.0, 0.1):
            emu.set_factor("peer-metro", factor)
            t = PipelineTransport(peer, {"b": rtt}, PassiveEstimator(), lambda: 0)
            t.start(JobSpec())
            t.begin_epoch(StageMap(1, "j", (Stage(("a",), (0, 2)), Stage(("b",), (2, 4)))), 0)
            t._policy.set_link("b", rtt_s=rtt.rtt_ms / 1e3)  # as ``codec_for`` sets it from the probe
            for mb in range(12):  # 256 KiB each: 2.1 ms through the link, 21 ms at a tenth
                await t.send_to("b", ACT, 1, mb, torch.zeros(64 << 10))
            # the passive estimate, and adaptive compression's own (what it picks codecs by)
            figures.append((t.passive.estimate_mbps("b"), t._policy.bandwidth("b") * 8 / 1e6))
    finally:
        await peer.client.close()
        await srv.stop()
    (full, full_codecs), (cut, cut_codecs) = figures
    print(f"FIGURE passive estimate, receiver 20 ms late: {full:.0f} Mbit/s on a 1000 Mbit/s link, {cut:.0f} at a "
          f"tenth; adaptive compression's {full_codecs:.0f} and {cut_codecs:.0f}")
    assert 500 <= full <= 1100 and 500 <= full_codecs <= 1100, figures  # the 20 ms counted: ~90 Mbit/s
    assert 70 <= cut <= 110 and 70 <= cut_codecs <= 110, figures


async def test_a_peer_with_a_small_message_limit_is_probed_with_what_it_accepts():
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {}, max_message_bytes=1 << 20)
    srv.register(PROBE_KIND, handle_probe)
    await srv.start()
    client = DataPlaneClient()
    try:
        emu = LinkEmulator(star_scenario(), "me")
        m = await probe_link(client, srv.url, "peer-slow", emu, deadline_s=10)  # 20 Mbit/s wants ~1 MiB rounds
        assert m.status == "ok" and m.bulk_bytes < 1 << 20, m
        assert m.mbps == pytest.approx(20, rel=0.15), m
    finally:
        await client.close()
        await srv.stop()


@pytest.mark.parametrize("published,probed,estimate,bound,want", [
    (100, 100, None, None, None),     # no informative traffic: as probed
    (100, 100, 60, None, None),       # noise, or small transfers: not a change
    (100, 100, 10, None, 10),         # a 10x cut
    (100, 100, 10, 120, None),        # ...contradicted by a fresh latency-bound transfer
    (10, 100, 12, None, None),        # still cut
    (10, 100, 10, 52, 100),           # recovered: a latency-bound transfer shows >= 52 Mbit/s
    (10, 100, 30, None, 30),          # partly recovered
    (100, 100, 400, None, None),      # faster than probed: left alone
])
def test_only_sizeable_link_changes_are_published(published, probed, estimate, bound, want):
    assert link_update(published, probed, estimate, bound) == want


def test_a_link_whose_figure_goes_down_and_up_is_held_back_longer_each_time():
    d = FlapDamper(5.0, max_hold_s=40.0)
    # the loopback run's sequence (11:30 UTC): 3043 -> 1171 -> 562 -> 1321 -> 414 -> 1408 ... Mbit/s
    assert d.allow("p3", 3043, 1171, now=0.0)
    assert d.allow("p3", 1171, 562, now=3.0)  # further down: at once
    assert not d.allow("p3", 562, 1321, now=6.0)  # back up 3 s after the last change: held
    assert d.allow("p3", 562, 1321, now=8.0)  # 5 s after it: let through, the hold doubles
    assert d.hold_s("p3") == 10.0
    assert not d.allow("p3", 1321, 414, now=17.0)  # down again within 10 s: held
    assert d.allow("p3", 1321, 414, now=18.0)
    assert d.hold_s("p3") == 20.0
    assert d.allow("p3", 414, 200, now=19.0)  # the same way: at once, the hold kept
    assert not d.allow("p3", 200, 900, now=38.0)
    assert d.allow("p3", 200, 900, now=39.0) and d.hold_s("p3") == 40.0
    assert d.allow("p3", 900, 300, now=80.0) and d.hold_s("p3") == 40.0  # capped
    assert d.allow("p3", 300, 3043, now=80.0 + 4 * 40.0)  # left alone for four holds: back at the base
    assert d.hold_s("p3") == 5.0
    assert d.allow("p1", 100, 10, now=0.0) and not d.allow("p1", 10, 10, now=100.0)  # (per link; no change)


def test_a_busy_receiver_now_and_then_does_not_look_like_a_slower_link():
    est = PassiveEstimator(tau_s=1.0)
    t = 0.0
    for i in range(200):  # 32 KiB at 1 Gbit/s (0.26 ms), but one transfer in five waits 20 ms on a busy loop
        dur = 0.02 if i % 5 == 0 else 0.00026
        t += 0.01
        est.observe("b", 32 << 10, dur, now=t)
    assert est.estimate("b", now=t) * 8 / 1e6 == pytest.approx(1000, rel=0.05)


def sparse_link_readings(min_samples: int, drop_at: float = float("inf")) -> list[tuple[float, float]]:
    """(time, Mbit/s) of the estimate of a link that replicas use once a step: one 200 KB gradient
    part every 0.5 s over 1 Gbit/s (1.6 ms of bytes), and in every six, three in a row 3-7 ms late
    (a sender's event loop on a busy host's cores: cee-3region's replicas read 2.7-8.5 ms for
    theirs); the link cut to a tenth at ``drop_at``."""
    est = PassiveEstimator(min_samples=min_samples)
    n, out, t = 200_212, [], 0.0
    for i in range(240):
        t += 0.5
        rate = 125e6 if t < drop_at else 12.5e6
        late = (0.003, 0.007, 0.004)[i % 6 - 3] if i % 6 >= 3 else 0.0
        est.observe("b", n, n / rate + late, now=t)
        out.append((t, est.estimate_mbps("b", now=t)))
    return out


def test_a_sparse_link_is_not_read_from_its_last_late_transfers_and_a_drop_still_shows():
    # weighed by age alone (tau_s), the last few decide, and three late ones read under half
    assert min(e for _, e in sparse_link_readings(min_samples=1)) < 500
    steady = min(e for _, e in sparse_link_readings(min_samples=6))
    assert steady > 900
    seen = sparse_link_readings(min_samples=6, drop_at=60.0)
    d = detection_time(seen, 60.0, 1000.0, factor=0.5)
    assert d is not None and d < 5.0, d
    assert seen[-1][1] == pytest.approx(100, rel=0.1)
    print(f"FIGURE passive estimate of a sparse link (fake clock): lowest {steady:.0f} Mbit/s of 1000 with "
          f"late transfers; a 10x drop under half {d:.1f} s after it")


def test_a_peers_estimate_does_not_time_a_message_too_small_to_say_anything_of_its_link():
    """A replica's 264-byte loss, the first message on its link in an epoch, took 0.16 ms (the send's
    fixed cost): timed, it read a 1 Gbit/s link at 13 Mbit/s, and was published as a drop."""
    from spantrain_p2p.train.measuring import Measuring

    est = Measuring(None, lambda *a: None).passive
    est.observe("b", 264, 0.00016, now=1.0)
    assert est.estimate("b", now=1.0) is None
    for t in (1.5, 2.0, 2.5):  # trace-drop's activations, at 1 Gbit/s (three: ``PASSIVE_MIN_COUNT``)
        est.observe("b", 32 << 10, (32 << 10) / 125e6, now=t)
    assert est.estimate_mbps("b", now=2.5) == pytest.approx(1000, rel=0.01)


def test_a_peers_estimate_does_not_read_a_link_from_its_first_transfer_alone():
    """A replica link's first gradient part of an epoch took 4.97 ms for 200 KB on 1 Gbit/s (1.6 ms of
    bytes): the only transfer on that link, it read 322 Mbit/s, was published as a drop a second into
    training, and put back 7 s later (cee-3region, 2026-12-02); the next ones took 0.4-1.8 ms."""
    from spantrain_p2p.train.measuring import Measuring

    est = Measuring(None, lambda *a: None).passive
    for t, ms in ((1.0, 4.97), (1.55, 1.40), (2.09, 1.28)):  # the logged run's first three, 0.5 s apart
        est.observe("b", 200212, ms / 1e3, now=t)
        if t < 2.0:
            assert est.estimate("b", now=t) is None  # one or two transfers: no estimate yet
    assert est.estimate_mbps("b", now=2.09) > 500  # three: the link, not its first send
    old = PassiveEstimator(min_bytes=16 << 10)  # as a peer's was: the first transfer alone
    old.observe("b", 200212, 4.97e-3, now=1.0)
    assert old.estimate_mbps("b", now=1.0) < 500


def test_a_burst_of_sends_queued_on_one_link_is_not_taken_for_a_slow_link():
    est = PassiveEstimator(tau_s=1.0)
    # 8 activations of 32 KiB sent at once over 100 Mbit/s with 20 ms one-way latency: the i-th
    # completes at 20 ms + i x 2.6 ms; timed from its own start it would look 8x slower
    per = (32 << 10) / 12.5e6
    for i in range(1, 9):
        est.observe("b", 32 << 10, 0.02 + i * per, latency_s=0.02, now=1.0 + 0.02 + i * per)
    assert est.estimate("b", now=1.1) * 8 / 1e6 == pytest.approx(100, rel=0.05)


def test_interleaved_sends_that_finish_together_are_not_taken_for_a_fast_link():
    est = PassiveEstimator(tau_s=1.0)
    # what the live trace-drop run showed after a cut to 10 Mbit/s (40 ms RTT): four 256 KiB
    # activations started within 0.26 s of each other share the link, so the last two complete
    # 20 ms apart; timed from the previous completion the fourth looked like 100 Mbit/s
    n, rate, lat = 262400, 10e6 / 8, 0.04
    t = 0.0
    for burst in range(6):
        t0 = t
        starts = [t0, t0 + 0.08, t0 + 0.23, t0 + 0.26]
        ends = [t0 + lat + 0.42, t0 + lat + 0.63, t0 + lat + 0.82, t0 + lat + 4 * n / rate]
        for s, e in zip(starts, ends):
            est.observe("b", n, e - s, latency_s=lat, now=e)
        t = ends[-1] + 1.0  # the stage computes before its next burst
    assert est.estimate("b", now=t) * 8 / 1e6 == pytest.approx(10, rel=0.1)


def test_a_drop_in_the_middle_of_a_long_stream_shows():
    est = PassiveEstimator(tau_s=1.0)
    # two sends always in flight (each starts before the previous completes), 1 MB each:
    # 100 MB/s until t=10, then 10 MB/s; never an idle moment on the link
    t, seen = 0.0, []
    while t < 20.0:
        rate = 100e6 if t < 10.0 else 10e6
        t += 1e6 / rate
        est.observe("b", 1_000_000, 2 * 1e6 / rate, now=t)
        seen.append((t, est.estimate("b", now=t)))
    pre = [e for t_, e in seen if t_ <= 10.0][-1]
    assert pre == pytest.approx(100e6, rel=0.05)
    d = detection_time(seen, 10.0, pre)
    assert d is not None and d < 6.0, d
    assert seen[-1][1] == pytest.approx(10e6, rel=0.1)
