"""Lanes (``net.lanes``): a hop's messages on a connection taken off the event loop, written and read
by threads; and how one is asked for and taken on the data plane."""
import asyncio
import contextlib
import socket
import threading
import time

import pytest

from spantrain_p2p.net import framing, lanes
from spantrain_p2p.net.client import DataPlaneClient
from spantrain_p2p.net.dataplane import DataPlaneServer, LaneRefused
from spantrain_p2p.net.handshake import Authenticator
from spantrain_p2p.net.wire import REQUEST, REQUEST_MAGIC, RemoteError, Retry
from spantrain_p2p.swarm.identity import Identity

A, B = Identity.generate(), Identity.generate()


def _pair(small: bool = False):
    a, b = socket.socketpair()
    if small:  # what a socket holds, kept small: a big message cannot go at once
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return a, b


def _ends(max_bytes=1 << 24, backlog=1 << 24, small=False):
    a, b = _pair(small)
    out, inn = lanes.LaneOut(a, "peer-b", backlog), lanes.LaneIn(b, "peer-a", max_bytes)
    if small:  # (LaneOut and LaneIn ask for big buffers: small again for this test)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return out, inn


def test_messages_arrive_whole_and_in_order():
    out, inn = _ends()
    try:
        for i in range(3):
            out.write(lanes.request_chunks("act", {"mb": i}, [bytes([i]) * (1000 + i)]))
        out.flush(5.0)
        for i in range(3):
            assert inn.wait(5.0)
            kind, header, buffers = inn.read()
            assert kind == "act" and header["mb"] == i and bytes(buffers[0]) == bytes([i]) * (1000 + i)
        assert not inn.wait(0.05)  # nothing more
    finally:
        out.close()
        inn.close()


def test_a_write_the_socket_cannot_take_at_once_does_not_wait_for_the_reader():
    out, inn = _ends(small=True)
    try:
        big = b"z" * (4 << 20)
        t0 = time.monotonic()
        out.write(lanes.request_chunks("grad", {"mb": 0}, [big]))  # nobody reads yet
        assert time.monotonic() - t0 < 1.0
        out.write(lanes.request_chunks("grad", {"mb": 1}, [b"small"]))  # after it, in order
        got = []

        def read():
            for _ in range(2):
                got.append(inn.read())
        reader = threading.Thread(target=read)
        reader.start()
        out.flush(10.0)
        reader.join(10.0)
        assert [h["mb"] for _k, h, _b in got] == [0, 1]
        assert bytes(got[0][2][0]) == big and bytes(got[1][2][0]) == b"small"
    finally:
        out.close()
        inn.close()


def test_a_message_over_the_limit_or_not_of_the_protocol_ends_the_lane():
    a, b = _pair()
    inn = lanes.LaneIn(b, "peer-a", max_message_bytes=1000)
    try:
        a.sendall(REQUEST.pack(REQUEST_MAGIC, 3, 10_000) + b"act")
        with pytest.raises(lanes.LaneClosed, match="over the 1000-byte limit"):
            inn.read()
    finally:
        a.close()
        inn.close()
    a, b = _pair()
    inn = lanes.LaneIn(b, "peer-a", max_message_bytes=1000)
    try:
        a.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(lanes.LaneClosed, match="bad magic"):
            inn.read()
    finally:
        a.close()
        inn.close()


def test_a_lane_closed_mid_message_says_so():
    a, b = _pair()
    inn = lanes.LaneIn(b, "peer-a", max_message_bytes=1 << 20)
    chunks = lanes.request_chunks("act", {"mb": 0}, [b"x" * 5000])
    a.sendall(b"".join(bytes(c) for c in chunks)[:3000])
    a.close()
    with pytest.raises(lanes.LaneClosed, match="mid-message"):
        inn.read()
    inn.close()


def test_a_malformed_frame_ends_the_lane():
    a, b = _pair()
    inn = lanes.LaneIn(b, "peer-a", max_message_bytes=1 << 20)
    a.sendall(REQUEST.pack(REQUEST_MAGIC, 3, 8) + b"act" + b"\0" * 8)
    with pytest.raises(lanes.LaneClosed, match="magic"):
        inn.read()
    a.close()
    inn.close()


def test_shutting_a_lane_down_wakes_a_thread_waiting_on_it():
    out, inn = _ends()
    woke = []

    def wait():
        inn.wait(30.0)
        with contextlib.suppress(lanes.LaneClosed):
            inn.read()
        woke.append(time.monotonic())
    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    inn.shutdown()
    t.join(5.0)
    assert woke and woke[0] - t0 < 2.0
    inn.close()
    out.close()
    with pytest.raises(lanes.LaneClosed):
        out.write([b"x"])


def test_a_write_to_a_lane_whose_reader_left_fails():
    out, inn = _ends(small=True)
    inn.close()
    with pytest.raises(lanes.LaneClosed):
        for _ in range(100):  # the first writes may still land in the kernel's buffers
            out.write(lanes.request_chunks("act", {}, [b"y" * 100_000]))
            out.flush(5.0)
    out.close()


# ---- asked for and taken on the data plane ---------------------------------------------------------
@contextlib.asynccontextmanager
async def _server(accept, encrypt_here: bool = False):
    here = (lambda: "this machine")
    srv = DataPlaneServer("127.0.0.1", 0, lambda: {}, auth=Authenticator(A, encrypt=True, host=None if encrypt_here else here))
    srv.register_lane("lane", accept)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


def _client():
    return DataPlaneClient(auth=Authenticator(B, encrypt=True, host=lambda: "this machine"))


async def test_a_lane_is_taken_off_both_loops_and_carries_messages():
    taken = []

    def accept(header, buffers):
        assert header["src"] == B.peer_id and header["epoch"] == 3
        return lambda sock: taken.append(sock)
    async with _server(accept) as srv:
        client = _client()
        try:
            sock = await client.open_lane(srv.url, "lane", {"epoch": 3}, peer_id=A.peer_id)
            assert sock is not None and len(taken) == 1
            out = lanes.LaneOut(sock, A.peer_id, 1 << 24)
            inn = lanes.LaneIn(taken[0], B.peer_id, 1 << 24)
            out.write(lanes.request_chunks("act", {"step": 1}, [b"q" * 300_000]))
            kind, header, buffers = await asyncio.to_thread(inn.read)
            assert kind == "act" and header["step"] == 1 and bytes(buffers[0]) == b"q" * 300_000
            out.close()
            inn.close()
        finally:
            await client.close()


async def test_a_lane_refused_says_why_and_an_encrypted_connection_gets_none():
    def refuse(header, buffers):
        if header.get("epoch") == 1:
            raise Retry("no stage map for that epoch yet")
        raise LaneRefused("this peer takes no lanes")
    async with _server(refuse) as srv:
        client = _client()
        try:
            with pytest.raises(RemoteError) as e:
                await client.open_lane(srv.url, "lane", {"epoch": 1}, peer_id=A.peer_id)
            assert e.value.status == 503
            with pytest.raises(RemoteError) as e:
                await client.open_lane(srv.url, "lane", {"epoch": 2}, peer_id=A.peer_id)
            assert e.value.status == 409 and "no lanes" in e.value.reason
        finally:
            await client.close()
    async with _server(lambda h, b: (lambda sock: None), encrypt_here=True) as srv:
        client = _client()
        try:
            assert await client.open_lane(srv.url, "lane", {"epoch": 1}, peer_id=A.peer_id) is None
        finally:
            await client.close()


async def test_a_lane_kind_is_no_message_over_http_or_a_plain_send():
    async with _server(lambda h, b: (lambda sock: sock.close())) as srv:
        client = _client()
        try:
            # over the framed connection's usual path the kind is a lane request: answered 204, taken
            sock = await client.open_lane(srv.url, "lane", {}, peer_id=A.peer_id)
            assert sock is not None
            sock.close()
        finally:
            await client.close()
        status, reason = srv.dispatch_now("lane", b"".join(framing.encode({})), B.peer_id)
        assert status == 400 and "opens a lane" in reason
