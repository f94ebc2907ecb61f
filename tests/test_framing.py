import struct
from dataclasses import dataclass
from typing import Optional

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


@dataclass(frozen=True)
class _Reading:
    name: str
    count: int
    times: tuple[float, ...]
    rate: Optional[float] = None
    flag: bool = False

    def __post_init__(self):
        if self.count < 0:
            raise ValueError("count must be >= 0")


@pytest.mark.parametrize("d, why", [
    ([1, 2], "reading must be a map, not list"),
    ({"name": "a", "count": 1, "times": [], "spam": 1}, "unknown fields ['spam']"),
    ({"name": "a", "times": []}, "lacks fields ['count']"),
    ({"name": "a", "count": True, "times": []}, "'count' must be an int, not True"),
    ({"name": "a", "count": 1.0, "times": []}, "'count' must be an int"),
    ({"name": 5, "count": 1, "times": []}, "'name' must be a str"),
    ({"name": "a", "count": 1, "times": [1.0, float("nan")]}, "'times'[1] must be a finite number, not nan"),
    ({"name": "a", "count": 1, "times": "fast"}, "'times' must be a list, not str"),
    ({"name": "a", "count": 1, "times": [], "rate": float("inf")}, "'rate' must be a finite number"),
    ({"name": "a", "count": 1, "times": [], "flag": 1}, "'flag' must be a bool"),
    ({"name": "a", "count": -1, "times": []}, "count must be >= 0"),  # the class's own checks still run
])
def test_strict_from_dict_refuses_untrusted_maps_saying_which_field_is_wrong(d, why):
    with pytest.raises(ValueError) as e:
        framing.strict_from_dict(_Reading, d, "reading", required=("name", "count", "times"))
    assert why in str(e.value)


def test_strict_from_dict_builds_the_dataclass_with_tuples_and_defaults():
    r = framing.strict_from_dict(_Reading, {"name": "a", "count": 2, "times": [1, 0.5], "rate": None}, "reading",
                                 required=("name", "count", "times"))
    assert r == _Reading("a", 2, (1, 0.5))
    with pytest.raises(ValueError, match="lacks fields"):  # by default every field is required
        framing.strict_from_dict(_Reading, {"name": "a", "count": 2, "times": []}, "reading")


def test_strict_from_dict_quotes_only_the_start_of_a_huge_bad_value():
    with pytest.raises(ValueError) as e:
        framing.strict_from_dict(_Reading, {"name": "a", "count": "x" * 10_000, "times": []}, "reading", required=())
    assert len(str(e.value)) < 100 and str(e.value).endswith("...")
