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


def test_install_swaps_the_control_client_writer():
    from hivemind.p2p.p2p_daemon_bindings import control

    daemon_wire.install()
    assert control.write_pbmsg is daemon_wire.write_pbmsg
