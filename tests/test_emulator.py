import asyncio
import statistics
import time

import pytest

from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer
from spantrain_p2p.net.emulator import LinkEmulator, TokenBucket, trace_factor
from spantrain_p2p.scenario import parse

pytestmark = pytest.mark.serial  # measures times or rates: run alone (scripts/test.sh)


def scenario(links: dict, peers: list[tuple[str, str]], region_links=(), uplinks=None, default_link=""):
    """A scenario of the given link classes; each region's inner link is the class of the same name
    if there is one, else the first class."""
    first = next(iter(links))
    regions = sorted({r for _, r in peers})
    return parse({
        "name": "t", "default_link": default_link,
        "link_classes": links,
        "device_classes": {"d": {"tflops": 1.0, "memory_gb": 1}},
        "regions": {r: {"link": r if r in links else first} for r in regions},
        "region_links": [dict(r) for r in region_links],
        "peers": [{"name": n, "region": r, "device": "d", **({"uplink_mbps": uplinks[n]} if uplinks and n in uplinks else {})}
                  for n, r in peers],
    })


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    async def sleep(self, dt: float) -> None:
        self.t += max(0.0, dt)


# ---- pure logic, fake clock ----------------------------------------------------------------------


def test_token_bucket_paces_bytes_at_its_rate_and_saves_no_credit_when_idle():
    b = TokenBucket(rate=1000.0)
    assert b.reserve(500, now=0.0) == pytest.approx(0.5)
    assert b.reserve(500, now=0.0) == pytest.approx(1.0)  # queued behind the first
    assert b.reserve(100, now=0.7) == pytest.approx(1.1)
    assert b.reserve(1000, now=5.0) == pytest.approx(6.0)  # idle time is not saved up


def test_token_bucket_with_a_burst_lets_an_idle_bucket_send_its_capacity_at_once():
    b = TokenBucket(rate=100.0, burst=1000.0)
    assert b.reserve(1000, now=10.0) == pytest.approx(10.0)  # a full bucket: no wait
    assert b.reserve(100, now=10.0) == pytest.approx(11.0)  # then the rate
    assert b.reserve(500, now=12.0) == pytest.approx(16.0)  # 1 s idle saved 100 bytes; 400 more take 4 s
    assert b.reserve(600, now=12.0) == pytest.approx(22.0)


def test_token_bucket_rate_change_applies_to_new_reservations_only():
    b = TokenBucket(rate=1000.0)
    assert b.reserve(1000, now=0.0) == pytest.approx(1.0)
    b.set_rate(100.0)
    assert b.reserve(100, now=0.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        b.set_rate(0.0)


def test_a_late_flow_catches_up_with_its_credit_but_never_before_reserved_bytes():
    b = TokenBucket(rate=1000.0)
    end = b.reserve(100, now=0.0)  # 0.1
    # woken 30 ms late: the next slice may start where it should have (0.1), not at 0.13
    assert b.take(b.earliest(0.13, credit_s=0.03), 100) == pytest.approx(end + 0.1)


def test_trace_factor_is_a_step_function_of_time():
    tr = ((0.0, 1.0), (10.0, 0.1), (30.0, 1.0))
    assert [trace_factor(tr, t) for t in (-1, 0, 9.99, 10, 29, 30, 100)] == [1.0, 1.0, 1.0, 0.1, 0.1, 1.0, 1.0]
    assert trace_factor((), 5.0) == 1.0


async def test_a_transfer_takes_serialization_plus_half_the_rtt_on_a_fake_clock():
    clk = FakeClock()
    sc = scenario({"wan": {"rtt_ms": 100, "mbps": 8}}, [("a", "x"), ("b", "y")], region_links=[{"regions": ["x", "y"], "link": "wan"}])
    emu = LinkEmulator(sc, "a", clk, sleep=clk.sleep, spin_s=0)
    await emu.transmit("b", 1_000_000)  # 1 MB at 1 MB/s
    assert clk.t == pytest.approx(1.0 + 0.05)
    t = clk.t
    await emu.after_reply("b", 0)  # an empty reply: only the delay back
    assert clk.t - t == pytest.approx(0.05)
    assert emu.stats()["b"] == {"link": "wan", "messages": 1, "bytes_sent": 1_000_000, "replies": 1, "bytes_back": 0}


async def test_a_bandwidth_trace_slows_the_link_from_its_step_on():
    clk = FakeClock()
    sc = scenario({"wan": {"rtt_ms": 10, "mbps": 8}}, [("a", "x"), ("b", "y")],
                  region_links=[{"regions": ["x", "y"], "link": "wan", "trace": [[0, 1.0], [10, 0.1], [30, 1.0]]}])
    emu = LinkEmulator(sc, "a", clk, sleep=clk.sleep, spin_s=0)
    link = emu.link_for("b")
    assert link.bandwidth(5.0) == pytest.approx(1e6) and link.bandwidth(10.0) == pytest.approx(1e5)
    clk.t = 10.0
    await emu.transmit("b", 100_000)  # 100 kB at 100 kB/s
    assert clk.t - 10.0 == pytest.approx(1.0 + 0.005)
    clk.t = 40.0
    await emu.transmit("b", 100_000)
    assert clk.t - 40.0 == pytest.approx(0.1 + 0.005)


async def test_set_factor_changes_links_by_peer_or_by_region_pair():
    clk = FakeClock()
    sc = scenario({"lan": {"rtt_ms": 1, "mbps": 80}, "wan": {"rtt_ms": 40, "mbps": 8}},
                  [("a", "lan"), ("b", "lan"), ("c", "far"), ("d", "far")], region_links=[{"regions": ["lan", "far"], "link": "wan"}])
    emu = LinkEmulator(sc, "a", clk, sleep=clk.sleep, spin_s=0)
    assert sorted(emu.set_factor(("far", "lan"), 0.5)) == ["c", "d"]
    assert emu.link_for("c").bandwidth() == pytest.approx(0.5e6) and emu.link_for("b").bandwidth() == pytest.approx(10e6)
    assert emu.set_factor("b", 0.25) == ["b"] and emu.link_for("b").bandwidth() == pytest.approx(2.5e6)
    assert emu.set_factor(("x", "y"), 2.0) == []
    with pytest.raises(ValueError):
        emu.set_factor("b", -1)


def test_jitter_is_bounded_seeded_and_per_link():
    sc = scenario({"wan": {"rtt_ms": 40, "mbps": 100, "jitter_ms": 5}}, [("a", "x"), ("b", "y"), ("c", "y")],
                  region_links=[{"regions": ["x", "y"], "link": "wan"}])
    first = LinkEmulator(sc, "a", seed=7).link_for("b").one_way_delay()
    link = LinkEmulator(sc, "a", seed=7).link_for("b")
    delays = [link.one_way_delay() for _ in range(500)]
    assert delays[0] == first
    assert all(0.015 <= d <= 0.025 for d in delays) and statistics.pstdev(delays) > 0.001
    other = LinkEmulator(sc, "a", seed=7).link_for("c")
    assert [other.one_way_delay() for _ in range(5)] != delays[:5]


async def test_jitter_never_reorders_messages_sent_one_after_another():
    sc = scenario({"wan": {"rtt_ms": 20, "mbps": 1000, "jitter_ms": 9}}, [("a", "x"), ("b", "y")],
                  region_links=[{"regions": ["x", "y"], "link": "wan"}])
    emu = LinkEmulator(sc, "a")
    done = []

    async def send(i):
        await emu.transmit("b", 100)
        done.append(i)

    tasks = []
    for i in range(20):
        tasks.append(asyncio.create_task(send(i)))
        await asyncio.sleep(0.0005)
    await asyncio.gather(*tasks)
    assert done == list(range(20))


def test_unknown_peers_are_refused():
    sc = scenario({"lan": {"rtt_ms": 1, "mbps": 100}}, [("a", "lan"), ("b", "lan")])
    with pytest.raises(ValueError):
        LinkEmulator(sc, "nobody")
    emu = LinkEmulator(sc, "a")
    with pytest.raises(ValueError):
        emu.link_for("zzz")
    with pytest.raises(ValueError):
        emu.link_for("a")


# ---- real loopback traffic through the data plane -------------------------------------------------


@pytest.fixture
async def server():
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {})

    async def ack(header, buffers):
        return {"n": sum(b.nbytes for b in buffers)}, []

    srv.register("ack", ack)
    await srv.start()
    client = DataPlaneClient()
    yield srv, client
    await client.close()
    await srv.stop()


def wan_scenario(rtt_ms=40, mbps=100, jitter_ms=0.0, uplinks=None):
    return scenario({"lan": {"rtt_ms": 0.5, "mbps": 10000}, "wan": {"rtt_ms": rtt_ms, "mbps": mbps, "jitter_ms": jitter_ms}},
                    [("a", "lan"), ("b", "far"), ("c", "far")], region_links=[{"regions": ["lan", "far"], "link": "wan"}],
                    uplinks=uplinks)


async def ping_s(client, link, url) -> float:
    t = time.perf_counter()
    await client.send(url, "ack", {}, [b"x" * 16], link=link)
    return time.perf_counter() - t


async def test_a_charge_scales_the_tensor_bytes_not_the_frame_header(server):
    """A proxy's 1 kB standing for a workload's 1 MB: the link carries 1 MB plus the header once (a
    header scaled by the charge made small proxies' messages 16 % dearer than the workload's)."""
    from spantrain_p2p.net import framing

    srv, client = server
    link = LinkEmulator(wan_scenario(mbps=10000), "a").link_for("b")
    header = {"job": "j" * 40, "shape": [1, 32, 64]}
    head = memoryview(framing.encode(header, [bytes(1000)])[0]).nbytes
    before = link.stats.bytes_sent
    await client.send(srv.url, "ack", header, [bytes(1000)], link=link, charge=1000.0)
    assert link.stats.bytes_sent - before == pytest.approx(1000 * 1000 + head, abs=2)


async def test_a_link_that_could_not_slow_a_message_passes_it_straight_and_still_counts_it(server):
    """A link at least as fast as loopback, with a delay under a loop turn, no trace, factor or
    uplink cap, is not paced (the side-by-side's 100 Gbit/s, 0.01 ms links: ~60 us of a message's
    CPU that delayed nothing); its bytes are counted all the same. A slower, farther, traced,
    rescaled or workload-charged link is paced as before."""
    srv, client = server
    fast = scenario({"fast": {"rtt_ms": 0.01, "mbps": 100000}}, [("a", "fast"), ("b", "fast")])
    link = LinkEmulator(fast, "a").link_for("b")
    assert link.transparent() and not link.transparent(charge=100.0)
    reply = await client.send(srv.url, "ack", {}, [bytes(5000)], link=link)
    assert reply[0]["n"] == 5000 and link.stats.messages == 1 and link.stats.replies == 1
    assert 5000 < link.stats.bytes_sent < 5200 and link.stats.bytes_back > 0
    link.factor = 0.5
    assert not link.transparent()
    assert not LinkEmulator(wan_scenario(mbps=100000), "a").link_for("b").transparent()  # 40 ms away
    lan = scenario({"lan": {"rtt_ms": 0.01, "mbps": 10000}}, [("a", "lan"), ("b", "lan")])
    assert not LinkEmulator(lan, "a").link_for("b").transparent()  # 1.25 GB/s: slower than loopback
    capped = scenario({"fast": {"rtt_ms": 0.01, "mbps": 100000}}, [("a", "fast"), ("b", "fast")], uplinks={"a": 50})
    assert not LinkEmulator(capped, "a").link_for("b").transparent()


async def test_a_small_ping_over_a_40ms_link_measures_40ms(server):
    srv, client = server
    link = LinkEmulator(wan_scenario(jitter_ms=2), "a").link_for("b")
    await ping_s(client, link, srv.url)  # connection set-up
    rtts = [await ping_s(client, link, srv.url) for _ in range(7)]
    rtt = statistics.median(rtts)
    print(f"FIGURE emulator: 40 ms RTT link, small ping median {rtt * 1e3:.2f} ms ({rtt / 0.040 - 1:+.1%})")
    assert rtt == pytest.approx(0.040, rel=0.10), rtts


async def test_a_bulk_transfer_over_a_100_mbit_link_measures_100_mbit_within_5_percent(server):
    srv, client = server
    link = LinkEmulator(wan_scenario(), "a").link_for("b")
    await ping_s(client, link, srv.url)
    rtt = statistics.median([await ping_s(client, link, srv.url) for _ in range(3)])
    n = 4 << 20
    t = time.perf_counter()
    header, _ = await client.send(srv.url, "ack", {}, [bytes(n)], link=link)
    dt = time.perf_counter() - t
    assert header == {"n": n}
    mbps = n * 8 / (dt - rtt) / 1e6
    print(f"FIGURE emulator: 100 Mbit/s link, 4 MiB bulk transfer {mbps:.2f} Mbit/s ({mbps / 100 - 1:+.1%})")
    assert mbps == pytest.approx(100, rel=0.05), (mbps, dt, rtt)


async def test_concurrent_transfers_share_the_link_fairly(server):
    srv, client = server
    link = LinkEmulator(wan_scenario(rtt_ms=2, mbps=80), "a").link_for("b")  # 10 MB/s
    await ping_s(client, link, srv.url)
    t = time.perf_counter()
    ends = {}

    async def send(name, n):
        await client.send(srv.url, "ack", {}, [bytes(n)], link=link)
        ends[name] = time.perf_counter() - t

    bulk = asyncio.create_task(send("bulk", 2_000_000))  # 0.2 s alone
    await asyncio.sleep(0.02)
    await send("small", 1000)  # not queued behind the bulk transfer
    await bulk
    # it ends long before the bulk one (queued behind it, it would end after it); a wall-clock bound
    # (0.06 s) failed once in a suite's serial half, 0.17 s, on a box just left by the parallel half
    assert ends["small"] < 0.75 * ends["bulk"], ends
    assert ends["bulk"] == pytest.approx(0.2 + 0.002, rel=0.1)
    # two equal transfers at once: both end at twice the time of one
    ends.clear()
    t = time.perf_counter()
    await asyncio.gather(send("x", 1_000_000), send("y", 1_000_000))
    assert ends["x"] == pytest.approx(0.2, rel=0.1) and ends["y"] == pytest.approx(0.2, rel=0.1), ends


async def test_the_uplink_cap_is_shared_by_all_outgoing_links(server):
    srv, client = server
    emu = LinkEmulator(wan_scenario(rtt_ms=2, mbps=800, uplinks={"a": 80}), "a")  # 100 MB/s links, 10 MB/s uplink
    for dst in ("b", "c"):
        await ping_s(client, emu.link_for(dst), srv.url)
    t = time.perf_counter()
    await asyncio.gather(*(client.send(srv.url, "ack", {}, [bytes(1_000_000)], link=emu.link_for(d)) for d in ("b", "c")))
    assert time.perf_counter() - t == pytest.approx(0.2, rel=0.1)


async def test_a_partitioned_link_holds_traffic_until_the_deadline_or_until_it_heals(server):
    srv, client = server
    emu = LinkEmulator(wan_scenario(rtt_ms=2, mbps=80), "a")
    link = emu.link_for("b")
    await ping_s(client, link, srv.url)
    emu.set_factor("b", 0)
    t = time.perf_counter()
    with pytest.raises(asyncio.TimeoutError):
        await client.send(srv.url, "ack", {}, [b"x"], timeout=0.3, link=link)
    assert time.perf_counter() - t < 0.5
    asyncio.get_running_loop().call_later(0.2, emu.set_factor, "b", 1.0)
    t = time.perf_counter()
    await client.send(srv.url, "ack", {}, [b"x"], timeout=5, link=link)
    assert 0.2 <= time.perf_counter() - t < 0.4
