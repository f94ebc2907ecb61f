"""Every DHT key (and subkey) of a swarm, built here and nowhere else (as hivemind's GroupKeyManager).

All keys are ``spantrain/<swarm>/<what>``; each holds a dictionary of signed entries, one per subkey:

- ``members.00`` .. ``members.07``: peer records, subkey = the peer id, each in the bucket its id
  hashes to (``member_bucket``): no key's value holds the whole swarm (``membership``);
- ``profiles.00`` .. ``.15``, ``links.00`` .. ``.31``, ``pings.*``, ``groups.*``, ``accuse.*`` (8
  each): measurements, grouping votes and accusations, subkey = the peer id, in its bucket's key as
  member records (``measure``, ``buckets_of``);
- ``planner``: the planner's lease, subkey = its term and the claimant (``election``);
- ``job.00`` .. ``job.15``: the job record, one copy per member that runs it, subkey = that
  member's peer id, in its bucket's key;
- ``stagemap``: stage maps, subkey = their epoch and the planner that signed it;
- ``keyreq``, ``groupkey``: a closed swarm's group-key exchange (``group_key``), subkey = the
  peer id asking, and the peer id the key is wrapped for with the wrapper's; sealed with the swarm
  key, not the group key.

Every subkey names the peer that owns it: the peer id itself, or as its last ``/`` part
(``owned``). The swarm's record validator (``validator``) refuses a value stored under a subkey
its storer does not own.

The strings are part of the protocol: peers of one version must build the same ones.
"""
from __future__ import annotations

import hashlib

# what a measurement key holds (``measure_key(swarm, what, bucket)``)
PROFILES, LINKS, GROUPS, PINGS = "profiles", "links", "groups", "pings"
ACCUSE = "accuse"  # the peers a replica convicted of attacking the job (``train.defence``)


def _key(swarm: str, what: str) -> str:
    return f"spantrain/{swarm}/{what}"


# Member records are split over this many keys by peer id (issue 33). One key held every record
# (~1.5 KB each): at 1,000 peers a 1.4 MB value, read whole by every reader, and every member's
# heartbeat stored on the same five nodes. Eight keys keep a value under 256 KiB to about 1,400
# peers and spread the heartbeats over forty nodes; a read of them all asks each node it picks once
# for all the keys it holds (``holders.pick``), so a small swarm's read is no more calls than before.
MEMBER_BUCKETS = 8


def bucket_of(peer_id: str, buckets: int = MEMBER_BUCKETS) -> int:
    """Which of ``buckets`` keys of a kind holds ``peer_id``'s entry."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % buckets


def member_bucket(peer_id: str) -> int:
    """Which of the ``MEMBER_BUCKETS`` member keys holds ``peer_id``'s record."""
    return bucket_of(peer_id, MEMBER_BUCKETS)


# Every key with one entry per peer is split the same way (issue 33): at 1,000 peers the link
# probes (about 10 links a peer) were a 2 MB value in one key, the profiles and the job's copies
# about 1 MB each, over the 256 KiB a value may have and read whole by every reader.
BUCKETED = ("members", PROFILES, LINKS, PINGS, GROUPS, ACCUSE, "job")
# The entries of a kind go in as many keys as keep each under 256 KiB to about 2,000 peers: a peer's
# links (about 10 probes, 3.1 KB with its signatures) in 32, its profile (1.6 KB) and its copy of the
# job (1.8 KB) in 16 (in 8, the fullest job key held 255 KiB at 1,000 peers, sim.join_path); member
# records (1.45 KB) stay in 8 (202 KiB at 1,000) and the small kinds too
BUCKETS = {LINKS: 32, PROFILES: 16, "job": 16}


def buckets_of(what: str) -> int:
    """How many keys the entries of kind ``what`` are split over."""
    return BUCKETS.get(what, MEMBER_BUCKETS)


def _bucketed(swarm: str, what: str, bucket: int) -> str:
    n = buckets_of(what)
    if not 0 <= bucket < n:
        raise ValueError(f"{what} bucket {bucket} is not in 0..{n - 1}")
    return f"{_key(swarm, what)}.{bucket:02d}"


def members_key(swarm: str, bucket: int) -> str:
    """The peer records of ``swarm`` whose ids hash to ``bucket``, one per peer id."""
    return _bucketed(swarm, "members", bucket)


def members_keys(swarm: str) -> list[str]:
    """Every member key of ``swarm``, by bucket."""
    return [members_key(swarm, b) for b in range(MEMBER_BUCKETS)]


def read_together(dht_key: str) -> list[str]:
    """The keys read with ``dht_key`` in one go: every bucket of a bucketed key's kind (8, 16 or 32:
    ``buckets_of``; their nodes are looked up together, so a heartbeat's store does not look up its
    own bucket's nodes apart from the reads' lookup of them all), else the key alone."""
    head, _, tail = dht_key.rpartition(".")
    kind = head.rsplit("/", 1)[-1]
    if kind in BUCKETED and len(tail) == 2 and tail.isdigit():
        return [f"{head}.{b:02d}" for b in range(buckets_of(kind))]
    return [dht_key]


def member_key_of(swarm: str, peer_id: str) -> str:
    """The member key ``peer_id``'s record is stored under."""
    return members_key(swarm, member_bucket(peer_id))


def measure_key(swarm: str, what: str, bucket: int) -> str:
    """Measurements of one kind (PROFILES, LINKS, GROUPS, PINGS, ACCUSE) of the peers whose ids hash
    to ``bucket``, one entry per peer id."""
    if what not in BUCKETED or what in ("members", "job"):
        raise ValueError(f"no measurements of kind {what!r}")
    return _bucketed(swarm, what, bucket)


def measure_keys(swarm: str, what: str, peer_ids=None) -> list[str]:
    """The keys of measurements ``what``: every bucket's, or those of ``peer_ids``."""
    n = buckets_of(what)
    if peer_ids is None:
        return [measure_key(swarm, what, b) for b in range(n)]
    return [measure_key(swarm, what, b) for b in sorted({bucket_of(p, n) for p in peer_ids})]


def measure_key_of(swarm: str, what: str, peer_id: str) -> str:
    """The key ``peer_id``'s measurements ``what`` are stored under."""
    return measure_key(swarm, what, bucket_of(peer_id, buckets_of(what)))


def lease_key(swarm: str) -> str:
    """The planner's lease claims, one per term (``term_subkey``)."""
    return _key(swarm, "planner")


def job_key(swarm: str, bucket: int) -> str:
    """The swarm's job record: the signed copies of the members whose ids hash to ``bucket``, each
    under its own peer id."""
    return _bucketed(swarm, "job", bucket)


def job_keys(swarm: str) -> list[str]:
    return [job_key(swarm, b) for b in range(buckets_of("job"))]


def job_key_of(swarm: str, peer_id: str) -> str:
    return job_key(swarm, bucket_of(peer_id, buckets_of("job")))


def stagemap_key(swarm: str) -> str:
    """The published stage maps, one per epoch (``epoch_subkey``)."""
    return _key(swarm, "stagemap")


KEY_EXCHANGE = ("keyreq", "groupkey")


def keyreq_key(swarm: str) -> str:
    """Requests for the group key, one per asking peer id."""
    return _key(swarm, KEY_EXCHANGE[0])


def groupkey_key(swarm: str) -> str:
    """The group key wrapped for one member each, subkey = that member's peer id."""
    return _key(swarm, KEY_EXCHANGE[1])


def is_key_exchange(dht_key: str) -> bool:
    """Whether ``dht_key`` belongs to the group-key exchange (sealed with the swarm key itself)."""
    return dht_key.startswith("spantrain/") and dht_key.rsplit("/", 1)[-1] in KEY_EXCHANGE


def owned(prefix: str, peer_id: str) -> str:
    """A subkey that belongs to ``peer_id``: only that peer may store under it."""
    return f"{prefix}/{peer_id}"


def term_subkey(term: int, peer_id: str) -> str:
    """The subkey of ``peer_id``'s lease of ``term``: zero-padded, so subkeys sort as terms do."""
    return owned(_padded(term), peer_id)


def epoch_subkey(epoch: int, peer_id: str) -> str:
    """The subkey of the stage map of ``epoch`` signed by ``peer_id``: sorts as epochs do."""
    return owned(_padded(epoch), peer_id)


def wrap_subkey(recipient: str, wrapper: str) -> str:
    """The subkey of the group key wrapped for ``recipient`` by member ``wrapper``."""
    return owned(recipient, wrapper)


def _padded(n: int) -> str:
    return f"{n:012d}"
