"""The daemon's length prefix written in one go: the same bytes as hivemind's byte-at-a-time writer."""
import asyncio

import pytest
from hivemind.p2p.p2p_daemon_bindings import utils
from hivemind.proto import p2pd_pb2

from spantrain_p2p.swarm import daemon_wire


class Sink:
    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 70000])
def test_same_bytes_as_hivemind_in_one_write(size):
    msg = p2pd_pb2.Request(type=p2pd_pb2.Request.CONNECT, connect=p2pd_pb2.ConnectRequest(peer=b"x" * size))
    ours, theirs = Sink(), Sink()
    asyncio.run(daemon_wire.write_pbmsg(ours, msg))
    asyncio.run(utils.write_pbmsg(theirs, msg))
    assert b"".join(ours.writes) == b"".join(theirs.writes)
    assert len(ours.writes) == 1 and len(theirs.writes) >= 2


def test_varint_reads_back():
    async def back(n):
        r = asyncio.StreamReader()
        r.feed_data(daemon_wire.varint(n))
        return await utils.read_unsigned_varint(r)

    for n in (0, 1, 127, 128, 255, 300, 1 << 20, (1 << 63) - 1):
        assert asyncio.run(back(n)) == n
    with pytest.raises(ValueError):
        daemon_wire.varint(-1)


def test_install_swaps_the_control_client_writer_and_its_table_of_calls():
    from hivemind.p2p.p2p_daemon_bindings import control

    daemon_wire.install()
    daemon_wire.install()
    assert control.write_pbmsg is daemon_wire.write_pbmsg
    client = control.ControlClient(None, _initialized_with_create=True)
    assert type(client._pending_calls) is daemon_wire.LiveCalls  # idempotent: installed twice above


def _answers(*call_ids: bytes) -> bytes:
    out = b""
    for cid in call_ids:
        body = p2pd_pb2.PersistentConnectionResponse(
            callId=cid, callUnaryResponse=p2pd_pb2.CallUnaryResponse(response=b"ok")).SerializeToString()
        out += daemon_wire.varint(len(body)) + body
    return out


def _read_answers(pending: dict, cancelled: bytes, live: bytes):
    """hivemind's own reader of the daemon's answers, fed an answer to a call whose caller gave up
    (its future cancelled, not yet dropped from the table) and then one to a live call."""
    from uuid import UUID

    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    async def go():
        client = ControlClient.__new__(ControlClient)
        client._pending_calls = pending
        client._handler_tasks, client._read_task, client._write_task = {}, None, None
        gave_up, waiting = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
        gave_up.cancel()
        pending[UUID(bytes=cancelled)], pending[UUID(bytes=live)] = gave_up, waiting
        reader = asyncio.StreamReader()
        reader.feed_data(_answers(cancelled, live))
        reader.feed_eof()
        try:
            await client._read_from_persistent_conn(reader)
        except asyncio.InvalidStateError:
            return "reader died", waiting.done()
        return "reader read on", waiting.result()

    return asyncio.run(go())


def test_an_answer_to_a_call_given_up_does_not_kill_the_reader():
    a, b = b"a" * 16, b"b" * 16
    assert _read_answers(daemon_wire.LiveCalls(), a, b) == ("reader read on", b"ok")
    assert _read_answers({}, a, b) == ("reader died", False)  # hivemind's plain table: why LiveCalls
