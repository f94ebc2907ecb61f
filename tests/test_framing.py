import struct

import msgpack
import pytest

from spantrain_p2p.net import framing
from spantrain_p2p.net.framing import FrameError


def join(chunks):
    return b"".join(bytes(c) for c in chunks)


def test_frame_round_trip_keeps_header_and_buffers():
    frame = join(framing.encode({"kind": "act", "step": 3}, [b"abc", b"", bytes(range(256))]))
    header, bufs = framing.decode(frame)
    assert header == {"kind": "act", "step": 3}
    assert [bytes(b) for b in bufs] == [b"abc", b"", bytes(range(256))]


def test_buffers_are_views_not_copies():
    frame = bytearray(join(framing.encode({}, [b"xyz"])))
    _, (buf,) = framing.decode(frame)
    frame[-1] = ord("Z")
    assert bytes(buf) == b"xyZ"


def _raw(header_obj, payload=b"", magic=framing.MAGIC):
    head = msgpack.packb(header_obj)
    return struct.pack(">4sI", magic, len(head)) + head + payload


@pytest.mark.parametrize("frame,reason", [
    (b"", "shorter than its prefix"),
    (_raw({"buffers": []}, magic=b"HTTP"), "bad magic"),
    (struct.pack(">4sI", framing.MAGIC, 1 << 30), "over the"),
    (struct.pack(">4sI", framing.MAGIC, 100) + b"\x80", "truncated"),
    (_raw([1, 2]), "must be a map"),
    (_raw({"x": 1}), "needs 'buffers'"),
    (_raw({"buffers": [-1]}), "needs 'buffers'"),
    (_raw({"buffers": [5]}, b"abc"), "does not match"),
    (_raw({"buffers": [1]}, b"abcdef"), "does not match"),
    (_raw({"buffers": [0] * 1000}), "at most"),
])
def test_malformed_frames_are_rejected_with_a_reason(frame, reason):
    with pytest.raises(FrameError, match=reason):
        framing.decode(frame)


def test_frames_over_the_limit_are_rejected_before_parsing():
    frame = join(framing.encode({}, [b"x" * 1000]))
    with pytest.raises(FrameError, match="limit"):
        framing.decode(frame, max_bytes=100)


def test_check_fields_names_the_missing_or_mistyped_field():
    framing.check_fields({"step": 1, "kind": "a"}, {"step": int, "kind": str})
    with pytest.raises(FrameError, match="'step'"):
        framing.check_fields({"step": "1"}, {"step": int})
    with pytest.raises(FrameError, match="'step'"):
        framing.check_fields({"step": True}, {"step": int})
