"""Electing the planner: a lease in the DHT with a term number.

Each claim is a signed entry under ``spantrain/<swarm>/planner``, subkey = the term, holding
``{term, peer_id, expires}``; the DHT entry expires with the lease. The leader is the holder of
the highest unexpired term (for two claims of one term, the better-ranked candidate wins). The
leader renews its lease; when it lapses, candidates claim term + 1 in rank order, each waiting
its turn, so the best live candidate takes over and a stale leader's old term loses everywhere.

The pure functions here decide; ``Election`` only reads and writes the DHT around them.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from .keys import lease_key, term_subkey
from .membership import BadRecordLog
from .records import BadRecord, open_payload, sign_payload

log = logging.getLogger("spantrain.election")


@dataclass(frozen=True)
class Lease:
    term: int
    peer_id: str
    expires: float  # DHT time

    def to_dict(self) -> dict:
        return {"term": self.term, "peer_id": self.peer_id, "expires": self.expires}


CLOSE = 3  # the leader and the candidates that claim first read the lease every tick
FAR_PER_PEER_S = 0.25  # the others every this much a candidate, from two of the key's nodes
FAR_MAX_S = 300.0
FAR_HOLDERS = 2
LEASE_S = 6.0  # the planner's lease: a dead planner's successor claims within it and its slot
RENEWALS = 3  # a live lease is renewed, and read by the close candidates, this many times a lease


def rank(candidates: Iterable[str]) -> list[str]:
    """Candidates in the order they may claim the lease: deterministic, the same on every peer."""
    return sorted(set(candidates))


def current_leader(leases: Iterable[Lease], now: float, candidates: Iterable[str]) -> Optional[Lease]:
    """The valid lease: highest unexpired term; ties broken by candidate rank (then peer id)."""
    order = {p: i for i, p in enumerate(rank(candidates))}
    live = [l for l in leases if l.expires > now]
    if not live:
        return None
    top = max(l.term for l in live)
    return min((l for l in live if l.term == top), key=lambda l: (order.get(l.peer_id, len(order)), l.peer_id))


def highest_term(leases: Iterable[Lease]) -> int:
    return max((l.term for l in leases), default=0)


def claim_delay(peer_id: str, candidates: Iterable[str], lapsed_at: float, now: float, slot_s: float) -> float:
    """Seconds this peer still waits before claiming a lapsed lease (0: its turn has come)."""
    order = rank(candidates)
    if peer_id not in order:
        return float("inf")
    return max(0.0, lapsed_at + order.index(peer_id) * slot_s - now)


def parse_leases(raw: Any, on_bad: Callable[[object, str], None]) -> list[Lease]:
    """Valid leases from the raw DHT dictionary: signed by the peer they name, sane fields."""
    out = []
    if not isinstance(raw, dict):
        return out
    for sub, item in raw.items():
        try:
            signer, d = open_payload(getattr(item, "value", None))
            term, pid, exp = d.get("term"), d.get("peer_id"), d.get("expires")
            if not (isinstance(term, int) and not isinstance(term, bool) and 0 < term < 2**62):
                raise BadRecord("lease term must be a positive int")
            if pid != signer or not isinstance(exp, (int, float)):
                raise BadRecord("lease must be signed by the peer it names")
            if sub != term_subkey(term, pid):
                raise BadRecord("lease stored under another term's or another peer's subkey")
            out.append(Lease(term, pid, float(exp)))
        except BadRecord as e:
            on_bad(sub, str(e))
    return out


class Election:
    """Runs on every peer: keeps ``leader`` up to date, claims or renews the lease when it is its turn."""

    def __init__(self, peer, lease_s: float = LEASE_S, candidates: Callable[[], list[str]] | None = None,
                 on_change: Callable[[Optional[Lease], Optional[Lease]], Any] | None = None,
                 settle_s: Optional[float] = None):
        self.peer = peer
        self.lease_s = lease_s
        # a newcomer watches this long before it may claim: a live leader's lease is readable at
        # any moment (renewed every tick, a third of a lease at most), so this is a few reads of
        # it, not a whole lease (which cost every swarm's start 4 s)
        self.settle_s = lease_s / 3 if settle_s is None else settle_s
        self.leader: Optional[Lease] = None
        self.max_term_seen = 0
        self._candidates = candidates or (lambda: [r.peer_id for r in peer.live_members()])
        self._on_change = on_change
        self._lapsed_at: Optional[float] = None
        self._log_bad = BadRecordLog("lease", log)
        self._first_tick: Optional[float] = None  # a newcomer watches settle_s before it may claim

    @property
    def is_leader(self) -> bool:
        return self.leader is not None and self.leader.peer_id == self.peer.peer_id

    @property
    def watches(self) -> bool:
        """Whether this peer leads or claims first should the leader's lease lapse (the best-ranked
        other candidate): those two act on every join and death, so they read every member's record
        every poll (``membership.read_interval``)."""
        if self.is_leader:
            return True
        others = [p for p in rank(self._candidates()) if self.leader is None or p != self.leader.peer_id]
        return bool(others) and others[0] == self.peer.peer_id

    def watchers(self) -> list[str]:
        """The leader and the candidate that claims first should its lease lapse (``watches``)."""
        lead = [self.leader.peer_id] if self.leader is not None else []
        return lead + [p for p in rank(self._candidates()) if p not in lead][:1]

    async def _read(self, holders: int = 5) -> list[Lease]:
        """The valid leases of members: a lease signed by a peer that is no member (one that never
        joined, say, claiming term 10**9) is not a planner anyone follows. ``holders``: how many of
        the key's nodes are asked."""
        found = await self.peer.dht.get(lease_key(self.peer.config.swarm), latest=True, holders=holders)
        # a member: a peer whose live record this one has seen, with no tombstone or eviction since
        # (``Peer.is_member``), not only those SWIM holds alive now: across a cut link SWIM finds the
        # other side dead in seconds, and a lease its holder still renews is the better word (a
        # standby that took over there re-planned a live island out: the islands' cut-off test, 1 run
        # in 2 under load); a planner that dies loses its lease within lease_s, one that departed at
        # once, and a lease further ahead than two is made up (its holder could block every claim)
        from hivemind.utils import get_dht_time

        swim = getattr(self.peer, "swim", None)
        ahead = get_dht_time() + 2 * self.lease_s
        return [l for l in parse_leases(found.value if found is not None else None, self._log_bad)
                if self.peer.is_member(l.peer_id) and l.expires <= ahead
                and not (swim is not None and swim.swim.departed(l.peer_id))]

    async def _write(self, lease: Lease) -> None:
        value = sign_payload(lease.to_dict(), self.peer.identity)
        await self.peer.dht.store(lease_key(self.peer.config.swarm), value, lease.expires, subkey=term_subkey(lease.term, lease.peer_id))

    async def tick(self) -> Optional[Lease]:
        """One round: read, then renew, claim or wait. Returns the leader as this peer sees it."""
        from hivemind.utils import get_dht_time

        leases = await self._read(holders=5 if self._close() else FAR_HOLDERS)
        now = get_dht_time()
        if self._first_tick is None:
            self._first_tick = now
        cands = self._candidates()
        self.max_term_seen = max(self.max_term_seen, highest_term(leases))
        leader = current_leader(leases, now, cands)
        mine = self.leader is not None and self.leader.peer_id == self.peer.peer_id
        if leader is not None and leader.peer_id == self.peer.peer_id and not (mine and self.leader.term == leader.term):
            # a claim of ours that lost its term's tie, left over when the winner went: one term is
            # one planner, so it lapses (each claimant's lease has a subkey of its own)
            leader = None
        if leader is not None and leader.peer_id == self.peer.peer_id:
            renewed = Lease(leader.term, leader.peer_id, now + self.lease_s)
            await self._write(renewed)
            leader = renewed
        elif leader is None:
            if self._lapsed_at is None:
                self._lapsed_at = now
            settled = now - self._first_tick >= self.settle_s
            if settled and claim_delay(self.peer.peer_id, cands, self._lapsed_at, now, self.lease_s / 3) == 0.0:
                claim = Lease(self.max_term_seen + 1, self.peer.peer_id, now + self.lease_s)
                await self._write(claim)
                leases = await self._read()
                leader = current_leader(leases + [claim], get_dht_time(), cands)
                self.max_term_seen = max(self.max_term_seen, claim.term)
        if leader is not None:
            self._lapsed_at = None
        if (leader and (leader.term, leader.peer_id)) != (self.leader and (self.leader.term, self.leader.peer_id)):
            old, self.leader = self.leader, leader
            if leader is not None:
                who = "this peer" if leader.peer_id == self.peer.peer_id else leader.peer_id[:12] + "…"
                log.info("planner of term %d: %s", leader.term, who)
            if self._on_change is not None:
                self._on_change(old, leader)
        else:
            self.leader = leader
        return leader

    def interval_s(self, base_s: float) -> float:
        """How often this peer reads the lease: where it leads or claims among the first ``CLOSE``
        should the lease lapse, every ``RENEWALS``-th of a lease while a leader holds it (the leader
        renews it then: a live lease outlasts two lost renewals), every ``base_s`` where it sees no
        leader (the claims' slots); else ``FAR_PER_PEER_S`` a candidate, at most ``FAR_MAX_S`` (its
        claim, if ever, comes many slots later anyway). Every ready peer read it every second from
        five nodes: a thousand calls a second at each of them at 1,000 peers (issue 33); the close
        ones, every second through a training run of four peers, made 60 % of its control calls,
        each an RSA signature checked at both ends (issue 31)."""
        if self._close():
            return base_s if self.leader is None else max(base_s, self.lease_s / RENEWALS)
        return max(base_s, min(FAR_MAX_S, FAR_PER_PEER_S * len(self._candidates())))

    def _close(self) -> bool:
        """Whether this peer leads, sees no leader, or claims among the first ``CLOSE`` after it."""
        if self.leader is None or self.is_leader:
            return True
        return self.peer.peer_id in [p for p in rank(self._candidates()) if p != self.leader.peer_id][:CLOSE]

    async def run(self, interval_s: Optional[float] = None) -> None:
        interval = interval_s or self.lease_s / 3
        while True:
            try:
                await self.tick()
            except Exception as e:
                log.warning("election round failed: %s", e)
            # a far candidate's long wait ends early once it is among the close ones (those died)
            wait, far = self.interval_s(interval), not self._close()
            while wait > 0:
                await asyncio.sleep(min(wait, interval))
                wait = 0.0 if far and self._close() else wait - interval
