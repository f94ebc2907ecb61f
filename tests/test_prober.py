import asyncio
import dataclasses
import socket
import statistics
import time

import pytest

from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer, RemoteError
from spantrain_p2p.net.emulator import LinkEmulator
from spantrain_p2p.net.passive import PassiveEstimator
from spantrain_p2p.net.ping import paired_rtt, ping_link, ping_links
from spantrain_p2p.net.probe_messages import PROBE_KIND, handle_probe
from spantrain_p2p.net.prober import LinkMeasurement, probe_link
from spantrain_p2p.scenario import parse
from tests.test_passive_readings import detection_time

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


# ---- the passive estimate on real traffic ------------------------------------------------------------


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
    await _estimates_of_an_emulated_link(DataPlaneClient())


async def test_a_pipelines_estimate_of_an_emulated_link_holds_when_the_sender_is_held_before_it_sends():
    """The sender's loop held 1 ms between a message's exchange beginning and its connection being
    ready (a busy host preempting it there): the link dates the bytes' start back over that time, and
    the estimate must too. Timed from the connection instead, 0.3 ms read the 1 Gbit/s link at 1,231
    Mbit/s, 1 ms at 20,544 (the suite's failures of 2026-12-02 14:47-15:17, at 1,120-1,213)."""

    class Held(DataPlaneClient):
        async def _connection(self, addr, want):
            conn = await super()._connection(addr, want)
            time.sleep(0.001)  # the whole loop held, as preemption holds it
            return conn

    await _estimates_of_an_emulated_link(Held())


async def _estimates_of_an_emulated_link(client: DataPlaneClient) -> None:
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
    peer = types.SimpleNamespace(peer_id="a", client=client, link_to=lambda dst: emu.link_for("peer-metro"),
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
