"""The encrypted records of the data plane, on the receiving side, byte by byte (``net.secure``)."""
import asyncio
import os

import pytest

from spantrain_p2p.net import secure


class Transport:
    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True

    def is_closing(self):
        return self.aborted


class Inner(asyncio.BufferedProtocol):
    """Takes at most ``cap`` bytes a buffer (as the framed connection takes RECV_BYTES)."""

    def __init__(self, cap):
        self.cap, self.got, self._buf = cap, bytearray(), bytearray(cap)

    def get_buffer(self, sizehint):
        return memoryview(self._buf)[: self.cap]

    def buffer_updated(self, n):
        self.got += self._buf[:n]


def feed(proto, data: bytes, step: int) -> None:
    view, i = memoryview(data), 0
    while i < len(data) and not proto.transport.is_closing():
        buf = proto.get_buffer(-1)
        n = min(len(buf), step, len(data) - i)
        buf[:n] = view[i:i + n]
        proto.buffer_updated(n)
        i += n


def receiver(key, cap):
    proto = secure.SecureProtocol(Transport(), key)
    proto.inner = Inner(cap)
    return proto


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 22])
@pytest.mark.parametrize("cap", [100, 1 << 18, 1 << 21])
def test_records_open_into_the_inner_protocol_whatever_the_reads_and_its_buffers(step, cap):
    key = os.urandom(32)
    sealer = secure.Sealer(key)
    parts = [b"", os.urandom(13), os.urandom(secure.MAX_PLAIN + 5), os.urandom(300)]
    wire = b"".join(bytes(r) for p in parts for r in sealer.seal(p))
    if step == 1:
        wire = wire[:20000]  # byte by byte: the first records only
    proto = receiver(key, cap)
    feed(proto, wire, step)
    whole = b"".join(parts)
    assert not proto.transport.aborted
    assert bytes(proto.inner.got) == whole[: len(proto.inner.got)]
    if step > 1:
        assert len(proto.inner.got) == len(whole)


def test_the_same_records_with_or_without_encrypt_into(monkeypatch):
    key, data = os.urandom(32), os.urandom((1 << 20) + 77)
    into = [bytes(r) for r in secure.Sealer(key).seal(data)]
    monkeypatch.setattr(secure, "_INTO", False)
    plain = [bytes(r) for r in secure.Sealer(key).seal(data)]
    assert into == plain and len(into) == 2
    proto = receiver(key, 1 << 21)
    feed(proto, b"".join(plain), 1 << 16)
    assert bytes(proto.inner.got) == data


@pytest.mark.parametrize("attack", ["altered", "replayed", "too long", "too short"])
def test_a_bad_record_ends_the_connection_and_nothing_of_it_is_handed_on(attack):
    key = os.urandom(32)
    sealer = secure.Sealer(key)
    first, second = (bytes(r) for p in (b"hello", b"world" * 10) for r in sealer.seal(p))
    if attack == "altered":
        bad = second[:-1] + bytes([second[-1] ^ 1])
    elif attack == "replayed":
        bad = first
    elif attack == "too long":
        bad = (secure.MAX_PLAIN + secure.TAG + 1).to_bytes(4, "big") + b"x" * 64
    else:
        bad = (secure.TAG - 1).to_bytes(4, "big") + b"x" * 64
    proto = receiver(key, 1 << 20)
    feed(proto, first + bad + second, 1 << 16)
    assert proto.transport.aborted
    assert bytes(proto.inner.got) == b"hello"  # an altered record opened in place is never handed on


def test_one_read_opens_every_record_it_brought_and_the_buffer_grows_only_as_a_record_needs():
    """Several records in one read are opened at once (a record's length and its body no longer cost a
    read each); a record longer than the buffer grows it to hold that record, no more than
    MAX_PLAIN + TAG, its length and ``ROOM``."""
    key = os.urandom(32)
    sealer = secure.Sealer(key)
    small = [os.urandom(n) for n in (13, 100, 2000)]
    proto = receiver(key, 1 << 21)
    wire = b"".join(bytes(r) for p in small for r in sealer.seal(p))
    buf = proto.get_buffer(-1)
    assert len(buf) >= len(wire)
    buf[:len(wire)] = wire
    proto.buffer_updated(len(wire))  # one read
    assert bytes(proto.inner.got) == b"".join(small)
    big = os.urandom(secure.MAX_PLAIN)
    feed(proto, b"".join(bytes(r) for r in sealer.seal(big)), 1 << 16)
    assert bytes(proto.inner.got) == b"".join(small) + big and not proto.transport.aborted
    assert len(proto._buf) <= secure.MAX_PLAIN + secure.TAG + 4 + secure.SecureProtocol.ROOM + secure.SecureProtocol.MIN_ROOM
