"""Liveness by direct probes (SWIM), the pure part: who to probe next, what a missed ack or a piece
of news does to the member list, what news to send along (issue 33).

Today's members prove they live by re-storing a DHT record every 2 s, and the planner reads every
record every second: a peer's traffic grows with the swarm (``sim.control_plane``). Here, as in
SWIM (Das, Gupta, Motivala 2002) with Lifeguard's refutation, each peer pings one member each
``probe_s`` in a shuffled round-robin; a ping with no ack within ``ack_s`` is retried through
``indirect`` others; a member still silent is *suspected*, and *dead* ``suspect_s`` later unless
news that it is alive with a newer incarnation arrives first (a suspected member that hears of it
raises its incarnation and says so). News (a member's state and incarnation) rides on pings and
acks, each piece sent ``retransmit_factor * log2(n)`` times by each peer that knows it, fewest-sent
first and news about the receiver itself before any other: a peer's traffic does not grow with the
swarm. ``sim.control_swim`` simulated this design before it was built.

A member is one *life* of a peer (its record's ``instance``, new with every start): a restarted
peer is a new life that replaces a dead one, and news of another life of a live member is taken
only from the member itself (an ack or a ping it sent). News is plain data; whoever passes it on is
authenticated (the data plane's handshake), the news itself is not signed: a member can spread a
false suspicion, which the accused refutes, or a false "alive" of a dead member, which the next
probe of it ends. Everything here is plain data and a clock passed in: ``peer.swim_loop`` runs it.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["ALIVE", "DEAD", "LEFT", "News", "STATES", "SUSPECT", "Swim", "SwimParams", "news_from_wire"]

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)
GONE = (DEAD, LEFT)
MAX_INC = 2 ** 31 - 1


@dataclass(frozen=True)
class SwimParams:
    probe_s: float = 1.0  # one ping sent every this often
    ack_s: float = 0.5  # a direct ping's ack is awaited this long (an indirect one twice as long)
    indirect: int = 3  # members asked to ping a silent one for us
    suspect_s: float = 2.0  # a suspect not heard of alive again is dead this long after
    piggyback: int = 6  # pieces of news on one ping or ack, at most
    retransmit_factor: float = 3.0
    forget_s: float = 60.0  # a dead or departed member's entry is dropped this long after
    # a member's newer record (its state, a measurement's version) passed on as news: only the
    # watchers act on it, and its owner tells them directly (``peer.swim_loop``); spread on the
    # pings as well, at 1,000 peers with links changing once a second swarm-wide, it filled every
    # ping (6 pieces, 0.9 KB) and was most of a peer's control traffic (``sim.control_job``)
    record_news: bool = False
    # a piece's first sends by each peer that passes it on (``Swim.fresh``) go with the member's
    # address, a hint to ping it (two peers that joined at once knew each other by news alone); with
    # every send, at 1,000 peers the addresses were half of a ping's news
    address_sends: int = 2


@dataclass(frozen=True)
class News:
    """One member's state as somebody saw it: ``peer`` id, ``state`` (``STATES``), its incarnation
    ``inc`` (raised by the member itself to refute a suspicion), its ``life`` (record instance),
    and ``rec``, the ``seq`` of its latest DHT record (a reader with an older one reads it again:
    records are not polled)."""
    peer: str
    state: str
    inc: int
    life: str
    rec: int = 0

    def to_wire(self) -> list:
        """``[peer, state code, inc, life, rec]``: the state as its index in ``STATES``, a life of 16
        hex digits (a record instance) as that number: a piece is 62 bytes, not 74 (news is what
        grows with a swarm's churn: ``sim.control_swim``)."""
        return [self.peer, STATES.index(self.state), self.inc, _life_out(self.life), self.rec]


@dataclass
class Member:
    life: str
    state: str = ALIVE
    inc: int = 0
    since: float = 0.0  # when it entered this state (the clock passed in)
    rec: int = 0  # the latest record seq heard of
    # seen in its own signed record or heard from itself (an authenticated connection), not only
    # in others' news: a hostile member can make up ids, not keys (``Swim.live``)
    confirmed: bool = False


def overrides(new: News, old: Member) -> bool:
    """Whether news ``new`` about the same life replaces what is known (SWIM's order): alive
    overrides a lower incarnation; suspect overrides alive of its incarnation or lower, and suspect
    of a lower one; dead and left override what is not gone of their incarnation or lower (a stale
    verdict does not undo a refutation), and are overridden only by alive with a higher one: the
    member's refutation, which only it raises (``Swim.merge``), passed on by others."""
    if new.state == ALIVE:
        return new.inc > old.inc
    if new.state == SUSPECT:
        if old.state == ALIVE:
            return new.inc >= old.inc
        return old.state == SUSPECT and new.inc > old.inc
    return old.state not in GONE and new.inc >= old.inc  # dead or left


# news that raises a known member's incarnation by more than this is refused as made up (a member
# raises its own by one per refutation): a forged suspicion at the top of the range would leave
# its victim no incarnation to refute with
MAX_INC_STEP = 1024
MAX_MEMBERS = 100_000  # members kept, at most
MAX_UNCONFIRMED = 2_000  # of them known only from others' news (made-up ids cost a hostile peer nothing)


@dataclass
class Swim:
    """One peer's member list under the protocol. ``me``/``life``: this peer; ``rng``: the probe
    order's and helpers' randomness (seeded in tests)."""
    me: str
    life: str
    params: SwimParams = field(default_factory=SwimParams)
    rng: random.Random = field(default_factory=random.Random)
    inc: int = 0
    rec: int = 0  # this peer's latest record seq (``record``)
    members: dict[str, Member] = field(default_factory=dict)
    _order: list[str] = field(default_factory=list)
    _sent: dict[str, list] = field(default_factory=dict)  # peer -> [its latest news to pass on, times sent]
    _unconfirmed: int = 0
    fresh: set = field(default_factory=set)  # members whose piece the last ``outgoing`` sent among its first ``address_sends``

    # ---- the member list ---------------------------------------------------------------------
    def live(self) -> list[str]:
        """Confirmed members not known dead or departed (suspects included: they may refute), this
        peer not."""
        return sorted(p for p, m in self.members.items() if m.confirmed and m.state not in GONE)

    def is_live(self, peer: str) -> bool:
        m = self.members.get(peer)
        return m is not None and m.confirmed and m.state not in GONE

    def departed(self, peer: str) -> bool:
        """Whether the life of ``peer`` known here left (said so itself, or news of it did)."""
        m = self.members.get(peer)
        return m is not None and m.state == LEFT

    def gone(self, peer: str, life: str) -> bool:
        """Whether that life of ``peer`` is known dead or departed."""
        m = self.members.get(peer)
        return m is not None and m.life == life and m.state in GONE

    @property
    def unconfirmed(self) -> int:
        """Members known only from others' news (none confirmed them: a ping, an ack, a record)."""
        return self._unconfirmed

    def _put(self, peer: str, m: Member) -> None:
        old = self.members.get(peer)
        self._unconfirmed += (not m.confirmed) - (old is not None and not old.confirmed)
        self.members[peer] = m

    def _drop(self, peer: str) -> None:
        m = self.members.pop(peer)
        self._unconfirmed -= not m.confirmed

    def _confirm(self, peer: str, life: str) -> bool:
        m = self.members.get(peer)
        if m is None or m.life != life or m.confirmed:
            return False
        m.confirmed = True
        self._unconfirmed -= 1
        return True

    def _room(self, confirmed: bool) -> bool:
        return len(self.members) < MAX_MEMBERS and (confirmed or self._unconfirmed < MAX_UNCONFIRMED)

    def add(self, peer: str, life: str, now: float) -> bool:
        """A member seen in its signed record (a read of the member keys): added alive where unknown
        or where the entry is of another life that is gone (a restart), confirmed where known; a
        record of a gone life does not revive it. Whether the list of live members changed."""
        if peer == self.me:
            return False
        m = self.members.get(peer)
        if m is not None and (m.life == life or m.state not in GONE):
            return self._confirm(peer, life) and m.state not in GONE
        if not self._room(True):
            return False
        self._put(peer, Member(life, ALIVE, 0, now, confirmed=True))
        return True

    def hear(self, peer: str, life: str, inc: int, rec: int, now: float) -> None:
        """A member from another's list (a joiner's start): kept unconfirmed where unknown, not news."""
        if peer != self.me and peer not in self.members and self._room(False):
            self._put(peer, Member(life, ALIVE, inc, now, rec))

    # ---- probing -----------------------------------------------------------------------------
    def next_target(self) -> Optional[str]:
        """The member to ping now: each member not gone once per round (unconfirmed ones too: an
        ack confirms them), in an order shuffled anew every round (so every member is probed within
        two rounds, and nobody learns the order)."""
        while self._order:
            p = self._order.pop()
            if p in self.members and self.members[p].state not in GONE:
                return p
        self._order = [p for p, m in self.members.items() if m.state not in GONE]
        self.rng.shuffle(self._order)
        return self._order.pop() if self._order else None

    def helpers(self, target: str, usable=lambda p: True) -> list[str]:
        """Up to ``indirect`` other live members (``usable``: that this peer can reach) to ping
        ``target`` for us."""
        others = [p for p in self.live() if p != target and self.members[p].state == ALIVE and usable(p)]
        return self.rng.sample(others, min(self.params.indirect, len(others)))

    def acked(self, peer: str, life: str, inc: int, now: float, rec: int = 0) -> list[News]:
        """``peer`` answered (an ack, or a ping it sent us) as ``life`` with incarnation ``inc`` and
        record ``rec``: its own word, so it may also be a new life, and it is confirmed. Where this
        peer holds that life dead at that incarnation or later, the verdict goes back to it (first
        on the ack or the next message to it), so that it refutes. The changes (news to pass on)."""
        m = self.members.get(peer)
        if m is not None and m.life == life and m.state in GONE and inc <= m.inc:
            self._spread(News(peer, m.state, m.inc, m.life, m.rec))
            return []
        out = self.merge([News(peer, ALIVE, inc, life, rec)], now, sender=peer)
        if self._confirm(peer, life) and not out:
            out = [News(peer, ALIVE, inc, life, rec)]  # newly among the live members, though known
        return out

    def missed(self, peer: str, now: float) -> list[News]:
        """Neither ``peer`` nor any helper answered: it is suspected (news)."""
        m = self.members.get(peer)
        if m is None or m.state != ALIVE:
            return []
        return self.merge([News(peer, SUSPECT, m.inc, m.life, m.rec)], now)

    def tick(self, now: float) -> list[News]:
        """Suspects not cleared within ``suspect_s`` are dead (news); gone entries, and entries
        nobody confirmed, older than ``forget_s`` are dropped (a record of theirs still in the DHT
        may re-add them: a dead life is kept as long as a record lives, ``forget_s``)."""
        out = []
        for p, m in list(self.members.items()):
            if m.state == SUSPECT and now - m.since >= self.params.suspect_s:
                out += self.merge([News(p, DEAD, m.inc, m.life, m.rec)], now)
            elif (m.state in GONE or not m.confirmed) and now - m.since >= self.params.forget_s:
                self._drop(p)
                self._sent.pop(p, None)
        return out

    def leave(self) -> News:
        """This peer's goodbye (news, to send to a few members)."""
        return self._spread(News(self.me, LEFT, self.inc, self.life, self.rec))

    def record(self, seq: int) -> News:
        """This peer stored a new record (``seq``), which its every message says from now on (``rec``);
        news passed on where it is the life's first (its join) or ``params.record_news``."""
        first, self.rec = self.rec == 0, max(self.rec, seq)
        n = News(self.me, ALIVE, self.inc, self.life, self.rec)
        return self._spread(n) if first or self.params.record_news else n

    # ---- news --------------------------------------------------------------------------------
    def merge(self, news: list[News], now: float, sender: str = "") -> list[News]:
        """Applies pieces of news (from ``sender``, "" for this peer's own findings); returns those
        that changed the list (each also queued to pass on). News about this peer that it is
        suspected or dead is refuted: a higher incarnation, queued as alive."""
        changed = []
        for n in news:
            if n.peer == self.me:
                if n.life == self.life and n.state != ALIVE and self.inc <= n.inc <= self.inc + MAX_INC_STEP:
                    self.inc = min(MAX_INC, n.inc + 1)
                    self._spread(News(self.me, ALIVE, self.inc, self.life, self.rec))
                continue
            m = self.members.get(n.peer)
            own = sender == n.peer
            if m is None:  # a join (or the end of a member this peer never saw: kept, so that its
                if not self._room(own):  # record does not revive it)
                    continue
                self._put(n.peer, Member(n.life, n.state, n.inc, now, n.rec, confirmed=own))
            elif m.life != n.life:  # another life: a restart where the known one is gone, or the
                if n.state in GONE or (m.state not in GONE and not own):  # member's own word
                    continue
                self._put(n.peer, Member(n.life, n.state, n.inc, now, n.rec, confirmed=own))
            elif n.inc > m.inc + MAX_INC_STEP:
                continue  # made up
            elif overrides(n, m):
                m.state, m.inc, m.since, m.rec = n.state, n.inc, now, max(m.rec, n.rec)
            elif n.rec > m.rec and m.state not in GONE:  # a newer record of a member as it was
                m.rec = n.rec
                n = News(n.peer, m.state, m.inc, m.life, n.rec)
                if not self.params.record_news:  # a change (a watcher reads it), not passed on
                    changed.append(n)
                    continue
            else:
                continue
            changed.append(self._spread(n))
        return changed

    def _spread(self, n: News) -> News:
        self._sent.pop(n.peer, None)  # newer news of a member replaces older, and goes last in line
        self._sent[n.peer] = [n, 0]
        return n

    def outgoing(self, to: str) -> list[News]:
        """News for a ping or ack to ``to``: news about ``to`` first (a suspect hears of it and
        refutes), then the least-sent, the newest first among those, at most ``piggyback``; each
        sent at most ``retransmit_factor * log2(n + 2)`` times, then dropped. This peer's own state
        comes along with every message anyway (``inc`` and ``life`` in the header)."""
        limit = max(1, math.ceil(self.params.retransmit_factor * math.log2(len(self.members) + 2)))
        pick = sorted(reversed(self._sent.values()), key=lambda e: (e[0].peer != to, e[1]))[: self.params.piggyback]
        self.fresh = {e[0].peer for e in pick if e[1] < self.params.address_sends}
        for e in pick:
            e[1] += 1
            if e[1] >= limit:
                del self._sent[e[0].peer]
        return [e[0] for e in pick]


def _life_out(life: str) -> "str | int":
    return int(life, 16) if len(life) == 16 and all(c in "0123456789abcdef" for c in life) else life


MAX_NEWS = 16  # pieces of news one message may carry (``SwimParams.piggyback`` is what we send)
MAX_NAME = 128  # bytes of a peer id or a life


def news_from_wire(items: object) -> list[News]:
    """News from a message's ``news`` field (untrusted): a list of at most ``MAX_NEWS`` entries
    ``News.to_wire`` made; ValueError naming what is wrong."""
    if not isinstance(items, list) or len(items) > MAX_NEWS:
        raise ValueError(f"news must be a list of at most {MAX_NEWS} entries")
    out = []
    for it in items:
        if not isinstance(it, list) or len(it) != 5:
            raise ValueError("a piece of news is [peer, state, incarnation, life, record seq]")
        peer, state, inc, life, rec = it
        check_name(peer, "peer")
        if isinstance(life, int) and not isinstance(life, bool) and 0 <= life < 2 ** 64:
            life = f"{life:016x}"
        check_name(life, "life")
        if not isinstance(state, int) or isinstance(state, bool) or not 0 <= state < len(STATES):
            raise ValueError(f"a state is a code 0-{len(STATES) - 1}, not {str(state)[:20]!r}")
        state = STATES[state]
        check_inc(inc)
        check_inc(rec)
        out.append(News(peer, state, inc, life, rec))
    return out


def check_name(v: object, what: str) -> None:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME:
        raise ValueError(f"{what} must be a string of 1-{MAX_NAME} characters")


def check_inc(v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_INC:
        raise ValueError(f"an incarnation is an int in 0..{MAX_INC}")
