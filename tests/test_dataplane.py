import aiohttp
import pytest

from spantrain_p2p.net import framing
from spantrain_p2p.net.dataplane import DataPlaneClient, DataPlaneServer, RemoteError


@pytest.fixture
async def server():
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {"peer_id": "me", "state": "idle"}, max_message_bytes=1 << 16)

    async def echo(header, buffers):
        return {"echo": header["x"]}, [bytes(b)[::-1] for b in buffers]

    async def sink(header, buffers):
        return None

    srv.register("echo", echo)
    srv.register("sink", sink)
    await srv.start()
    yield srv
    await srv.stop()


async def test_status_reports_the_peer(server):
    client = DataPlaneClient()
    try:
        assert await client.status(server.url) == {"peer_id": "me", "state": "idle"}
    finally:
        await client.close()


async def test_a_message_round_trips_through_its_handler(server):
    client = DataPlaneClient()
    try:
        header, bufs = await client.send(server.url, "echo", {"x": 7}, [b"abc", b"12"])
        assert header == {"echo": 7} and [bytes(b) for b in bufs] == [b"cba", b"21"]
        assert await client.send(server.url, "sink", {}, [b"z"]) is None
    finally:
        await client.close()


async def test_a_message_over_the_limit_gets_413_with_the_reason(server):
    client = DataPlaneClient()
    try:
        with pytest.raises(RemoteError) as e:
            await client.send(server.url, "echo", {"x": 1}, [b"x" * (1 << 17)])
        assert e.value.status == 413 and "limit" in e.value.reason
    finally:
        await client.close()


async def test_malformed_frames_and_unknown_kinds_are_refused(server):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.url}/msg/echo", data=b"garbage!") as r:
            assert r.status == 400 and "magic" in await r.text()
        async with s.post(f"{server.url}/msg/nope", data=b"") as r:
            assert r.status == 404 and "nope" in await r.text()
        chunked = (c for c in [b"x" * 40000, b"y" * 40000])  # no Content-Length: the read limit still holds

        async def gen():
            for c in chunked:
                yield c

        async with s.post(f"{server.url}/msg/echo", data=gen()) as r:
            assert r.status == 413
    # the server is still fine afterwards
    client = DataPlaneClient()
    try:
        assert (await client.send(server.url, "echo", {"x": 2}, [b"ok"]))[0] == {"echo": 2}
    finally:
        await client.close()


async def test_a_handler_that_rejects_the_frame_gives_400_with_its_reason(server):
    async def strict(header, buffers):
        framing.check_fields(header, {"step": int})
        return None

    server.register("strict", strict)
    client = DataPlaneClient()
    try:
        with pytest.raises(RemoteError) as e:
            await client.send(server.url, "strict", {"step": "one"})
        assert e.value.status == 400 and "'step'" in e.value.reason
    finally:
        await client.close()


async def test_a_busy_port_gives_a_clear_error(server):
    other = DataPlaneServer("127.0.0.1", server.port, dict)
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        await other.start()


def test_the_dataplane_benchmark_reports_both_raw_baselines_and_the_ratio_to_the_faster():
    # The figure itself comes from scripts/dataplane_bench.sh on an idle machine; this pins down that
    # the script runs end to end and compares against the faster of asyncio's two raw readers.
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "spantrain_p2p.net.bench", "--mib", "1", "--reps", "2", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["raw_streamreader_mib_s"] > 0 and d["raw_recv_into_mib_s"] > 0 and d["dataplane_mib_s"] > 0
    assert d["raw_mib_s"] == max(d["raw_streamreader_mib_s"], d["raw_recv_into_mib_s"])
    assert d["ratio"] == pytest.approx(d["dataplane_mib_s"] / d["raw_mib_s"], abs=2e-3)
