"""A signed entry sent again as the change to the one its receiver holds (``swarm.deltas``)."""
import pytest

from spantrain_p2p.swarm.deltas import DIGEST_BYTES, Held, Sent, delta, digest, undelta


def test_a_change_rebuilds_the_body_and_is_small_where_little_changed():
    base = b"".join(b"link %d: rtt 5.0 ms, 100.0 Mbit/s; " % i for i in range(100))
    body = base.replace(b"link 7: rtt 5.0", b"link 7: rtt 9.5")
    z = delta(body, base)
    assert undelta(z, base, len(body)) == body and len(z) < len(body) / 50
    with pytest.raises(ValueError):
        undelta(z, base, len(body) - 1)  # over the bound: never inflated past it
    with pytest.raises(ValueError):
        undelta(b"\xff" * 20, base, 1 << 20)
    with pytest.raises(ValueError):
        undelta(z + b"more", base, 1 << 20)


def test_the_sender_sends_whole_until_the_receiver_took_one_and_after_it_lacked_one():
    s = Sent()
    e1, e2, e3 = ({"body": b"x" * 500 + bytes([k]), "key": b"k", "sig": b"s%d" % k} for k in (1, 2, 3))
    assert s.wire("B", "links", e1) is e1
    s.acked("B", "links", e1)
    w = s.wire("B", "links", e2)
    assert set(w) == {"base", "z", "sig"} and w["base"] == digest(e1["body"]) and w["sig"] == b"s2"
    assert s.wire("C", "links", e2) is e2  # another receiver took none
    s.lacked("B", "links")
    assert s.wire("B", "links", e3) is e3


def test_the_receiver_rebuilds_from_what_it_holds_and_keeps_a_bounded_amount():
    h = Held(max_bytes=3000)
    e1 = {"body": b"y" * 1000, "key": b"K" * 100, "sig": b"s1"}
    h.keep("A", "links", e1)
    body2 = b"y" * 999 + b"z"
    change = {"base": digest(e1["body"]), "z": delta(body2, e1["body"]), "sig": b"s2"}
    assert h.whole("A", "links", change, 1 << 20) == {"body": body2, "key": b"K" * 100, "sig": b"s2"}
    assert h.whole("B", "links", change, 1 << 20) is None  # nothing held of B
    assert h.whole("A", "links", e1, 1 << 20) is e1  # whole: as it is
    with pytest.raises(ValueError):
        h.whole("A", "links", {"base": b"short", "z": b"", "sig": b""}, 1 << 20)
    h.keep("B", "links", e1)
    h.keep("C", "links", e1)  # past 3000 bytes: A's goes
    assert h.whole("A", "links", change, 1 << 20) is None
    assert len(digest(b"")) == DIGEST_BYTES
