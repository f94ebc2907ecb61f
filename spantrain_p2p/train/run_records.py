"""The swarm's records of a run in the DHT: the job, the stage maps, the news of a new map, and the
members' states on a map (``ready_peers``, ``map_states``).

The peer that starts the swarm publishes the job; every peer that runs it stores its own signed
copy (subkey = its peer id: nobody can store in another's name), so the job outlives its founder,
and a joiner takes the job most copies agree on. Stage maps are signed and stored one subkey per
epoch and planner; the newest valid one (highest (term, epoch)) signed by a member wins, so a stale
planner's publications lose to its successor's and a peer that never joined publishes none.

After publishing a map the planner hands the signed map to the map's peers down a tree
(``map_tree``: each peer passes it to 8 more; a "mapnews" message with the map, checked as a read of
the key is), and tells the peers outside the map a "mapnews" without it: a hint to read the DHT. So
peers need not poll the key (every read costs every peer CPU), and its few nodes no longer answer
every peer on every epoch (75 MB per epoch at 1,000 peers)."""
from __future__ import annotations

import asyncio
import hashlib
import math
import logging
import random
import time
from typing import Callable, Optional

from ..net.framing import FrameError
from ..plan.stagemap import StageMap
from . import map_tree
from ..swarm.keys import epoch_subkey, job_key_of, job_keys, stagemap_key
from ..swarm.liveness import reachable_at
from ..swarm.records import MAX_KEY_BYTES, MAX_SIG_BYTES, BadRecord, open_payload, sign_payload
from ..job.spec import JobRefused, JobSpec

log = logging.getLogger("spantrain.train")

READY_STATES = ("ready", "training", "recovering", "done")


def ready_peers(peer) -> list:
    """The live members that measured and can take a stage."""
    return [r for r in peer.live_members() if r.state in READY_STATES and r.peer_id not in peer.evicted]


def map_states(peer, smap) -> dict[str, str]:
    """The state of each live member that ``smap`` names (a peer no longer a member is left out)."""
    mine = set(smap.members())
    return {r.peer_id: r.state for r in peer.live_members() if r.peer_id in mine}

RECORD_TTL_S = 600.0
MAX_MAP_BYTES = 256 << 10
# without news a peer reads the stage maps this often
MAP_POLL_S = 2.0
MAP_NEWS_MIN_GAP_S = 0.2  # news closer together than this wakes no one (a spamming peer included)
# a read of the stage maps serves every reader of this peer this long, unless news of a map came or
# this peer published one since: the planner's loop (every 0.5 s) and the trainer's watch (every
# MAP_POLL_S) read the key once between them (the planner made a third of a training swarm's
# stage-map reads, issue 31)
MAP_REUSE_S = MAP_POLL_S
# A peer that follows a map reads the key again only on news: a planner's message, or a newer map
# heard of on a SWIM ping (``heard_head``); else, in case both were lost, every ``quiet_s()``: this
# much a member, from MAP_POLL_S up to MAP_QUIET_MAX_S, at one of the key's nodes. Every peer read
# the whole key every 2 s from its 5 nodes, a quarter of a 20-peer training swarm's control traffic,
# and at 1,000 peers (a 75 KB map) 180 KB/s a peer; a check every 250 s from two nodes still made
# them the busiest of the swarm, 17x the mean (``sim.control_job``). Without SWIM (``--liveness
# records``) nothing carries heads: MAP_POLL_S.
MAP_QUIET_PER_PEER_S = 5.0
MAP_QUIET_MAX_S = 3600.0
# a head heard of makes this peer read the key at most this often (a made-up head costs one read)
HEARSAY_GAP_S = 5.0
UNFOUND_KEPT_S = 60.0  # a head heard of and not found in the key is not chased again this long
QUIET_HOLDERS = 1  # of the stage-map key's nodes, how many a quiet check asks
NEWS_HOLDERS = 2  # and a read on news (each answers with every map of the last MAP_TTL_S)
PUSH_TIMEOUT_S = 2.0  # a copy of a map down the tree not delivered in this long goes to the child's children
# A stage map lives this long in the DHT, re-stored by its planner while it leads (``keep_map``): the
# key holds every map of the last MAP_TTL_S, which every reader gets whole (at 600 s, the 11 maps of
# a 20-peer run that re-planned often made a read of it 26 KB; at 1,000 peers a map is 73 KB)
MAP_TTL_S = 180.0
# A peer waiting for a job reads the job key at once when a member's record says it has one (its
# ``job`` progress field, or any state past idle), else only this often: idle peers each read it
# every 0.5 s before, a third of an idle swarm's DHT calls (issue 33)
JOB_IDLE_POLL_S = 5.0
# and no more often than the swarm's idle peers read it this many times a second in all: every
# lookup and read of a key ends at its few nodes, and at 1,000 idle peers polling every 5 s those
# were the busiest nodes of the swarm (``sim.control_swim``); a joiner reads it at once all the same
JOB_IDLE_READS_PER_S = 20.0
# A joiner of a large swarm decides on this many members' copies of the job (``_read_copies``)
JOB_VOTES = 16


def job_in_sight(records) -> bool:
    """Whether any of these member records shows a job: its ``job`` field, or a state past idle."""
    return any(r.progress.get("job") or r.state not in ("joining", "idle") for r in records)


SIGNED_PARTS = (("body", MAX_MAP_BYTES), ("key", MAX_KEY_BYTES), ("sig", MAX_SIG_BYTES))


def map_buffers(signed: dict) -> list:
    """A signed map as a message's buffers: its body, key and signature."""
    return [signed[part] for part, _most in SIGNED_PARTS]


def signed_of(buffers) -> Optional[dict]:
    """The signed map in a message's (untrusted) buffers, unchecked but within its sizes; None if
    they are not three of at most those sizes."""
    if len(buffers) != len(SIGNED_PARTS) or any(memoryview(b).nbytes > most
                                                for b, (_part, most) in zip(buffers, SIGNED_PARTS)):
        return None
    return {part: bytes(b) for b, (part, _most) in zip(buffers, SIGNED_PARTS)}


def _tree(smap: StageMap, root: str) -> list[str]:
    """The map's peers in the order its copies go down (``map_tree.order``)."""
    return map_tree.order((p for st in smap.stages for p in st.peers), root, smap.term, smap.epoch)


class RunRecords:
    """This peer's access to the run's records. ``log_bad(subkey, reason)`` reports (once) a
    record that does not validate."""

    def __init__(self, peer, log_bad: Callable[[object, str], None], poll_s: float = 0.5):
        self.peer, self.log_bad, self.poll_s = peer, log_bad, poll_s
        self.job: Optional[JobSpec] = None
        self.num_layers = 0
        self._news = asyncio.Event()
        self._news_at = 0.0
        self._maps_changed = 0  # news of a map received or a map published: a kept read is stale
        self._map_read: Optional[tuple[float, int, Optional[StageMap]]] = None  # (when, _maps_changed, map)
        self._published: Optional[tuple[str, str, dict]] = None  # the last map this peer published: (key, subkey, value)
        self._hearsay: tuple[float, tuple[int, int]] = (-HEARSAY_GAP_S, (0, 0))  # (when, head) last chased
        self._unfound: tuple[float, tuple[int, int]] = (0.0, (0, 0))  # (when, head) chased and not found
        self._idle_turn = 0
        self._passed_on: set[tuple[int, int]] = set()  # (term, epoch) of the maps handed down the tree here
        self._taken: dict[bytes, None] = {}  # digests of the signed bodies of maps handed to this peer lately
        self._signed: Optional[tuple[tuple[int, int], dict]] = None  # the newest map seen: (head, its signed value)
        self.control_at_map: Optional[dict] = None  # the control meter at the first stage map followed

    def start(self, job: JobSpec, num_layers: int) -> None:
        self.job, self.num_layers = job, num_layers
        self.peer.on_map_head = self.heard_head

    @property
    def swarm(self) -> str:
        return self.peer.config.swarm

    async def store(self, key: str, subkey: str, value: dict, ttl_s: float = RECORD_TTL_S) -> None:
        from hivemind.utils import get_dht_time

        await self.peer.dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey)

    # ---- the job ----------------------------------------------------------------------------------
    async def publish_job(self, job: JobSpec) -> None:
        """This peer's signed copy of the job it runs."""
        await self.store(job_key_of(self.swarm, self.peer.peer_id), self.peer.peer_id,
                         sign_payload(job.to_dict(), self.peer.identity))

    async def await_job(self) -> JobSpec:
        """The swarm's job, once it is in the DHT: the one most live members' copies agree on (ties:
        the smallest job id, the same on every peer). A copy that does not validate is skipped and
        logged; only invalid copies refuse the run."""
        waited, bad = 0.0, ""
        read_at = -math.inf
        while True:
            others = [r for r in self.peer.live_members() if r.peer_id != self.peer.peer_id]
            sight = job_in_sight(others)
            idle_poll = max(JOB_IDLE_POLL_S, len(self.peer.member_ids()) / JOB_IDLE_READS_PER_S)
            if not sight and waited - read_at < idle_poll:
                await asyncio.sleep(self.poll_s)
                waited += self.poll_s
                continue
            first, read_at = read_at == -math.inf, waited
            # a joiner reads every key at once; an idle peer with no job in sight, one key a poll, in
            # turn over those its members' copies would be in (every key a poll was up to 16 calls)
            votes, bad = await self._read_copies(sight, bad, None if sight or first else [self._idle_key()])
            if votes:
                if len(votes) > 1:
                    log.warning("the swarm's job copies disagree (%s): taking the one most members run",
                                ", ".join(f"{j[:12]}: {len(v)}" for j, v in sorted(votes.items())))
                return min(votes.values(), key=lambda v: (-len(v), v[0].job_id))[0]
            if bad:
                raise JobRefused(f"the swarm's job record is invalid: {bad}")
            if waited == 0.0:
                log.info("waiting for the swarm's job to appear in the DHT")
            await asyncio.sleep(self.poll_s)
            waited += self.poll_s

    def _idle_key(self) -> str:
        """The job key an idle peer's next poll reads: the keys of its other members' buckets in turn."""
        me = self.peer.peer_id
        keys = sorted({job_key_of(self.swarm, p) for p in self.peer.member_ids() if p != me}) or job_keys(self.swarm)
        self._idle_turn += 1
        return keys[self._idle_turn % len(keys)]

    async def _read_copies(self, sight: bool, bad: str, only: Optional[list] = None) -> tuple[dict[str, list], str]:
        """({job id: its valid copies by members}, the last invalid copy's fault or ``bad``). The
        copies lie in 16 keys by their members' ids (``keys.job_key_of``): all read at once (or
        ``only`` those), or, in a swarm of more than ``JOB_VOTES`` members a key, one key at a time in
        a random order until ``JOB_VOTES`` valid copies agree (a random 16th of 1,000 members votes as
        they all do; where copies disagree, every key is read). With a job in sight, from 2 of each
        key's nodes, else from 1."""
        keys = list(only) if only else job_keys(self.swarm)
        random.shuffle(keys)
        members = self.peer.member_ids()
        per = 1 if len(members) > JOB_VOTES * len(keys) else len(keys)
        votes: dict[str, list] = {}
        for i in range(0, len(keys), per):
            # with no job in sight, one of each key's nodes (every idle peer's poll asked all five:
            # at 48 idle peers the job key's nodes answered 9 calls a second each, the busiest peers)
            found = await self.peer.dht.get_many(keys[i:i + per], latest=True, holders=2 if sight else 1)
            for key, item in found.items():
                for sub, entry in (item.value.items() if item is not None and isinstance(item.value, dict) else ()):
                    if sub not in members:  # a copy by a peer that never joined is nobody's job
                        continue
                    try:
                        signer, payload = open_payload(entry.value)
                        if signer != sub:
                            raise BadRecord(f"a copy filed under {str(sub)[:16]} is signed by {signer[:16]}")
                        if job_key_of(self.swarm, signer) != key:
                            raise BadRecord(f"a copy of {signer[:16]} under another bucket's key")
                        job = JobSpec.from_dict(payload)
                    except (BadRecord, ValueError, TypeError) as e:
                        self.log_bad(sub, f"job: {e}")
                        bad = str(e)
                        continue
                    votes.setdefault(job.job_id, []).append(job)
            if sum(map(len, votes.values())) >= JOB_VOTES and len(votes) == 1:
                break  # (copies that disagree: every key is read, so one bucket filled with ids an
                # attacker made up cannot outvote the swarm)
        return votes, bad

    async def refresh_job(self) -> None:
        """This peer keeps its copy of the job alive, so the job outlives the peer that started it."""
        while True:  # at once too: a joiner's copy is one more vote for the job it runs
            await self.publish_job(self.job)
            await asyncio.sleep(RECORD_TTL_S / 4)

    # ---- stage maps -------------------------------------------------------------------------------
    async def newest_map(self, max_age_s: float = MAP_REUSE_S) -> Optional[StageMap]:
        """The newest valid stage map of this job: highest (term, epoch). A read at most ``max_age_s``
        old serves again, unless a map was announced, heard of or published since it started."""
        kept, now = self._map_read, time.monotonic()
        if kept is not None and kept[1] == self._maps_changed and now - kept[0] < max_age_s:
            return kept[2]
        changed = self._maps_changed
        if kept is not None and kept[1] == changed and kept[2] is not None and max_age_s > MAP_REUSE_S:
            asked = await self._ask_a_peer(kept[2])  # a follower's quiet check: a member, not the key
            if asked is not False:
                newer = self._map_read[2] if self._map_read is not None else None
                smap = max((m for m in (asked, kept[2], newer) if m is not None), key=lambda m: m.head)
                self._map_read = (now, self._maps_changed, smap)
                return smap
        # news (or a first read) asks two nodes of the key, a quiet check (or a waiter's poll) one
        smap = await self._read_newest_map(NEWS_HOLDERS if kept is None or kept[1] != changed else QUIET_HOLDERS)
        came = self._map_read[2] if self._map_read is not None else None  # (handed down meanwhile?)
        if came is not None and (smap is None or came.head > smap.head):
            return came
        self._map_read = (now, changed, smap)
        when, head = self._hearsay
        if when >= (kept[0] if kept else 0.0) and (smap is None or smap.head < head):
            self._unfound = (now, head)
        return smap

    def quiet_s(self) -> float:
        """How old a read of the map may be for a peer that follows one (``MAP_QUIET_PER_PEER_S``)."""
        if getattr(self.peer, "swim", None) is None:
            return MAP_POLL_S
        return max(MAP_POLL_S, min(MAP_QUIET_MAX_S, MAP_QUIET_PER_PEER_S * len(self.peer.member_ids())))

    def heard_head(self, term: int, epoch: int, job: Optional[str] = None) -> None:
        """A member follows stage map (``term``, ``epoch``) (a SWIM message said): where that is newer
        than the last map read here and no copy came down the tree within PUSH_TIMEOUT_S, the next
        ``newest_map`` reads the key, and waiters wake (a ping that told the head before the map
        arrived made a peer read the key: 6 reads for a re-plan of lan-8)."""
        if self.job is None or job != self.job.job_id:
            return  # a map of another job (peers left from an earlier one under this swarm's name)
        now, head = time.monotonic(), (term, epoch)
        if self._read_already(head):
            return
        if now - self._hearsay[0] < HEARSAY_GAP_S or (now - self._unfound[0] < UNFOUND_KEPT_S and head == self._unfound[1]):
            return
        self._hearsay = (now, head)
        try:  # the map itself may be on its way down the tree (the teller took it there): a moment first
            asyncio.get_running_loop().call_later(PUSH_TIMEOUT_S, self._chase, head)
        except RuntimeError:  # (no loop: a test's plain call)
            self._chase(head)

    def _chase(self, head: tuple[int, int]) -> None:
        """A head heard of and still not read here: the next ``newest_map`` reads the key."""
        if self._read_already(head):
            return
        self._maps_changed += 1
        self._news.set()

    def _read_already(self, head: tuple[int, int]) -> bool:
        """Whether the last map read here is (term, epoch) ``head`` or newer."""
        kept = self._map_read[2] if self._map_read is not None else None
        return kept is not None and head <= kept.head

    async def _read_newest_map(self, holders: int = 5) -> Optional[StageMap]:
        found = await self.peer.dht.get(stagemap_key(self.swarm), latest=True, holders=holders)
        if found is None or not isinstance(found.value, dict):
            return None
        best = None
        for sub, entry in found.value.items():
            got = self._valid_map(entry.value, sub)
            if got is not None and sub == epoch_subkey(got[1].epoch, got[0]):
                if best is None or got[1].head > best.head:
                    best = got[1]
                    self._hold(best.head, entry.value)
            elif got is not None:
                self.log_bad(sub, f"stage map of epoch {got[1].epoch} under another's subkey")
        return best

    def _hold(self, head: tuple[int, int], signed: dict) -> None:
        """Keeps the signed bytes of the newest map this peer has seen, for a member that asks."""
        if self._signed is None or head > self._signed[0]:
            self._signed = (head, signed)

    async def _ask_a_peer(self, current: StageMap):
        """A quiet check: one random member is asked for a map newer than ``current`` ("mapget").
        Returns the newer map it gave, None if it had none, False if it did not answer (the key is
        read then). Every follower read the key's one node once an hour: at 10,000 peers (a 559 KB
        map) 320 KB/s at each node of the key, 204x the mean node (``sim.control_job``)."""
        others = sorted(self.peer.member_ids() - {self.peer.peer_id})
        if not others:
            return False
        p = random.choice(others)
        url = reachable_at(self.peer, p)
        try:
            if url is None:
                raise ConnectionError("no address")
            reply = await self.peer.client.send(url, "mapget", {"job": self.job.job_id, "term": current.term,
                                                               "epoch": current.epoch},
                                                timeout=PUSH_TIMEOUT_S, link=self.peer.link_to(p), peer_id=p)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("asking %s for a newer stage map failed: %r", self.peer.name_of(p), e)
            return False
        if not reply or not reply[1]:
            return None
        value = signed_of(reply[1])
        got = self._valid_map(value, f"map from {p[:16]}") if value is not None else None
        if got is None or got[1].head <= current.head:
            return False
        self._hold(got[1].head, value)
        return got[1]

    async def on_get(self, header: dict, buffers):
        """A member's quiet check ("mapget" {job, term, epoch}): the signed map this peer holds if it
        is newer than the one asked about, else nothing."""
        head = (header.get("term"), header.get("epoch"))
        if not all(type(x) is int for x in head):
            raise FrameError("a map asked for is {job, term, epoch}")
        if self.job is None or header.get("job") != self.job.job_id or self._signed is None or self._signed[0] <= head:
            return None
        return {"term": self._signed[0][0], "epoch": self._signed[0][1]}, map_buffers(self._signed[1])

    def install(self, dataplane) -> None:
        """This peer's handlers of a map's news (a copy handed down) and of a member's quiet check."""
        dataplane.register("mapnews", self.on_news)
        dataplane.register("mapget", self.on_get)

    def _valid_map(self, value, where) -> Optional[tuple[str, StageMap]]:
        """(signer, map) of an untrusted signed map of this job, signed by a member; else None
        (another job's, silently; a bad one logged once under ``where``)."""
        try:
            signer, payload = open_payload(value, MAX_MAP_BYTES)
            smap = StageMap.from_dict(payload, self.num_layers)
        except (BadRecord, ValueError) as e:
            self.log_bad(where, f"stage map: {e}")
            return None
        if smap.job_id != self.job.job_id:
            return None
        if not self.peer.ever_member(signer):
            self.log_bad(where, f"stage map of epoch {smap.epoch} signed by {signer[:16]}, never a member")
            return None
        return signer, smap

    async def await_map(self, after: tuple[int, int], waiting_for: Callable[[], str]) -> StageMap:
        """The first stage map newer than ``after``, a (term, epoch) as ``newest_map`` orders maps;
        ``waiting_for`` says what it waits on. By the epoch alone, a peer whose epoch was superseded
        by another planner's map of the same number (two peers each took the other for dead, each
        planned alone as planner of its own term: 2026-12-02) waited for a newer one for ever."""
        announced = False
        while True:
            smap = await self.newest_map()
            if smap is not None and smap.head > after:
                self._log_map(smap)
                if self.control_at_map is None and getattr(self.peer, "control", None) is not None:
                    self.control_at_map = self.peer.control.snapshot()  # the report's control_training
                self.peer.map_head = (smap.term, smap.epoch, smap.job_id)  # told on this peer's SWIM messages
                return smap
            if not announced:
                log.info("waiting for the planner's stage map (%s)", waiting_for())
                announced = True
            await self.news_or(MAP_POLL_S)

    def _log_map(self, smap: StageMap) -> None:
        pred = f", predicted step {smap.predicted_step_s:.3f}s ({smap.bottleneck})" if smap.predicted_step_s else ""
        log.info("stage map epoch %d (term %d, %s%s): %s", smap.epoch, smap.term, smap.schedule or self.job.schedule,
                 pred, " | ".join(f"{'+'.join(smap.name_of(p) for p in st.peers)} [{st.layers[0]},{st.layers[1]})"
                                  for st in smap.stages))

    async def publish_map(self, smap: StageMap) -> None:
        """Signs and stores ``smap`` under its epoch, then tells every live peer (best effort)."""
        published = (stagemap_key(self.swarm), epoch_subkey(smap.epoch, self.peer.peer_id),
                     sign_payload(smap.to_dict(), self.peer.identity, MAX_MAP_BYTES))
        await self.store(*published, ttl_s=MAP_TTL_S)
        self._published = published
        self._hold(smap.head, published[2])
        self._maps_changed += 1
        # its own map, as a reader would take it, is the newest it knows: not read back
        self._map_read = (time.monotonic(), self._maps_changed, StageMap.from_dict(smap.to_dict(), self.num_layers))
        self.peer.spawn(self._announce(smap, published[2]), "map-news")

    async def keep_map(self, leading: Callable[[], bool], every_s: float = MAP_TTL_S / 3) -> None:
        """The planner's task: re-stores the last map it published (the same signed bytes, a later
        expiry) every ``every_s`` while it leads. A map lives ``MAP_TTL_S`` in the DHT: a run that
        went 10 minutes without a new epoch found the key empty, its planner then published a "first
        plan" as epoch 1 that no follower (on a later epoch) took, and a joiner found no map."""
        while True:
            await asyncio.sleep(every_s)
            if self._published is not None and leading():
                try:
                    await self.store(*self._published, ttl_s=MAP_TTL_S)
                except Exception as e:
                    log.warning("re-storing the stage map failed: %s", e)

    # ---- news of a map ----------------------------------------------------------------------------
    async def on_news(self, header: dict, buffers) -> None:
        """A planner published a stage map: with the map (``buffers``: its signed body, key and
        signature), handed down the tree, it is taken as a read of the key would take it and passed
        on to this peer's children; without, whoever waits for one wakes and reads the DHT."""
        if self.job is not None and header.get("job") != self.job.job_id:
            return None
        if buffers and self.job is not None:
            value = signed_of(buffers)
            if value is None:
                raise FrameError("a map handed down is three buffers: its signed body, key and signature")
            digest = hashlib.sha256(value["body"]).digest()
            if digest in self._taken:  # the same map again (a sender's retry, a replay): parsed once
                return None
            got = self._valid_map(value, f"map from {str(header.get('src', '?'))[:16]}")
            if got is None:
                raise FrameError("not a valid stage map of this job signed by a member")
            self._taken[digest] = None
            if len(self._taken) > 64:
                self._taken.pop(next(iter(self._taken)))
            signer, smap = got
            head = smap.head
            current = self._map_read[2] if self._map_read is not None else None
            if current is not None and head < current.head:
                return None  # an older map (a replay): neither taken nor passed on
            if not self._read_already(head):
                self._maps_changed += 1
                self._map_read = (time.monotonic(), self._maps_changed, smap)
                self._news.set()
            self._hold(head, value)
            if head not in self._passed_on:  # (the map this peer follows, or a newer one: once each)
                self._passed_on.add(head)
                if len(self._passed_on) > 64:
                    self._passed_on.discard(min(self._passed_on))
                tree = _tree(smap, signer)
                self.peer.spawn(self._hand_down(tree, map_tree.children(tree, self.peer.peer_id, signer), head, value),
                                "map-push")
            return None
        head = (header.get("term"), header.get("epoch"))
        if all(type(x) is int for x in head) and self._read_already(head):
            return None  # read already (a SWIM ping told of it first): no second read
        now = time.monotonic()
        self._maps_changed += 1
        if now - self._news_at >= MAP_NEWS_MIN_GAP_S:
            self._news_at = now
            self._news.set()
        return None

    async def news_or(self, timeout_s: float) -> None:
        """Until the next stage-map news, at most ``timeout_s``."""
        try:
            await asyncio.wait_for(self._news.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._news.clear()

    async def _announce(self, smap: StageMap, signed: dict) -> None:
        """The map down the tree to its peers (``map_tree``), the news of it to every other live
        peer (a spare reads the key; a lost one hears the head on SWIM's messages, or waits
        MAP_POLL_S)."""
        me, head = self.peer.peer_id, smap.head

        async def tell(r) -> None:
            try:
                await self.peer.client.send(r.data_url, "mapnews", {"job": self.job.job_id, "epoch": smap.epoch,
                                                                    "term": smap.term},
                                            timeout=PUSH_TIMEOUT_S, link=self.peer.link_to(r.peer_id))
            except Exception as e:
                log.debug("stage-map news to %s not delivered: %r", r.name or r.peer_id, e)

        self._news.set()  # this peer's own waiters
        self._passed_on.add(head)
        tree = _tree(smap, me)
        in_map = set(tree)
        await asyncio.gather(self._hand_down(tree, map_tree.children(tree, me, me), head, signed),
                             *(tell(r) for r in self.peer.live_members()
                               if r.peer_id != me and r.peer_id not in in_map and r.data_url))

    async def _hand_down(self, tree: list[str], kids: list[str], head: tuple[int, int], signed: dict) -> None:
        """The signed map to each of ``kids``; one that does not take it within PUSH_TIMEOUT_S has
        its own children sent it from here (so a dead peer costs its subtree nothing)."""
        header = {"job": self.job.job_id, "term": head[0], "epoch": head[1]}
        buffers = map_buffers(signed)

        async def give(p: str) -> None:
            url = reachable_at(self.peer, p)
            try:
                if url is None:
                    raise ConnectionError("no address")
                await self.peer.client.send(url, "mapnews", header, buffers, timeout=PUSH_TIMEOUT_S,
                                            link=self.peer.link_to(p), peer_id=p)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("stage map epoch %d to %s not delivered (%r): to its children instead", head[1],
                          self.peer.name_of(p), e)
                await asyncio.gather(*(give(c) for c in map_tree.children(tree, p, "")))

        await asyncio.gather(*(give(p) for p in kids))
