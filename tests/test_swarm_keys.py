"""The swarm's DHT keys are part of the protocol: peers of one version must build the same strings."""
from spantrain_p2p.swarm import election, keys, measure, membership


def test_every_key_of_a_swarm_is_spelled_as_peers_of_this_version_expect():
    assert keys.members_keys("s1") == [f"spantrain/s1/members.{b:02d}" for b in range(keys.MEMBER_BUCKETS)]
    assert keys.member_bucket("QmPeer") == 4 and keys.member_key_of("s1", "QmPeer") == "spantrain/s1/members.04"
    assert [keys.measure_key("s1", w, 3) for w in (keys.PROFILES, keys.LINKS, keys.GROUPS, keys.PINGS, keys.ACCUSE)] == [
        "spantrain/s1/profiles.03", "spantrain/s1/links.03", "spantrain/s1/groups.03", "spantrain/s1/pings.03",
        "spantrain/s1/accuse.03"]
    assert keys.measure_key_of("s1", keys.PINGS, "QmPeer") == "spantrain/s1/pings.04"
    assert keys.measure_key_of("s1", keys.LINKS, "QmPeer") == f"spantrain/s1/links.{keys.bucket_of('QmPeer', 32):02d}"
    assert keys.measure_keys("s1", keys.PINGS, ["QmPeer"]) == ["spantrain/s1/pings.04"]
    assert len(keys.measure_keys("s1", keys.PINGS)) == keys.MEMBER_BUCKETS and len(keys.measure_keys("s1", keys.LINKS)) == 32
    assert len(keys.measure_keys("s1", keys.PROFILES)) == 16
    assert keys.lease_key("s1") == "spantrain/s1/planner"
    assert keys.job_keys("s1") == [f"spantrain/s1/job.{b:02d}" for b in range(16)]
    assert keys.job_key_of("s1", "QmPeer") == f"spantrain/s1/job.{keys.bucket_of('QmPeer', 16):02d}"
    assert keys.stagemap_key("s1") == "spantrain/s1/stagemap"


def test_term_and_epoch_subkeys_sort_as_their_numbers_do():
    assert keys.term_subkey(7, "Qm1") == "000000000007/Qm1" and keys.epoch_subkey(12, "Qm2") == "000000000012/Qm2"
    assert sorted(keys.epoch_subkey(e, "Qm") for e in (10, 9, 100)) == [keys.epoch_subkey(e, "Qm") for e in (9, 10, 100)]
    assert keys.wrap_subkey("QmTo", "QmBy") == "QmTo/QmBy"


def test_the_modules_that_store_records_use_these_keys():
    assert membership.members_key is keys.members_key
    assert election.lease_key is keys.lease_key
    assert (measure.PROFILES, measure.LINKS, measure.GROUPS, measure.PINGS) == (
        keys.PROFILES, keys.LINKS, keys.GROUPS, keys.PINGS)


def test_every_kind_with_an_entry_a_peer_is_split_into_buckets_and_read_together():
    for what in keys.BUCKETED:
        k = f"spantrain/s1/{what}.05"
        assert keys.read_together(k) == [f"spantrain/s1/{what}.{b:02d}" for b in range(keys.buckets_of(what))]
    assert keys.read_together("spantrain/s1/stagemap") == ["spantrain/s1/stagemap"]
    import pytest

    with pytest.raises(ValueError):
        keys.measure_key("s1", "members", 0)  # not a measurement
    with pytest.raises(ValueError):
        keys.measure_key("s1", keys.PINGS, keys.MEMBER_BUCKETS)
    assert keys.measure_key("s1", keys.LINKS, 31) == "spantrain/s1/links.31"
    with pytest.raises(ValueError):
        keys.measure_key("s1", keys.LINKS, 32)
