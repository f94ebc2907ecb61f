"""Every DHT key (and subkey) of a swarm, built here and nowhere else (as hivemind's GroupKeyManager).

All keys are ``spantrain/<swarm>/<what>``; each holds a dictionary of signed entries, one per subkey:

- ``members``: peer records, subkey = the peer id (``membership``);
- ``profiles``, ``links``, ``pings``, ``groups``: measurements and grouping votes, subkey = the
  peer id (``measure``);
- ``planner``: the planner's lease, subkey = its term (``election``);
- ``job``: the job record, subkey ``"job"``;
- ``stagemap``: stage maps, subkey = their epoch;
- ``keyreq``, ``groupkey``: a closed swarm's group-key exchange (``group_key``), subkey = the
  peer id asking and the peer id the key is wrapped for; sealed with the swarm key, not the group key.

The strings are part of the protocol: peers of one version must build the same ones.
"""
from __future__ import annotations

# what a measurement key holds (``measure_key(swarm, what)``)
PROFILES, LINKS, GROUPS, PINGS = "profiles", "links", "groups", "pings"
JOB_SUBKEY = "job"


def _key(swarm: str, what: str) -> str:
    return f"spantrain/{swarm}/{what}"


def members_key(swarm: str) -> str:
    """The peer records of ``swarm``, one per peer id."""
    return _key(swarm, "members")


def measure_key(swarm: str, what: str) -> str:
    """Measurements of one kind (PROFILES, LINKS, GROUPS, PINGS), one entry per peer id."""
    return _key(swarm, what)


def lease_key(swarm: str) -> str:
    """The planner's lease claims, one per term (``term_subkey``)."""
    return _key(swarm, "planner")


def job_key(swarm: str) -> str:
    """The swarm's job record, under ``JOB_SUBKEY``."""
    return _key(swarm, "job")


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


def term_subkey(term: int) -> str:
    """The subkey of a lease of ``term``: zero-padded, so subkeys sort as the terms do."""
    return _padded(term)


def epoch_subkey(epoch: int) -> str:
    """The subkey of the stage map of ``epoch``: zero-padded, so subkeys sort as the epochs do."""
    return _padded(epoch)


def _padded(n: int) -> str:
    return f"{n:012d}"
