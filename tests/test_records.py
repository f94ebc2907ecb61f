import msgpack
import pytest

from spantrain_p2p.swarm import membership
from spantrain_p2p.swarm.identity import Identity
from spantrain_p2p.swarm.records import BadRecord, PeerRecord, open_record, seal


@pytest.fixture(scope="module")
def ids():
    return Identity.generate(), Identity.generate()


def record(ident, **kw):
    base = dict(peer_id=ident.peer_id, seq=1, ts=1.7e9, state="idle", version="0.1.0",
                data_url="http://127.0.0.1:1234", maddrs=("/ip4/127.0.0.1/tcp/1/p2p/" + ident.peer_id,),
                instance="abc", name="p0", device={"kind": "cpu", "cpus": 2})
    base.update(kw)
    return PeerRecord(**base)


def test_sealed_record_opens_to_the_same_record(ids):
    rec = record(ids[0])
    assert open_record(ids[0].peer_id, seal(rec, ids[0])) == rec


def test_tampered_body_is_rejected(ids):
    sealed = seal(record(ids[0]), ids[0])
    d = msgpack.unpackb(sealed["body"])
    d["state"] = "training"
    sealed["body"] = msgpack.packb(d)
    with pytest.raises(BadRecord, match="signature"):
        open_record(ids[0].peer_id, sealed)


def test_record_signed_by_another_key_cannot_claim_a_peer_id(ids):
    a, b = ids
    forged = record(a)  # claims a's peer id...
    body = msgpack.packb(forged.to_dict())
    sealed = {"body": body, "key": b.public_der, "sig": b.sign(body)}  # ...signed by b
    with pytest.raises(BadRecord, match="signed by"):
        open_record(a.peer_id, sealed)


def test_record_under_a_foreign_subkey_is_rejected(ids):
    a, b = ids
    with pytest.raises(BadRecord, match="subkey"):
        open_record(b.peer_id, seal(record(a), a))


@pytest.mark.parametrize("value,reason", [
    (None, "not a signed peer record"),
    ({"body": b"x"}, "not a signed peer record"),
    ({"body": "x", "key": b"", "sig": b""}, "must be bytes"),
    ({"body": b"x" * 100_000, "key": b"", "sig": b""}, "too large"),
])
def test_malformed_values_are_rejected_with_a_reason(value, reason):
    with pytest.raises(BadRecord, match=reason):
        open_record("Qm", value)


@pytest.mark.parametrize("field,bad", [("state", "dancing"), ("seq", -1), ("seq", "1"), ("ts", float("nan")),
                                       ("maddrs", ["x"] * 100), ("data_url", "ftp://x"), ("schema", 99),
                                       ("device", {"k": [1, 2]})])
def test_wrong_schema_fields_are_rejected(ids, field, bad):
    a = ids[0]
    d = record(a).to_dict()
    d[field] = bad
    body = msgpack.packb(d)
    with pytest.raises(BadRecord):
        open_record(a.peer_id, {"body": body, "key": a.public_der, "sig": a.sign(body)})


def test_member_parsing_skips_bad_and_expired_entries_and_logs_each_once(ids, caplog):
    a, b = ids

    class V:
        def __init__(self, value, exp):
            self.value, self.expiration_time = value, exp

    entries = {a.peer_id: V(seal(record(a), a), 100.0), b.peer_id: V(seal(record(b), b), 10.0), "junk": V(b"zz", 100.0)}
    bad = membership.BadRecordLog()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            view = membership.parse_members(entries, now=50.0, on_bad=bad)
    assert list(view) == [a.peer_id]  # b expired, junk invalid
    assert sum("ignoring peer record" in r.message for r in caplog.records) == 1


def test_the_bad_entry_log_says_what_was_ignored_once_and_remembers_a_bounded_number(caplog):
    import logging

    bad = membership.BadRecordLog("lease", logging.getLogger("spantrain.election"), limit=3)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            bad("000000000002", "bad signature")
        for i in range(10):  # a hostile peer making up reasons
            bad("x", f"reason {i}")
    said = [(r.name, r.message) for r in caplog.records]
    assert said[0] == ("spantrain.election", "ignoring lease '000000000002': bad signature")
    assert len(said) == 3 and len(bad._seen) == 3


def test_a_tombstone_counts_as_a_departure(ids):
    a, b = ids
    old = {a.peer_id: record(a), b.peer_id: record(b)}
    new = {a.peer_id: record(a), b.peer_id: record(b, state="left")}
    assert membership.diff_members(old, new) == ([], [b.peer_id])
    assert membership.diff_members(new, old) == ([b.peer_id], [])


def test_identity_file_round_trip_keeps_the_peer_id(tmp_path):
    path = str(tmp_path / "id.key")
    first, created = Identity.load_or_create(path)
    again, created_again = Identity.load_or_create(path)
    assert created and not created_again and first.peer_id == again.peer_id


def test_garbage_identity_file_gives_a_clear_error(tmp_path):
    path = tmp_path / "id.key"
    path.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="not a libp2p RSA identity"):
        Identity.load(str(path))


def test_a_checked_signature_is_remembered_and_a_bad_one_never(ids, monkeypatch):
    from spantrain_p2p.swarm import records

    calls = []
    real = records.verify
    monkeypatch.setattr(records, "verify", lambda *a: calls.append(1) or real(*a))
    sealed = seal(record(ids[0], seq=77), ids[0])
    for _ in range(3):
        assert open_record(ids[0].peer_id, dict(sealed)).seq == 77
    assert len(calls) == 1  # checked once, then remembered
    bad = {**sealed, "sig": bytes(len(sealed["sig"]))}
    for _ in range(2):
        with pytest.raises(BadRecord, match="signature"):
            open_record(ids[0].peer_id, bad)
    assert len(calls) == 3  # a bad signature is checked every time, never kept
    # the same bytes split differently (part of the key moved into the body) are another triple
    moved = {"key": sealed["key"][:-1], "body": sealed["key"][-1:] + sealed["body"], "sig": sealed["sig"]}
    with pytest.raises(BadRecord):
        open_record(ids[0].peer_id, moved)
    assert len(calls) == 4
