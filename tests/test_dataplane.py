import asyncio

import aiohttp
import pytest

from spantrain_p2p.net import framing
from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import ANSWER, REQUEST, REQUEST_MAGIC, DataPlaneServer, RemoteError

# No test here measures a time or a rate (the benchmark's test asserts only that it runs end to end,
# its figures come from scripts/dataplane_bench.sh on an idle machine): they run with the others.


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
    await _still_echoes(server, 2)  # the server is still fine afterwards


async def _still_echoes(server, x: int) -> None:
    """A new client's message still gets its answer."""
    client = DataPlaneClient()
    try:
        assert (await client.send(server.url, "echo", {"x": x}, [b"ok"]))[0] == {"echo": x}
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


async def _framed(server, kind: bytes, length: int, body: bytes = b"", kind_len=None):
    """Sends one framed-TCP request by hand; (status, reason, reader, writer)."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(REQUEST.pack(REQUEST_MAGIC, len(kind) if kind_len is None else kind_len, length) + kind + body)
    await writer.drain()
    magic, status, n = ANSWER.unpack(await asyncio.wait_for(reader.readexactly(ANSWER.size), 5))
    return status, (await reader.readexactly(n)).decode(), reader, writer


async def test_framed_requests_refused_up_front_are_answered_before_their_body_and_the_connection_goes_on(server):
    frame = b"".join(bytes(c) for c in framing.encode({"x": 5}, [b"abc"]))
    # over the limit: answered at once, before any of the 1 MiB it announces has been sent
    status, reason, reader, writer = await _framed(server, b"echo", 1 << 20)
    assert status == 413 and "limit" in reason
    writer.write(b"z" * (1 << 20))  # the body still comes; the server drops it
    # unknown kind: 404, its body dropped too
    writer.write(REQUEST.pack(REQUEST_MAGIC, 4, 3) + b"nope" + b"xyz")
    # then a good message on the same connection
    writer.write(REQUEST.pack(REQUEST_MAGIC, 4, len(frame)) + b"echo" + frame)
    answers = []
    for _ in range(2):
        magic, st, n = ANSWER.unpack(await asyncio.wait_for(reader.readexactly(ANSWER.size), 5))
        answers.append((st, await reader.readexactly(n)))
    assert answers[0][0] == 404 and b"nope" in answers[0][1]
    assert answers[1][0] == 200 and framing.decode(answers[1][1])[0] == {"echo": 5}
    writer.close()


async def test_a_framed_connection_that_breaks_the_protocol_is_answered_400_and_closed(server):
    for kind, kind_len in ((b"", 0), (b"\xff\xfe", None)):
        status, reason, reader, writer = await _framed(server, kind, 3, b"abc", kind_len=kind_len)
        assert status == 400, reason
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
        writer.close()
    # garbage inside a frame of a known kind: 400, and the connection stays usable
    status, reason, reader, writer = await _framed(server, b"echo", 8, b"garbage!")
    assert status == 400 and "magic" in reason
    writer.close()
    await _still_echoes(server, 3)


async def test_bytes_that_are_not_http_get_400_and_one_line_in_the_log_not_a_traceback(server, caplog):
    """A fuzzer's bytes on the port (28 aiohttp tracebacks, each with ~2 KB of the escaped bytes, in
    one suite run's logs): answered 400, logged as one warning without the bytes."""
    junk = b"GET /status HTTP/1.1\r\n\x85\xce\x10\x05 \x95I\xbc\xfa" + bytes(range(256)) * 4 + b"\r\n\r\n"
    with caplog.at_level("DEBUG", logger="spantrain_p2p.net.dataplane"):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(junk)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert answer.split(b" ", 2)[1] == b"400", answer[:80]
    records = [r for r in caplog.records if r.name.startswith("spantrain_p2p.net.dataplane")]
    assert len(records) == 1, [r.getMessage() for r in records]
    r = records[0]
    assert r.levelname == "WARNING" and r.exc_info is None, (r.levelname, r.exc_info)
    assert r.getMessage().startswith("refused a malformed HTTP request from 127.0.0.1 (400): ") and len(r.getMessage()) < 200, \
        r.getMessage()
    async with aiohttp.ClientSession() as s:  # the server goes on
        async with s.get(f"http://127.0.0.1:{server.port}/status") as resp:
            assert resp.status == 200


async def test_a_handler_that_fails_gives_500_with_its_reason_and_the_server_goes_on(server):
    async def broken(header, buffers):
        raise KeyError("oops")

    server.register("broken", broken)
    client = DataPlaneClient()
    try:
        with pytest.raises(RemoteError) as e:
            await client.send(server.url, "broken", {})
        assert e.value.status == 500 and "KeyError" in e.value.reason
        assert (await client.send(server.url, "echo", {"x": 4}, [b"ok"]))[0] == {"echo": 4}
    finally:
        await client.close()


async def test_an_inline_handler_runs_where_its_frame_comes_in_and_is_answered_like_any_other(server):
    """``register(kind, fn, inline=True)``: a plain function, run as the frame comes in (no task of
    its own, and the connection is not paused for it: what a pipeline's tensors take); its reply and
    its refusals are answered as an async handler's are, and the connection goes on after each."""
    from spantrain_p2p.net.dataplane import Retry

    seen = []

    def now(header, buffers):
        seen.append(asyncio.current_task())  # None: not inside a task
        what = header.get("do")
        if what == "frame":
            raise framing.FrameError("not that tensor")
        if what == "retry":
            raise Retry("no stage map yet")
        if what == "bug":
            raise KeyError("oops")
        return ({"n": len(buffers)}, [bytes(buffers[0])[::-1]]) if buffers else None

    server.register("now", now, inline=True)
    client = DataPlaneClient()
    try:
        for i in range(3):  # one connection, message after message
            header, bufs = await client.send(server.url, "now", {"i": i}, [b"ab" * (i + 1)])
            assert header == {"n": 1} and bytes(bufs[0]) == b"ba" * (i + 1)
        assert await client.send(server.url, "now", {}) is None
        for what, status, reason in (("frame", 400, "not that tensor"), ("retry", 503, "no stage map"),
                                     ("bug", 500, "KeyError")):
            with pytest.raises(RemoteError) as e:
                await client.send(server.url, "now", {"do": what})
            assert e.value.status == status and reason in e.value.reason
        assert (await client.send(server.url, "now", {}, [b"xy"]))[1][0] == b"yx"
        assert len(server._framed) == 1 and seen and all(t is None for t in seen)
    finally:
        await client.close()


async def test_an_inline_handler_knows_when_its_frame_began_to_come_in_and_when_it_was_whole(server):
    """``ARRIVED``: (first byte, whole frame), unix, for the frame an inline handler is given (a
    pipeline's tensor times its way in by it); nothing outside a handler."""
    import time

    from spantrain_p2p.net.connections import ARRIVED

    seen = []
    server.register("now", lambda header, buffers: seen.append(ARRIVED.get()), inline=True)
    client = DataPlaneClient()
    try:
        for _ in range(2):  # the first request of a connection, and one after it
            t0 = time.time()
            await client.send(server.url, "now", {}, [bytes(40_000)])
            first, whole = seen[-1]
            assert t0 <= first <= whole <= time.time()
        assert ARRIVED.get() is None
    finally:
        await client.close()


async def test_an_inline_kind_cuts_a_client_that_leaves_its_answers_unread_and_takes_no_async_handler():
    """A client waits for each answer before its next request; one that sends on while over
    ``MAX_UNSENT_BYTES`` of answers wait unsent is cut off (an inline kind never pauses its reading for
    a handler, so nothing else would bound them). An async function is refused as an inline handler."""
    from spantrain_p2p.net import connections

    srv = DataPlaneServer("127.0.0.1", 0, lambda: {})

    async def later(header, buffers):
        return None

    with pytest.raises(TypeError, match="inline"):
        srv.register("later", later, inline=True)
    srv.register("now", lambda header, buffers: None, inline=True)

    class Transport:
        def __init__(self):
            self.out, self.aborted, self.unsent = [], False, 0

        def get_extra_info(self, key):
            return ("127.0.0.1", 1)

        def write(self, data):
            self.out.append(bytes(data))

        def get_write_buffer_size(self):
            return self.unsent

        def is_closing(self):
            return self.aborted

        def abort(self):
            self.aborted = True

        def pause_reading(self):
            pass

        def resume_reading(self):
            pass

    frame = b"".join(bytes(c) for c in framing.encode({}, []))
    request = REQUEST.pack(REQUEST_MAGIC, 3, len(frame)) + b"now" + frame
    t = Transport()
    conn = connections.FramedConnection(srv, t, None)

    def send():
        data = memoryview(request)
        while data.nbytes and not t.aborted:
            buf = conn.get_buffer(-1)
            n = min(len(buf), data.nbytes)
            buf[:n] = data[:n]
            conn.buffer_updated(n)
            data = data[n:]

    send()
    send()
    assert [ANSWER.unpack(a[:ANSWER.size])[1] for a in t.out] == [204, 204] and not t.aborted
    t.unsent = connections.MAX_UNSENT_BYTES + 1
    send()
    assert t.aborted and len(t.out) == 2


async def test_the_client_keeps_one_connection_for_messages_sent_one_after_another(server):
    client = DataPlaneClient()
    try:
        for i in range(20):
            assert (await client.send(server.url, "echo", {"x": i}, [b"ok" * i]))[0] == {"echo": i}
        assert len(server._framed) == 1
        await asyncio.gather(*(client.send(server.url, "echo", {"x": i}, [b"ok"]) for i in range(5)))
        assert 1 <= len(server._framed) <= 5
    finally:
        await client.close()


async def test_a_peer_that_hangs_up_without_answering_gives_a_connection_error_at_once():
    async def hang_up(reader, writer):
        await reader.read(100)
        writer.close()

    srv = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    client = DataPlaneClient()
    try:
        with pytest.raises(OSError, match="closed the connection"):
            await client.send(f"http://127.0.0.1:{port}", "echo", {"x": 1}, [b"ok"], timeout=5)
        with pytest.raises(ValueError, match="not a data-plane address"):
            await client.send("ftp://127.0.0.1:1", "echo", {})
    finally:
        await client.close()
        srv.close()


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
        [sys.executable, "-m", "spantrain_p2p.cli.dataplane_bench", "--mib", "1", "--reps", "2", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["raw_streamreader_mib_s"] > 0 and d["raw_recv_into_mib_s"] > 0 and d["dataplane_mib_s"] > 0
    assert d["raw_mib_s"] == max(d["raw_streamreader_mib_s"], d["raw_recv_into_mib_s"])
    assert d["ratio"] == pytest.approx(d["dataplane_mib_s"] / d["raw_mib_s"], abs=2e-3)


def test_a_log_budget_writes_a_line_a_key_per_pause_and_counts_the_ones_it_left_out():
    import logging

    from spantrain_p2p.net.budget import LogBudget

    now = [0.0]
    quiet = LogBudget(every_s=10.0, clock=lambda: now[0], max_keys=3)
    assert quiet.take("a") == (0, 0.0)
    for t in (1.0, 2.0, 9.9):
        now[0] = t
        assert quiet.take("a") is None
    assert quiet.take("b") == (0, 0.0)  # a key of its own
    now[0] = 10.0
    assert quiet.take("a") == (3, 10.0)
    assert quiet.take("a") is None
    for k in "cd":  # past max_keys the key written longest ago ("b") is forgotten, not "a"
        quiet.take(k)
    assert set(quiet._keys) == {"a", "c", "d"}

    lines = []

    class Catch(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("test-log-budget")
    logger.addHandler(Catch())
    logger.propagate = False
    now[0] = 25.0
    quiet.warning(logger, "a", "refused %s", "x")
    quiet.warning(logger, "a", "refused %s", "y")
    now[0] = 40.0
    quiet.warning(logger, "a", "refused %s", "z")
    assert lines == ["refused x (and 1 more like it, left out of the log over 15s)", "refused z (and 1 more like it, left out of the log over 15s)"]


async def test_a_source_that_opens_connections_as_fast_as_it_can_gets_a_line_in_the_log_not_one_a_connection(caplog):
    from spantrain_p2p.launch.budget_attacks import loopback_source_ok
    from spantrain_p2p.net.budget import Limits

    if not loopback_source_ok("127.0.0.66"):
        pytest.skip("this host cannot send from 127.0.0.66")
    srv = DataPlaneServer("127.0.0.1", 0, dict, limits=Limits(per_address_handshakes=1))
    await srv.start()
    held = []
    try:
        with caplog.at_level("DEBUG", logger="spantrain_p2p.net"):
            held.append(await asyncio.open_connection("127.0.0.1", srv.port, local_addr=("127.0.0.66", 0)))
            refused = 0
            for _ in range(30):  # each refused at once: the one above holds the address's handshake
                reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, local_addr=("127.0.0.66", 0))
                answer = await asyncio.wait_for(reader.read(), 5)
                refused += b"too many connections being opened from 127.0.0.66" in answer
                writer.close()
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("spantrain_p2p.net")]
        assert refused == 30
        assert lines == ["refused a data-plane connection: too many connections being opened from 127.0.0.66; "
                         "try again later"], lines
    finally:
        for _, writer in held:
            writer.close()
        await srv.stop()


def test_unknown_reversal_and_relay_tokens_from_one_address_get_a_line_in_the_log_not_one_each(caplog, monkeypatch):
    from spantrain_p2p.net import preambles
    from spantrain_p2p.net.budget import LogBudget

    monkeypatch.setattr(preambles, "_quiet", LogBudget())  # the process's budget: other tests' lines left aside

    class Transport:
        def __init__(self, host):
            self.host, self.closed = host, False

        def get_extra_info(self, name):
            return (self.host, 40000) if name == "peername" else None

        def close(self):
            self.closed = True

    reversals, relay = preambles.Reversals(), preambles.Relay()
    with caplog.at_level("DEBUG", logger="spantrain_p2p.net"):
        ts = [Transport("11.0.0.7") for _ in range(40)]
        for i, t in enumerate(ts):
            if i % 2:
                reversals.arrive(t, bytes(preambles.TOKEN_BYTES))
            else:
                relay.arrive(t, bytes(preambles.TOKEN_BYTES) + b"a")
        relay.arrive(Transport("11.0.0.8"), bytes(preambles.TOKEN_BYTES) + b"a")  # another address: its own line
    assert all(t.closed for t in ts)
    assert [r.getMessage() for r in caplog.records] == [
        "closed a relay connection with an unknown token from 11.0.0.7",
        "closed a relay connection with an unknown token from 11.0.0.8"]


def test_rejected_frames_are_budgeted_by_sender_and_kind(caplog):
    """One peer's flood of bad frames of a kind leaves another peer's rejected frame of that kind in
    the log: the budget's key is the sender and the kind."""
    srv = DataPlaneServer("127.0.0.1", 0, dict)
    with caplog.at_level("DEBUG", logger="spantrain_p2p.net"):
        for _ in range(20):
            assert srv._failed("act", framing.FrameError("frame header is not valid msgpack"), "Qmflooder")[0] == 400
        srv._failed("act", framing.FrameError("epoch 3 is over"), "Qmmember")
        srv._failed("grad", framing.FrameError("epoch 3 is over"), "Qmmember")
    assert [r.getMessage() for r in caplog.records] == [
        "rejected act message: frame header is not valid msgpack", "rejected act message: epoch 3 is over",
        "rejected grad message: epoch 3 is over"]
