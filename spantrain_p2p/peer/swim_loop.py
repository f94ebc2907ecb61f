"""Liveness by direct probes on the data plane (``--liveness swim``, issue 33): ``swarm.swim``'s
member list, run by a peer.

Each ``probe_s`` the peer pings one member (message kind ``swim``, op ``ping``) with news on it; a
member that does not ack within ``ack_s`` is pinged through up to ``indirect`` others (op ``req``:
"ping it for me"), and suspected if none of them reaches it either. The news that a member died or
left goes straight to the swarm's watchers too (the two lowest peer ids: the first in the
election's rank, ``membership.watchers``), so the planner's view loses it within a probe round
and ``suspect_s``; everybody else hears it on the pings. Every message carries its sender's
incarnation, life, data-plane address and the ``seq`` of its latest record; a peer that stores a
new record tells the watchers at once. The watchers read a record they hear is newer than theirs
(its one member key, at most one read a poll); nobody polls the member keys, and the others read
records only when they need them (a stage map's peers), so a peer's control traffic does not grow
with the swarm. ``GET /swim`` shows the member list.

The peer's view (``Peer._view``, from the DHT records) keeps what SWIM does not know dead: a dead
member's record stays in the DHT for its lifetime (a few minutes: records are re-stored only when
they change or every ``record_s``, ``Peer._heartbeat_loop``) and is left out of every read.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Optional

import msgpack

from ..net import framing
from ..net.wire import RemoteError
from ..swarm import membership
from ..swarm.deltas import Held, Sent
from ..swarm.measure import MAX_BYTES as MEASURE_MAX_BYTES, VERSIONED, versions_changed
from ..swarm.records import BadRecord, open_payload, open_record
from ..swarm.swim import ALIVE, GONE, LEFT, MAX_NEWS, SUSPECT, News, Swim, SwimParams
from . import member_view, swim_wire as wire
from .swim_wire import KIND, MAX_ASK, MAX_LIST, VERSION

log = logging.getLogger("spantrain.peer")

# a key's nearest nodes, looked up again after this long (at once where one does not answer or a
# nearer node is known, ``guard``): every lookup of a key ends at its nodes, and at 1,000 idle peers
# looking up the job key's every minute they were the busiest nodes by far (``sim.control_swim``)
HOLDERS_TTL_S = 600.0
MAX_SENT_RECORD = 16 << 10  # bytes of a record sent in a news message (``records.MAX_RECORD_BYTES`` and its key)
MAX_SENT_MEASURED = 64 << 10  # bytes of a measurement entry sent with it
# misses before an address from another's list (or of a member nobody vouched for) is dropped: dropped
# at the first, a ping that met a loaded box lost two joiners each other's only address (news carries
# it on a piece's first sends alone), and they were never confirmed (the 8-peer test, about 1 run in 8)
HINT_TRIES = 3
MAX_UNTOLD = 64  # watchers that missed this peer's latest record, sent it again later (``_tell_untold``)
UNTOLD_ROUNDS = 5
MAX_URLS = 100_000  # members' addresses kept, at most (a made-up sender per connection cannot grow it past this)


class SwimLoop:
    def __init__(self, peer, params: SwimParams):  # peer: node.Peer (not imported: node imports this)
        self.peer = peer
        self.params = params
        self.swim = Swim(peer.peer_id, peer.instance, params)
        self._to_read: set[str] = set()  # members whose record a watcher reads next poll
        self.sent, self.held = Sent(), Held()  # measurements sent again as changes (``swarm.deltas``)
        self._untold: dict[str, dict] = {}  # watcher -> this peer's latest record it missed (``tell_watchers``)
        self._read_wake = asyncio.Event()
        self.urls: dict[str, str] = {}  # data-plane address of members, in their own words (their pings)
        self.hinted: set[str] = set()  # members whose address came from another's list, not their own word
        self._misses: dict[str, int] = {}  # such addresses' failed pings so far (``probe``; HINT_TRIES)
        self.full_view = False  # a watcher has read every record since it began to watch (member_view)
        self._running = False
        self._signed: Optional[dict] = None  # this peer's latest signed record
        self._told = None  # the record (``PeerRecord``) last told of: who a new one goes to (``stored``)
        self.records_taken = 0  # members' records taken as they sent them (not read from the DHT)
        self._mine: set[str] = set()  # members this peer suspected (their deaths it tells the watchers)

    # ---- the view ---------------------------------------------------------------------------------
    def filter(self, view: dict) -> dict:
        """A read's records less the lives SWIM knows dead or departed; the rest join the list."""
        now = time.monotonic()
        out = {}
        for pid, rec in view.items():
            if pid != self.peer.peer_id and rec.alive and self.swim.gone(pid, rec.instance):
                continue
            if rec.alive:
                self.swim.add(pid, rec.instance, now)
            out[pid] = rec
        return out

    def _apply(self, changes: list[News]) -> None:
        """Changes of the member list into the view: a dead or departed life out of it at once; a
        member whose record is newer than the view's is read soon by a watcher (the planner and its
        standby) or by a peer that follows it (``Peer.followed``: a done peer waits for its stage map's
        peers to be done), not by the others: they read a record when they need it (a stage map's peer)."""
        view, dropped = self.peer._view, False
        watching, followed = self.peer.watching(), self.peer.followed
        for n in changes:
            rec = view.get(n.peer)
            if n.state in GONE:
                if rec is not None and rec.alive and rec.instance == n.life:
                    log.info("peer %s %s", membership.describe(rec, n.peer), "left" if n.state == LEFT else "died")
                    member_view.note_views(self.peer, (), [rec])
                    del view[n.peer]
                    dropped = True
            elif (watching or n.peer in followed) and (rec is None or rec.instance != n.life or rec.seq < n.rec):
                self._to_read.add(n.peer)
                self._read_wake.set()
        if dropped:
            self.peer._view_changed.set()

    # ---- messages ---------------------------------------------------------------------------------
    def url_of(self, peer_id: str) -> Optional[str]:
        """Where to ping a member: its record's data plane (a record of the life SWIM knows), else
        what it said in its own messages."""
        rec, m = self.peer._view.get(peer_id), self.swim.members.get(peer_id)
        if rec is not None and rec.alive and rec.data_url and (m is None or m.life == rec.instance):
            return rec.data_url
        return self.urls.get(peer_id) or self.peer.last_data_url(peer_id)

    def _learn_url(self, peer_id: str, url: str, hint: bool = False) -> None:
        if hint and peer_id in self.urls:
            return
        if peer_id not in self.urls and len(self.urls) >= MAX_URLS:  # the oldest makes room
            self._forget_url(next(iter(self.urls)))
        self.urls.pop(peer_id, None)
        self.urls[peer_id] = url
        (self.hinted.add if hint else self.hinted.discard)(peer_id)

    def _forget_url(self, peer_id: str) -> None:
        """Drops the address kept for ``peer_id``, with what was known of it (a hint, its misses)."""
        self.urls.pop(peer_id, None)
        self.hinted.discard(peer_id)
        self._misses.pop(peer_id, None)

    def _prune_urls(self) -> None:
        for p in [p for p in self.urls if p not in self.swim.members]:  # forgotten members
            self._forget_url(p)

    def page(self) -> dict:
        """``GET /swim``: this peer's member list under SWIM (``state``, ``inc``, ``confirmed``: seen
        in its record or heard from itself, not only of; ``address``: where it is pinged is known,
        ``hint``: from another's word), its own incarnation."""
        return {"inc": self.swim.inc, "rec": self.swim.rec,
                "members": {p: {"state": m.state, "inc": m.inc, "confirmed": m.confirmed,
                                "address": self.url_of(p) is not None, "hint": p in self.hinted}
                            for p, m in self.swim.members.items()}}

    def _header(self, op: str, to: str, asked: list = (), **extra) -> dict:
        head = getattr(self.peer, "map_head", None)
        news = self.swim.outgoing(to)
        # the addresses of the members news says are alive: two peers that joined at once know each
        # other by news alone, and neither pinged the other (never confirmed: the 8-peer test)
        urls = {n.peer: u for n in news if n.state == ALIVE and n.peer != to and n.peer in self.swim.fresh
                and (u := self.url_of(n.peer))}  # (with a piece's first sends only: ``SwimParams.address_sends``)
        if asked:  # an ack: the addresses its receiver asked for, as far as they fit
            for p in asked:
                if len(urls) >= MAX_NEWS:
                    break
                if p != to and p not in urls and (m := self.swim.members.get(p)) is not None and m.state not in GONE \
                        and (u := self.url_of(p)):
                    urls[p] = u
        ask = self._addressless(to) if op != "ack" else []
        return {"v": VERSION, "op": op, "inc": self.swim.inc, "life": self.swim.life, "rec": self.swim.rec,
                "url": self.peer.dataplane.url, "news": [n.to_wire() for n in news], **extra,
                **({"map": list(head)} if head is not None else {}), **({"urls": urls} if urls else {}),
                **({"ask": ask} if ask else {})}

    def _addressless(self, to: str) -> list[str]:
        """Members this peer knows by news alone and has no address of (up to ``MAX_ASK``), asked of
        ``to`` on a message: news carries an address on a piece's first sends only, and two peers that
        heard of each other later held each other unconfirmed for good, neither able to ping the other
        (the 8-peer test, 2 runs in 16 on 2026-11-28)."""
        if self.swim.unconfirmed <= 0:  # (the usual case: no scan)
            return []
        out = [p for p, m in self.swim.members.items()
               if not m.confirmed and m.state not in GONE and p != to and self.url_of(p) is None]
        # a random few: made-up ids in news (nobody has their address) must not crowd out the real ones
        return out if len(out) <= MAX_ASK else self.swim.rng.sample(out, MAX_ASK)

    def _hint_urls(self, urls: dict) -> None:
        """Addresses of members this peer knows by news alone, as the sender gave them: hints (a
        ping there that fails is no evidence, ``probe``). Taken after the message's news, which may
        be how this peer first hears of the member (a piece goes with its address on its first
        sends only: ``SwimParams.address_sends``)."""
        for p, u in urls.items():
            m = self.swim.members.get(p)
            if m is not None and not m.confirmed and m.state not in GONE and self.url_of(p) is None:
                self._learn_url(p, u, hint=True)

    def _hear_map(self, header: dict) -> None:
        """The (term, epoch, job) of the stage map the sender follows, where it says: a peer hearing of a
        newer one than its own reads the map key (``RunRecords.heard_head``), so a map's news spreads
        with the pings and no peer polls the key (issue 33). Hearsay: a made-up head costs its hearers
        one read each, at most one per ``run_records.HEARSAY_GAP_S``."""
        head, hear = wire.map_head(header), getattr(self.peer, "on_map_head", None)
        if hear is not None and head is not None:
            hear(*head)

    async def handle(self, header: dict, buffers: list) -> tuple[dict, list]:
        life, inc, rec, news = wire.read(header)
        self._hear_map(header)
        hints, asked = wire.urls_of(header), wire.asked(header)
        with_record = header["op"] == "news" and header.get("record") is True
        kinds = header.get("measured", []) if with_record else []
        if not isinstance(kinds, list) or not all(isinstance(k, str) and k in VERSIONED for k in kinds) \
                or len(set(kinds)) != len(kinds):
            raise framing.FrameError(f"a record's measurements are some of {', '.join(VERSIONED)}")
        if len(buffers) != (1 + len(kinds) if with_record else 0) or (with_record and buffers[0].nbytes > MAX_SENT_RECORD) \
                or any(b.nbytes > MAX_SENT_MEASURED for b in buffers[1:]):
            raise framing.FrameError("a swim message carries no buffers but a news message's record and its measurements")
        src, now, lacks = header["src"], time.monotonic(), []
        self._learn_url(src, header["url"])
        size = wire.size(header) + sum(b.nbytes for b in buffers)
        # the sender's own word first (a joiner's first ping adds it), then what it heard
        self._apply(self.swim.acked(src, life, inc, now, rec) + self.swim.merge(news, now, sender=src))
        self._hint_urls(hints)
        if with_record:
            try:  # the sender's own signed record, sent to the watchers when it changes
                record = open_record(src, msgpack.unpackb(bytes(buffers[0]), raw=False, max_array_len=16,
                                                          max_map_len=16, max_str_len=MAX_SENT_RECORD))
            except BadRecord as e:
                raise framing.FrameError(f"the record sent is refused: {e}") from None
            except Exception as e:
                raise framing.FrameError(f"the record sent is not msgpack ({e.__class__.__name__})") from None
            if record.instance == life and not self.swim.gone(src, life):
                self.peer.take_records({src: record})
                self.records_taken += 1
                lacks = self._take_measured(src, kinds, buffers[1:])
        ok, buffers_out = True, []
        if header["op"] == "list":
            buffers_out = [msgpack.packb(self._list(src), use_bin_type=True)]
        if header["op"] == "req":
            target = header.get("target")
            if not isinstance(target, str) or target not in self.swim.members or target == src:
                raise framing.FrameError("a req names a member to ping, not the sender")
            ok = await self._ping(target, self.params.ack_s)
        reply = self._header("ack", src, asked, ok=ok, **({"lacks": lacks} if lacks else {}))
        self.peer.control.tally(True, header["op"], KIND, size, wire.size(reply) + sum(len(b) for b in buffers_out))
        return reply, buffers_out

    def _take_measured(self, src: str, kinds: list, buffers: list) -> list[str]:
        """A member's new measurement entries, sent with its record, whole or as the change to the
        last one taken (``swarm.deltas``): each must be signed by it. Returns the kinds sent as a
        change of an entry not held (where this peer takes them: its coordinator's)."""
        take, lacks = getattr(self.peer, "on_measured", None), []
        for kind, buf in zip(kinds, buffers):
            try:
                value = self.held.whole(src, kind, msgpack.unpackb(
                    bytes(buf), raw=False, max_array_len=16, max_map_len=16, max_str_len=MAX_SENT_MEASURED,
                    max_bin_len=MAX_SENT_MEASURED), MAX_SENT_MEASURED)  # rebuilt: no larger than one sent whole
                if value is None:
                    if take is not None:
                        lacks.append(kind)
                    continue
                signer, payload = open_payload(value, MEASURE_MAX_BYTES)
            except (BadRecord, ValueError) as e:
                raise framing.FrameError(f"the {kind} sent is refused: {e}") from None
            except Exception as e:
                raise framing.FrameError(f"the {kind} sent is not msgpack ({e.__class__.__name__})") from None
            if signer != src:
                raise framing.FrameError(f"the {kind} sent is signed by {signer[:16]}, not its sender")
            if take is not None:
                self.held.keep(src, kind, value)
                take(src, kind, payload)
        return lacks

    def _list(self, to: str) -> list:
        """This peer's live members with their addresses (itself included, ``to`` not): a joiner's start."""
        out = [[self.peer.peer_id, "alive", self.swim.inc, self.swim.life, self.peer.dataplane.url, self.swim.rec]]
        for p, m in self.swim.members.items():
            url = self.url_of(p)
            if m.state not in GONE and p != to and url and len(out) < MAX_LIST:
                out.append([p, m.state, m.inc, m.life, url, m.rec])
        return out

    async def fetch_list(self) -> None:
        """A joiner's member list: asked of a member it read (the first that answers of up to three);
        the addresses in it are hints (a member that does not answer at one is not suspected)."""
        me = self.peer.peer_id
        asked = [r.peer_id for r in self.peer.live_members() if r.peer_id != me]
        for p in random.sample(asked, min(3, len(asked))):
            got = await self._send(p, "list", 10.0, want_buffers=True)
            if not got or "_buffers" not in got:
                continue
            try:
                entries = wire.list_from_wire(got["_buffers"])
            except ValueError as e:
                log.warning("member list from %s refused: %s", p[:12], e)
                continue
            now = time.monotonic()
            for peer, state, inc, life, url, rec in entries:
                if peer != me and state == "alive":  # a suspicion is for us to find, not to take
                    self._learn_url(peer, url, hint=True)
                    self.swim.hear(peer, life, inc, rec, now)  # unconfirmed, and no news to pass on
            return

    async def _send(self, to: str, op: str, timeout: float, want_buffers: bool = False, shaped: bool = True,
                    whole: bool = False, **extra) -> Optional[dict]:
        """One message to ``to`` and its ack's header (its sender's word taken), or None; with
        ``want_buffers`` the reply's buffers under ``_buffers``; not ``shaped``: past the emulated link."""
        url = self.url_of(to)
        if url is None:
            return None
        signed, measured = extra.pop("record", None), extra.pop("measured", None) or {}
        # the measurements with the record (as changes where ``to`` took the last: ``swarm.deltas``), each
        # within what a receiver takes (a larger one: read from the DHT)
        packed = {w: b for w, v in measured.items()
                  if len(b := msgpack.packb(v if whole else self.sent.wire(to, w, v), use_bin_type=True)) <= MAX_SENT_MEASURED} \
            if signed is not None else {}
        header = self._header(op, to, **extra, **({"record": True} if signed is not None else {}),
                              **({"measured": list(packed)} if packed else {}))
        sent = [msgpack.packb(signed, use_bin_type=True), *packed.values()] if signed is not None else []
        reply, buffers, hints = None, [], {}
        try:
            got = await asyncio.wait_for(self.peer.client.send(
                url, KIND, header, sent, timeout=timeout, link=self.peer.link_to(to) if shaped else None, peer_id=to),
                timeout)
            reply, buffers = got if got else (None, [])
            life, inc, rec, news = wire.read(reply, ("ack",)) if reply else (None, 0, 0, [])
            if reply:
                self._hear_map(reply)
                hints = wire.urls_of(reply)
        except (OSError, asyncio.TimeoutError, framing.FrameError, ValueError) as e:
            log.debug("swim %s to %s: %s", op, to[:12], e)
            reply = None
        except RemoteError as e:  # refused (it does not know us yet, a budget): alive, no word
            log.debug("swim %s to %s refused: %s", op, to[:12], e)
            self.peer.control.tally(False, op, KIND, wire.size(header) + sum(map(len, sent)), 0, False)
            return {}
        except Exception as e:
            log.warning("swim %s to %s: %s", op, to[:12], e)
            reply = None
        self.peer.control.tally(False, op, KIND, wire.size(header) + sum(map(len, sent)),
                                wire.size(reply) + sum(b.nbytes for b in buffers) if reply else 0, reply is not None)
        if reply is None:
            return None
        now = time.monotonic()
        self._learn_url(to, reply["url"])
        self._apply(self.swim.acked(to, life, inc, now, rec) + self.swim.merge(news, now, sender=to))
        self._hint_urls(hints)
        if packed:
            said = reply.get("lacks")
            lacks = [w for w in packed if isinstance(said, list) and w in said]
            for w in packed:
                if w in lacks:
                    self.sent.lacked(to, w)
                else:
                    self.sent.acked(to, w, measured[w])
            if lacks and not whole:  # it holds no entry to rebuild these from: once more, whole (once)
                return await self._send(to, op, timeout, want_buffers, shaped, whole=True, record=signed,
                                        measured={w: measured[w] for w in lacks}, **extra)
        return {**reply, "_buffers": buffers} if want_buffers else reply

    async def _ping(self, target: str, timeout: float) -> bool:
        return await self._send(target, "ping", timeout) is not None  # {}: refused, yet alive

    async def ping(self, target: str, timeout: float) -> bool:
        """Whether ``target`` acks a ping within ``timeout`` (``swarm.liveness``: is it alive?). Past
        the emulated link, as ``/status`` was asked: whether the peer lives, not how its link is (an
        emulated cut between islands is weather the island's keeper judges; asked over the cut, a
        planner re-planned around a live island, 1 suite run in 4)."""
        return await self._send(target, "ping", timeout, shaped=False) is not None  # {}: refused, yet alive

    async def probe(self, target: str) -> None:
        """One probe: a direct ping, then indirect ones; a member nobody reached is suspected, and
        told so (where it is alive after all, it refutes at once)."""
        if self.url_of(target) is None:  # known by news only: others probe it
            return
        if await self._ping(target, self.params.ack_s):
            self._misses.pop(target, None)
            return
        m = self.swim.members.get(target)
        if target in self.hinted or (m is not None and not m.confirmed):
            # an address from another's list, or a member nobody vouched for: not evidence; tried again
            # next round, and dropped after HINT_TRIES misses (a wrong one costs that many pings)
            misses = self._misses.get(target, 0) + 1
            if misses < HINT_TRIES and target in self.urls:
                self._misses[target] = misses
            else:
                self._forget_url(target)
            return
        helpers = self.swim.helpers(target, lambda p: self.url_of(p) is not None)
        if helpers:
            acks = await asyncio.gather(*(self._send(h, "req", 2 * self.params.ack_s + 0.5, target=target)
                                          for h in helpers))
            if any(a is not None and a.get("ok") is True for a in acks):
                return
        suspected = self.swim.missed(target, time.monotonic())
        self._apply(suspected)
        if suspected:
            self._mine.add(target)  # its death, if it comes, this peer tells the watchers
            await self._send(target, "news", 2 * self.params.ack_s)

    def stored(self, seq: int, signed: dict, tell: bool = True) -> None:
        """This peer has a new record (``seq``; ``signed``: its DHT value): news for all, and the
        signed record itself to the watchers at once, so that a join or a state change reaches
        the planner without anyone reading the member keys. Not ``tell``: stored only (its step)."""
        self._signed = signed
        if tell and seq > self.swim.rec and self.peer.state != "left":  # leaving: ``leave`` says goodbye
            self.swim.record(seq)
            before, after = self._told, self.peer._view.get(self.peer.peer_id)
            self._told = after
            # a measurement the record says is new goes with it: its readers need not read its key
            # (a whole bucket: 100 KB of links at 1,000 peers for one peer's 3 KB)
            new = versions_changed(before, after) if after is not None else []
            measured = {w: v for w, v in self.peer.measured_signed.items() if w in new}
            if self._running:  # else ``run`` sends it first, once the member list is known
                self.peer.spawn(self.tell_watchers(record=signed, change=(before, after), measured=measured),
                                "swim-record")

    def retell(self) -> None:
        """Sends this peer's record to the watchers again (who they are changed: a job began)."""
        if self._running and self._signed is not None and self.peer.state != "left":
            self.peer.spawn(self.tell_watchers(record=self._signed, measured=dict(self.peer.measured_signed)), "swim-record")

    async def tell_watchers(self, change: tuple = (None, None), **extra) -> None:
        """News straight to the watchers (deaths and departures, this peer's new record in
        ``extra``; ``change``: its last record told and this one, which say who is a watcher of it,
        ``Peer.watcher_ids``), not waiting for the pings to carry it: news just queued goes first on
        any message, after news about its receiver."""
        said = self.peer.watcher_ids(*change) if self.peer.watcher_ids is not None else []
        me = [self.peer.peer_id]
        # the lowest ids among the confirmed members, and among all heard of (a joiner has confirmed
        # few yet: its list's members are the best it knows; a made-up one costs one message)
        heard = [p for p, m in self.swim.members.items() if m.state not in GONE]
        for w in dict.fromkeys([*said, *membership.watchers(self.swim.live() + me), *membership.watchers(heard + me)]):
            if w == self.peer.peer_id:
                continue
            told = await self._send(w, "news", self.params.ack_s * 2, **extra)
            if "record" not in extra:
                continue
            if not told:  # a record once more (silent or refused): a voter that missed it votes on another snapshot
                await asyncio.sleep(self.params.ack_s)
                told = await self._send(w, "news", self.params.ack_s * 2, **extra)
            if told:
                self._untold.pop(w, None)
            elif w in self._untold or len(self._untold) < MAX_UNTOLD:
                self._untold[w] = extra  # its news is not passed on the pings: sent again (``_tell_untold``)

    async def _tell_untold(self) -> None:
        """The watchers that missed this peer's latest record twice (``tell_watchers``) are sent it
        again, once each every ``UNTOLD_ROUNDS`` probe rounds, until they take it or are gone."""
        for w, extra in list(self._untold.items()):
            m = self.swim.members.get(w)
            if m is None or m.state in GONE:
                self._untold.pop(w, None)
            elif await self._send(w, "news", self.params.ack_s * 2, **extra) and self._untold.get(w) is extra:
                del self._untold[w]

    # ---- tasks ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """The probe loop: a probe every ``probe_s`` (not waiting for the last to end: a silent member
        takes up to ``2 * ack_s`` more), suspects timed out every round."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        pending: set[asyncio.Task] = set()
        self._running = True
        if self._signed is not None:  # a joiner's record to the watchers: its join, as the planner sees it
            hello = asyncio.ensure_future(self.tell_watchers(record=self._signed, measured=dict(self.peer.measured_signed)))
            pending.add(hello)
            hello.add_done_callback(pending.discard)
        try:
            rounds = 0
            while True:
                next_at += self.params.probe_s
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                next_at = max(next_at, loop.time() - self.params.probe_s)
                try:
                    dead = self.swim.tick(time.monotonic())
                    self._apply(dead)
                    # every peer that heard a suspicion times it out; the one that raised it tells
                    if any(n.peer in self._mine for n in dead):
                        t = asyncio.ensure_future(self.tell_watchers())
                        pending.add(t)
                        t.add_done_callback(pending.discard)
                    self._mine = {p for p in self._mine if (m := self.swim.members.get(p)) is not None
                                  and m.state == SUSPECT}
                    rounds += 1
                    if rounds % 60 == 0:
                        self._prune_urls()
                    if rounds % UNTOLD_ROUNDS == 0 and self._untold and len(pending) < 4:
                        t = asyncio.ensure_future(self._tell_untold())
                        pending.add(t)
                        t.add_done_callback(pending.discard)
                    for _ in range(8):  # a member known by news only is probed by those who know its address
                        target = self.swim.next_target()
                        if target is None or self.url_of(target) is not None:
                            break
                    if target is not None and len(pending) < 4:
                        t = asyncio.ensure_future(self.probe(target))
                        pending.add(t)
                        t.add_done_callback(pending.discard)
                except Exception as e:  # one bad round must not end liveness for good
                    log.warning("swim round failed: %r", e)
        finally:
            for t in pending:
                t.cancel()

    async def read_unknown(self) -> None:
        """A watcher's reads of the records it heard are newer than its own and did not get sent
        (``stored``), at most one read a poll."""
        while True:
            await self._read_wake.wait()
            self._read_wake.clear()
            await asyncio.sleep(self.peer.config.poll_s / 2)  # a record sent to us directly may be on its way
            view = self.peer._view
            want = {p for p in self._to_read if (m := self.swim.members.get(p)) is not None and m.state not in GONE
                    and (p not in view or view[p].instance != m.life or view[p].seq < m.rec)}
            self._to_read.clear()
            if want:
                try:
                    await self.peer.read_records(want)
                except Exception as e:
                    log.warning("reading the records of %d member(s) failed: %s", len(want), e)
            await asyncio.sleep(self.peer.config.poll_s)

    async def leave(self) -> None:
        """Says goodbye to the watchers and a few others (the pings would carry it too, if we stayed)."""
        self.swim.leave()
        targets = set(membership.watchers(self.swim.live() + [self.peer.peer_id]))
        targets.update(self.swim.helpers(""))
        targets.discard(self.peer.peer_id)
        await asyncio.gather(*(self._send(t, "news", self.params.ack_s * 2) for t in targets))


def install(peer) -> SwimLoop:
    cfg = peer.config
    ttl = cfg.record_s * cfg.ttl_heartbeats
    params = SwimParams(probe_s=cfg.swim_probe_s, ack_s=cfg.swim_probe_s / 2, suspect_s=2 * cfg.swim_probe_s,
                        forget_s=ttl + 10.0)
    loop = SwimLoop(peer, params)
    peer.dataplane.register(KIND, loop.handle)
    peer.dataplane.add_json_get("/swim", loop.page)
    return loop
