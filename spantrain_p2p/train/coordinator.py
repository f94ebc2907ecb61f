"""The coordinator: the planner's role, which every peer is ready to take.

Every peer computes the region groups of the same measurement snapshot and publishes their
digest; the peer holding the planner lease (``swarm.election``) plans once a quorum agrees, and
publishes the stage map as the next epoch: the first one, a new one when a peer of the current
map is gone (``decide.epoch_verdict``, then asking the missing peers), resuming from the latest
step every layer survives at (``decide.resume_point``), and a better one when a lasting change
makes it worth moving stages (``decide.ReplanHysteresis``)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Optional

from ..plan.islands import IslandsPlan
from ..plan.stagemap import StageMap, placeholder_map
from ..swarm import grouping, measure
from ..swarm.election import Election
from .defence import evictions, gate_evictions, read_accusations, receivers
from . import planning
from .decide import (COPY_MARGIN, MAX_STALLED_EPOCHS, REPLAN_CHECK_S, REPLAN_HOLD_S, REPLAN_WINDOW_S,
                     ReplanHysteresis, copy_every, epoch_verdict, swarm_mtbf_s, memory_caps, out_of_memory,
                     refit_fixed, replan_check_s, resume_point, same_layout, search_due, stalled)
from ..swarm.liveness import is_alive
from .held_measurements import links_entry, links_version, measure_versions, measurements_key, newer
from .recovery import copy_cost_s_per_byte
from .run_records import READY_STATES, map_states, ready_peers

WHOLE_READ_PEERS = 100  # up to this many ready peers, the measurements are read whole every WHOLE_READ_S
WHOLE_READ_S = 300.0  # (a safety net: a change of a peer's measurements is read when its record says so)
MAX_WEIGHED = 100_000  # peers whose first plan this planner remembers (one float each)
MAX_FAILED_KEPT = 4096  # dead peers counted towards the failure rate (a swarm this churned copies every step anyway)
LONE_WAIT_S = 2.0  # a lone receiver's accusation stands this long, its accuser unaccused, before it evicts
ACCUSATIONS_EVERY_S = 1.0  # how often the planner reads the accusations (a DHT read of one key)
PUBLISHED_KEPT, PUBLISHED_FOR_S = 8, 10.0  # the maps this planner published lately, in its /status
log = logging.getLogger("spantrain.train")

# The ready peers first by id (the election's rank order) compute the grouping and vote on it; a
# majority of them agreeing lets the planner plan (issue 33: every peer read every profile and
# link every 5 s, about 3 MB each at 1,000 peers, and voted with the whole list of peer ids)
GROUP_VOTERS = 16


def group_voters(ids) -> list[str]:
    """Who votes on the grouping of a snapshot of ``ids``."""
    return sorted(ids)[:GROUP_VOTERS]


def snapshot_digest(ids) -> str:
    """What a vote names its snapshot by: a digest of its sorted peer ids."""
    import hashlib

    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:32]


PLAN_PROBE_S = 5.0  # a re-plan leaves out a peer of the broken map that does not answer /status in this long

def _timed(fn, *args):
    """(``fn(*args)``, the CPU seconds it took on this thread): run in a worker thread."""
    t0 = time.thread_time()
    return fn(*args), time.thread_time() - t0


class Coordinator:
    """Groups, election and planning for one job. ``has_map()`` says whether this peer follows a
    stage map already (groups are then recomputed less often); ``measure_links``: the job's plans
    come from measurements (False with --no-measure); ``log_bad(subkey, reason)`` says (once) that
    a DHT entry is invalid."""

    def __init__(self, peer, records, recovery, log_bad, measure_links: bool, poll_s: float):
        self.peer, self.records, self.recovery, self.log_bad = peer, records, recovery, log_bad
        self.measure_links, self.poll_s = measure_links, poll_s
        self.job = self.handle = None
        self.has_map = lambda: False
        self._accusations_read = 0.0
        self._lone_accusers: set[str] = set()  # gate accusers whose lone accusation evicted a peer
        self._lone_seen: dict[tuple[str, str], float] = {}  # (accused, lone accuser) -> when first read
        self.election: Optional[Election] = None
        self.outer = None  # the trainer's islands.exchange.OuterSync: where a map with islands resumes from
        self.groups_digest: Optional[str] = None
        self.groups: list[list[str]] = []
        self.replans = 0
        # (when, summary) of the maps published lately: an epoch superseded within a second reaches
        # no peer's current plan, and an operator polling /status missed it and its reason
        self.published: deque = deque(maxlen=PUBLISHED_KEPT)
        self._hysteresis = ReplanHysteresis()
        self._stall = (-1, 0)  # decide.stalled: (the most steps trained, broken epochs since that grew)
        self._stall_epoch = -1  # the last broken epoch counted
        self._last_gain_check = 0.0
        self._check_every = REPLAN_CHECK_S  # (``decide.replan_check_s`` of the last search)
        self._searched_ready: list[str] = []  # the ready peers at the last search
        self._last_search = 0.0  # (monotonic) when the last search ran
        self._search_cpu: deque = deque()  # (monotonic, CPU s) of the searches of the last REPLAN_WINDOW_S
        self._checked_versions: Optional[tuple] = None  # the measurement versions held at the last check
        # failures this planner saw (peers of its view that stopped answering), over how long it watched
        # how many peers: the swarm's failure rate, which spaces the buddy copies (``_copy_every``)
        self._failed: set[str] = set()
        self._watched = (0.0, 0.0)  # (peer-seconds watched, unix time it was last added to)
        self._gain_key: Optional[tuple] = None  # (measurements, gain, new step, current step) of the last check
        # peer id -> when (unix) this planner first planned on a snapshot with its measurements: a
        # joiner's way to its first plan ends here (``launch.report``: its "planned" milestone)
        self.weighed: dict[str, float] = {}
        self._measured: Optional[tuple[dict, dict]] = None  # (profiles, links) last read (``_measured_snapshot``)
        self._measured_at = 0.0

    def start(self, job, handle, has_map) -> None:
        self.job, self.handle, self.has_map = job, handle, has_map
        self.election = Election(self.peer, candidates=lambda: [r.peer_id for r in ready_peers(self.peer)])
        self.peer.watcher_ids = self.watchers  # whom SWIM tells of joins, deaths and new records
        self.peer.on_measured = self._take_measured
        if self.peer.swim is not None:  # this peer turned ready before it knew the voters: tell them
            self.peer.swim.retell()
        self.peer.spawn(self.election.run(1.0), "election")
        self.peer.spawn(self._groups_loop(), "groups")
        self.peer.spawn(self._planner_loop(), "planner")
        self.peer.spawn(self.records.keep_map(lambda: self.election.is_leader), "keep-map")
        self.peer.spawn(measure.keep(self.peer), "keep-measurements")

    def watchers(self, before=None, after=None) -> list[str]:
        """Whom SWIM tells of a death, or of this peer's new record ``after`` (its last one told:
        ``before``): the planner and its standby, and the grouping's voters where the ready peers or
        their measurements may change (a death; a record that enters or leaves the ready states, or
        says a new measurement version), so that they vote on the snapshot the planner plans from
        without watching every member (a voter that read records only for a map voted on another)."""
        lead = self.election.watchers() if self.election is not None else []
        if before is not None and after is not None and (before.state in READY_STATES) == (
                after.state in READY_STATES) and not measure.versions_changed(before, after):
            return lead
        return lead + [p for p in group_voters(r.peer_id for r in ready_peers(self.peer)) if p not in lead]

    def status(self) -> dict:
        leader = self.election.leader if self.election else None
        return {"planner": self.peer.name_of(leader.peer_id) if leader else None,
                "term": leader.term if leader else None,
                "groups_digest": self.groups_digest, "groups": self.groups, "replans": self.replans,
                "published": [m for t, m in self.published if time.monotonic() - t < PUBLISHED_FOR_S]}

    # ---- groups -----------------------------------------------------------------------------------
    async def _measured_snapshot(self):
        """(peer ids, profiles, links) of the ready peers whose measurements are in the DHT. Read whole
        the first time, then only the keys of ready peers whose record says a measurement version
        (``measure.version_field``) newer than the entry held, of that kind (a joiner's profile and
        links, a peer's changed links: one key each), and whole again every ``WHOLE_READ_S`` up to
        ``WHOLE_READ_PEERS`` ready peers. The planner and the grouping's voters read every profile
        and link every 5 s, and beyond 100 peers every N / 20 s: 9.4 MB at 1,000 peers each time."""
        async def read(ids_of=(None, None), holders: int = measure.READ_HOLDERS) -> tuple[dict, dict]:
            """(profiles, links): every peer's of a kind where its ids are None, else those peers'
            (none named: not read)."""
            out = []
            for (what, parse), ids in zip(((measure.PROFILES, lambda d: d), (measure.LINKS, links_entry)), ids_of):
                out.append(await measure.read(self.peer, what, parse, self.log_bad, peer_ids=ids, holders=holders)
                           if ids is None or ids else {})
            return out[0], out[1]

        records = ready_peers(self.peer)
        ready = [r.peer_id for r in records]
        now = time.monotonic()
        if self._measured is None or (len(ready) <= WHOLE_READ_PEERS and now - self._measured_at >= WHOLE_READ_S):
            self._measured, self._measured_at = await read(), now
        else:
            profiles, links = self._measured

            def stale(held: dict, what: str, version) -> list[str]:
                # a peer whose record says no version (one before versions) is read at every look
                said = {r.peer_id: r.progress.get(measure.version_field(what)) for r in records}
                return [p for p in ready if p not in held or not isinstance(said[p], int) or version(held[p]) < said[p]]

            # each kind of the peers it changed for, from one of each key's nodes (an entry older
            # than the record says is read again at the next look)
            more_profiles, more_links = await read((stale(profiles, measure.PROFILES, measure.version_of),
                                                    stale(links, measure.LINKS, links_version)), holders=1)
            if more_profiles or more_links:
                # per peer, the newer entry (a key read for one peer brings its bucket's others, maybe
                # older than what came with their records)
                self._measured = (newer(profiles, more_profiles, measure.version_of),
                                  newer(links, more_links, links_version))
        if len(self._measured[0]) > 2 * len(ready) + 16:  # departed peers' entries: not kept for good
            members = self.peer.member_ids()
            self._measured = tuple({p: v for p, v in held.items() if p in members} for held in self._measured)
        profiles, links = self._measured
        ids = sorted(p for p in ready if p in profiles and p in links)
        return ids, profiles, {p: v[0] for p, v in links.items()}

    def _take_measured(self, peer_id: str, kind: str, payload: dict) -> None:
        """A member's new entry of ``kind``, sent with its record (signed by it: ``SwimLoop``): held
        as if read, where newer than the one held, so that its key is not read (``_measured_snapshot``)."""
        if self._measured is None:
            return  # the first read takes it
        profiles, links = self._measured  # (new dicts: a plan in flight keeps what it read)
        if kind == measure.PROFILES:
            self._measured = (newer(profiles, {peer_id: payload}, measure.version_of), links)
        elif kind == measure.LINKS and isinstance(payload.get("links"), dict):
            self._measured = (profiles, newer(links, {peer_id: links_entry(payload)}, links_version))

    async def _groups_loop(self) -> None:
        """Every peer computes the grouping of the same snapshot and publishes its digest."""
        published = None
        last_round, last_live = 0.0, None
        while True:
            # DHT reads cost every peer CPU: once a stage map is in force and the live peers are
            # the same, the measurements are read again only every REPLAN_CHECK_S
            live = sorted(r.peer_id for r in ready_peers(self.peer))
            leading = self.election is not None and self.election.is_leader
            if (self.has_map() and live == last_live and time.monotonic() - last_round < REPLAN_CHECK_S) or (
                    self.peer.peer_id not in group_voters(live) and not leading):
                await asyncio.sleep(1.0)
                continue
            last_round, last_live = time.monotonic(), live
            try:
                ids, profiles, links = await self._measured_snapshot()
                if ids:
                    snap = planning.snapshot(profiles, links, ids)
                    g = grouping.group(snap)
                    self.groups_digest = g.digest()
                    self.groups = [sorted(self.peer.name_of(p) for p in grp.peers) for grp in g.groups]
                    if (self.groups_digest, ids) != published and self.peer.peer_id in group_voters(ids):
                        await measure.publish(self.peer, measure.GROUPS, {"digest": self.groups_digest,
                                                                          "of": snapshot_digest(ids)})
                        published = (self.groups_digest, ids)
            except Exception as e:
                log.warning("grouping round failed: %s", e)
            await asyncio.sleep(1.0)

    async def _quorum(self, ids: list[str], digest: str) -> bool:
        """More than half of the snapshot's voters (``group_voters``) published the same groups digest
        for it."""
        voters = group_voters(ids)
        votes = await measure.read(self.peer, measure.GROUPS, lambda d: (str(d["digest"]), str(d["of"])),
                                   self.log_bad, peer_ids=voters)
        agree = sum(1 for p in voters if votes.get(p) == (digest, snapshot_digest(ids)))
        return agree * 2 > len(voters)

    # ---- the planner's loop -----------------------------------------------------------------------
    async def _planner_loop(self) -> None:
        """Acts while this peer holds the planner lease: publishes the first stage map once enough
        peers are measured and agree on the groups, a new epoch when a peer of the current map is
        gone, and a better map when one is worth the move."""
        while True:
            await asyncio.sleep(self.poll_s)
            if self.election is None or not self.election.is_leader:
                continue
            try:
                current = await self.records.newest_map(self.records.quiet_s())
                inherited = current is not None and current.term < self.election.leader.term
                live = current is not None and not current.error
                evicting = live and await self._evictions(current)
                broken = live and not evicting and not inherited and await self._epoch_broken(current)
                if broken:  # a tensor the gate refused fails its step: its sender's accusation is out by then
                    evicting = await self._evictions(current, force=True)
                if evicting:
                    await self._plan_and_publish(current, reason=evicting, evicting=True)
                    continue
                if broken and await self._stalled(current):
                    continue
                if live and not inherited and not broken:
                    if await self._worth_replanning(current):
                        gain, new_s, cur = self._gain_key[1:] if self._gain_key else (0.0, 0.0, 0.0)
                        if not await self._plan_and_publish(current, improve=True, reason=(
                                f"{gain:.0%} faster predicted ({new_s:.3g}s vs {cur:.3g}s per step)")):
                            self._hysteresis.defer(time.monotonic())
                    continue
                if current is not None and current.error:
                    continue
                if inherited:
                    log.info("taking over as planner from term %d: re-planning from the live swarm", current.term)
                await self._plan_and_publish(current, reason="first plan" if current is None else
                                             f"new planner (term {self.election.leader.term})" if inherited else
                                             f"a peer of epoch {current.epoch} is gone or failed")
            except Exception as e:
                log.warning("planning round failed: %r", e)

    async def _stalled(self, current: StageMap) -> bool:
        """Counts ``current``, broken, towards ``decide.stalled`` (once an epoch) and stops the run
        once too many epochs in a row broke with no new step: True if it stopped it."""
        if self._stall_epoch == current.epoch or current.islands:  # (islands count rounds: not compared)
            return False
        self._stall_epoch = current.epoch
        mine = set(current.members())
        live = [r for r in self.peer.live_members() if r.peer_id in mine]
        if out_of_memory(current, {r.peer_id: r for r in live}):
            return False  # a refit within less memory is planned next: not a step failing the same way
        steps = max([current.start_step, *(min(int(r.progress.get("step", 0)), self.job.steps) for r in live
                                           if isinstance(r.progress.get("step", 0), (int, float)))])
        self._stall = stalled(self._stall, steps)
        if self._stall[1] < MAX_STALLED_EPOCHS:
            return False
        why = next((str(r.progress["failed_why"]) for r in live if r.progress.get("failed_epoch") == current.epoch
                    and r.progress.get("failed_why")), "")
        error = (f"{self._stall[1]} epochs in a row broke before any peer trained past step {self._stall[0]} "
                 f"(of {self.job.steps})" + (f"; the last one said: {why}" if why else ""))
        ids = sorted(r.peer_id for r in ready_peers(self.peer))
        names = {r.peer_id: r.name for r in self.peer.live_members()}
        await self._stop_run(current, ids, current.epoch + 1, self.election.leader.term, names, error)
        return True

    async def _stop_run(self, current: Optional[StageMap], ids: list[str], epoch: int, term: int, names: dict,
                        error: str) -> None:
        """Publishes a map that says why the run cannot go on: every peer stops with that error."""
        base = current or placeholder_map(ids, self.handle.num_layers, self.job.job_id, epoch=epoch, names=names)
        await self.records.publish_map(replace(base, epoch=epoch, term=term, error=error))
        log.error("run stopped: %s", error)

    def _weigh(self, ids) -> None:
        now = time.time()
        for p in ids:
            if p not in self.weighed and len(self.weighed) < MAX_WEIGHED:
                self.weighed[p] = now

    def _searched(self, now: float, ready: list[str], took: float, answer: Optional[tuple] = None) -> None:
        """A search ran at ``now`` on ``ready`` in ``took`` s of CPU; ``answer``: its ``_gain_key``, if known."""
        every = replan_check_s(took)
        if (every > REPLAN_CHECK_S) != (self._check_every > REPLAN_CHECK_S):  # (once, not each search)
            log.info("searching for a better plan every %.0fs (the last search took %.2fs of CPU)", every, took)
        self._last_gain_check, self._searched_ready, self._check_every = now, ready, every
        self._last_search = now
        self._search_cpu.append((now, took))
        self._gain_key = answer or self._gain_key

    async def _worth_replanning(self, current: StageMap) -> bool:
        """A newcomer or a lasting change of links: re-plan only when a new plan is predicted to
        be much faster on the latest measurements, and still is a while later (the hysteresis)."""
        now = time.monotonic()
        if now - self._last_gain_check < REPLAN_CHECK_S or planning.model_profile(self.job) is None:
            return False
        records = ready_peers(self.peer)
        ready = sorted(r.peer_id for r in records)  # a newcomer: searched at once
        versions = measure_versions(records)
        changed = versions is None or versions != self._checked_versions
        while self._search_cpu and now - self._search_cpu[0][0] > REPLAN_WINDOW_S:
            self._search_cpu.popleft()
        if not search_due(ready != self._searched_ready, self._hysteresis.due(now), changed,
                          now - self._last_search, self._check_every, sum(c for _, c in self._search_cpu),
                          self._search_cpu[-1][1] if self._search_cpu else 0.0):
            return False
        self._last_gain_check, self._searched_ready = now, ready
        # (a map with islands is re-planned when a peer goes, not for a predicted gain yet; with a peer
        # done with the job, a new plan would only redo the others' last steps, the done ones' with them)
        if self.job.plan != "planner" or not self.measure_links or current.islands or \
                "done" in map_states(self.peer, current).values():
            return False
        ids, profiles, links = await self._measured_snapshot()
        # what is held, not what the records say: an entry the read did not bring yet is read at the next check
        self._checked_versions = measure_versions(records, *self._measured) if self._measured else None
        if not ids:
            return False
        key = measurements_key(ids, profiles, links, current)
        if self._gain_key is not None and self._gain_key[0] == key:
            gain, new_s, cur = self._gain_key[1:]  # the same measurements: the same answer
        else:
            snap = planning.snapshot(profiles, links, ids)
            cur = planning.current_cost(current, self.job, snap)
            new, took = await asyncio.to_thread(_timed, planning.make_plan, self.job, snap, "planner")
            self._searched(now, ready, took)
            self._weigh(ids)
            new_s = new.step_s
            gain = cur / new_s - 1 if new_s > 0 else 0.0
            self._gain_key = (key, gain, new_s, cur)
        verdict = self._hysteresis.update(gain, now)
        if verdict == "gone":
            log.info("re-plan gain gone (%.0f %%): no move", gain * 100)
        elif verdict == "hold":
            log.info("a new plan would be %.0f %% faster (%.3fs vs %.3fs per step): holding %.0fs before moving",
                     gain * 100, new_s, cur, REPLAN_HOLD_S)
        elif verdict == "move":
            log.info("re-planning: %.0f %% predicted gain has lasted %.0fs", gain * 100, REPLAN_HOLD_S)
        return verdict == "move"

    async def _epoch_broken(self, current: StageMap) -> bool:
        """A peer of the map abandoned this epoch, or is gone: its record is missing and it does
        not answer where it served last (a heartbeat late on a busy machine is no failure:
        re-planning around it would throw away the step in flight for nothing), and its last record
        in the view did not say it was done with the job (gone then, it left: ``Peer.gone_done``)."""
        broken, absent = epoch_verdict(current, {r.peer_id: r for r in self.peer.live_members()}, self.peer.gone_done)
        if broken:
            return True
        for p in absent:
            if not await is_alive(self.peer, p):
                return True
            log.info("%s: no fresh record, but it answers: its heartbeat is late, not a failure", current.name_of(p))
        return False

    async def _without_the_dead(self, current: StageMap, ids: list[str]) -> list[str]:
        """``ids`` less the peers that no longer answer where they served: a SIGKILLed peer's
        membership record lives on until it expires (a few heartbeats), and a map planned on it
        before then broke again at once (epochs 1 -> 2 -> 3 -> 4 for one kill, the run standing
        still meanwhile). Peers outside ``current`` are asked too: a peer killed in the epoch before
        looked like a newcomer to an improving re-plan (CI-like run, 2026-11-27 07:50 UTC: "26 %
        faster predicted" with the dead peer in it, which broke at once)."""
        # (a dead peer's port refuses at once: the timeout is for a live one slow to answer on a
        # loaded machine, which must not be planned out)
        alive = await asyncio.gather(*(is_alive(self.peer, p, PLAN_PROBE_S) for p in ids))
        dead = {p for p, ok in zip(ids, alive) if not ok}
        for p in sorted(dead - self._failed):  # bounded: ids are the members'
            if len(self._failed) >= MAX_FAILED_KEPT:
                break
            self._failed.add(p)
        if dead:
            log.info("planning without %s: no longer answering (epoch %d)",
                     ", ".join(current.name_of(p) if current.stage_of(p) is not None else self.peer.name_of(p)
                               for p in sorted(dead)), current.epoch)
        return [p for p in ids if p not in dead]

    async def _resume_point(self, current: Optional[StageMap]) -> tuple[Optional[int], int, str]:
        """(step to redo from, its data step, error): the latest step whose state of every layer
        survives. With islands: the latest round whose outer state of every layer survives (in any
        island: each holds every layer), and the data step that round began at."""
        stages = [tuple(st.layers) for st in current.stages] if current else []
        if current is not None and current.islands:
            pages = await self.recovery.inventory_pages()
            invs = [*self.outer.parse_inventories(pages).values(), self.outer.holding()]
            version, error = resume_point([x["layers"] for x in invs], self.handle.num_layers, stages)
            data = next((x["data_steps"][version] for x in invs if version in x["data_steps"]), 0)
            return version, data, error
        invs = await self.recovery.resume_inventories()
        step, error = resume_point(invs, self.handle.num_layers, stages)
        return step, step or 0, error

    async def _evictions(self, current: StageMap, force: bool = False) -> str:
        """Peers of ``current`` that most other replicas of their stage accuse, or most of the peers
        receiving their tensors (the gate): added to the evicted (for the job) and named in the
        returned reason to re-plan ("" if none). Read every few seconds, and at once (``force``)
        before re-planning a broken epoch. A job without the robust defences is never read for
        them: no replica judges and no gate refuses there, so no honest peer accuses (the planner
        read the key every second for nothing, ~3 control calls a second from it)."""
        if self.job is not None and self.job.aggregate != "robust":
            return ""
        now = time.monotonic()
        if not force and now - self._accusations_read < ACCUSATIONS_EVERY_S:
            return ""
        self._accusations_read = now
        accusations = await read_accusations(self.peer, self.log_bad)
        found = {p: f"accused by {n} peers that hold its layers" for p, n in evictions(
            accusations, [st.peers for st in current.stages], current.job_id, current.island_peers()).items()}
        by_gate = gate_evictions(accusations, self._receivers(current), current.job_id, self._lone_accusers)
        # a lone receiver's word waits a moment, and counts only while nobody accuses the accuser (an
        # attacker's honest neighbours answer its forgeries with odd tensors of their own)
        accused = {x for acc in accusations.values() if acc.job == current.job_id for x in (*acc.peers, *acc.gate)}
        for p, by in list(by_gate.items()):
            if len(by) == 1:
                first = self._lone_seen.setdefault((p, by[0]), now)
                if by[0] in accused or now - first < LONE_WAIT_S:
                    del by_gate[p]
        for p, by in by_gate.items():
            found.setdefault(p, f"its tensors refused by {', '.join(current.name_of(a) for a in by)}")
        new = {p: why for p, why in found.items() if p not in self.peer.evicted}
        if not new:
            return ""
        self._lone_accusers.update(by[0] for p, by in by_gate.items() if p in new and len(by) == 1)
        self.peer.evicted.update(new)
        why = ", ".join(f"{current.name_of(p)} ({w})" for p, w in sorted(new.items()))
        log.warning("evicting %s for the rest of the job", why)
        return f"evicted {why}"

    async def _copy_every(self, smap: StageMap, snap=None) -> int:
        """How many steps apart the map's buddy copies go (``decide.copy_every``), from the measured
        links and the map's predicted step (or the cost model's for a map without one); 1 where
        nothing is measured. ``snap``: the snapshot the map was planned on (else it is read). A
        4-peer run on 20 Mbit/s links once copied its 19 MB stages after every step, each copy took
        ~4 steps to land, and a crash found no step every layer was kept at: it began again at step 0.
        (Copies from several lone stages to one buddy share its link: the interval's margin of 2
        covers two; a map that changes the interval leaves a short while with no common step.)
        Spaced further where copies cost more than failures do: a copied byte's CPU cost measured
        here (``recovery.copy_cost_s_per_byte``) against the failure rate this planner has seen
        (``decide.swarm_mtbf_s``; a new planner starts from the prior). On loopback (4 peers, 6 MB
        stages, 0.8 s steps: copies every 5 steps now) the pace rose 0.9-3.4 % (issue 31)."""
        if not self.measure_links or planning.model_profile(self.job) is None:
            return 1
        try:
            if snap is None:
                ids, profiles, links = await self._measured_snapshot()
                if not ids:
                    return 1
                snap = planning.snapshot(profiles, links, ids)
            step_s = smap.predicted_step_s or planning.current_cost(smap, self.job, snap)
            peers = sum(len(st.peers) for st in smap.stages)
            now = time.time()
            watched, since = self._watched
            self._watched = (watched + (now - since) * peers if since else 0.0, now)
            mtbf = swarm_mtbf_s(peers, len(self._failed), self._watched[0])
            per_byte = await asyncio.to_thread(copy_cost_s_per_byte, self.peer.config.encrypt)
            every = copy_every(planning.buddy_copies(smap, self.job, snap), step_s, cost_s_per_byte=per_byte, mtbf_s=mtbf)
        except Exception as e:  # a bad measurement record must not stop a plan from going out
            log.warning("copy interval not computed (%r): copies after every step", e)
            return 1
        if every > 1:
            log.info("buddy copies every %d steps (predicted step %.3fs; the slowest copy to land within %.1f steps; "
                     "a copied byte costs %.2f ns of CPU, the swarm fails every %.0f s)", every, step_s,
                     every / COPY_MARGIN, per_byte * 1e9, mtbf)
        return every

    def _receivers(self, current: StageMap) -> dict[str, set[str]]:
        """Who receives each peer's tensors in ``current`` (each island's pipeline on its own)."""
        if not current.islands:
            return receivers([st.assign(self.job.num_micro_batches) for st in current.stages])
        out: dict[str, set[str]] = {}
        m = self.job.num_micro_batches // self.job.island_split
        for i in range(len(current.islands)):
            out.update(receivers([st.assign(m) for st in current.island_map(i).stages]))
        return out

    async def _plan_and_publish(self, current: Optional[StageMap], improve: bool = False, reason: str = "",
                                evicting: bool = False) -> bool:
        """Plans from the live swarm and publishes the stage map as the next epoch. ``improve``: the
        current map still runs and a better one is expected; a plan that would only reload the
        same layers on the same peers is not published. ``evicting``: the peers' grouping votes
        still count the evicted peer, so no quorum on them is waited for. False if it could not
        plan yet (too few peers measured, or no quorum on their groups): to be tried again."""
        job = self.job
        measured = job.plan != "even" and self.measure_links and planning.model_profile(job) is not None
        if measured:
            ready = sorted(r.peer_id for r in ready_peers(self.peer))
            ids, profiles, links = await self._measured_snapshot()
            if current is None and len(ids) < job.peers:
                return False
            if not ids or (not evicting and (self.groups_digest is None or not await self._quorum(ids, self.groups_digest))):
                if improve:
                    log.info("re-plan waits for the peers to agree on the groups of the %d measured", len(ids))
                return False
        else:
            ids = sorted(r.peer_id for r in ready_peers(self.peer))
            if current is None and len(ids) < job.peers:
                return False
        if current is not None:  # an improving re-plan too: one read as a kill slowed the steps
            ids = await self._without_the_dead(current, ids)  # planned on the dead peer (CI, 2026-11-27)
        live = {r.peer_id: r for r in self.peer.live_members()}
        names = {p: r.name for p, r in live.items()}
        epoch = (current.epoch if current else 0) + 1
        term = self.election.leader.term
        # the first map too starts where the layers' states are: step 0 in a new run, a
        # checkpoint's step in a resumed one (--resume)
        start, start_data, error = await self._resume_point(current)
        plan, why, snap = None, "", None
        if measured and not error:
            # a peer that ran out of memory under a plan is planned within less
            snap = planning.snapshot(profiles, links, ids, memory_caps(live))
            t0 = time.perf_counter()
            if current is not None:  # a re-plan keeps the run's way of syncing (a map with islands
                # resumes from their outer state, a global one from layer states)
                job = replace(job, sync=(job.sync if job.sync.startswith("islands") else "islands")
                              if current.islands else "global")
            try:
                (plan, why), took = await asyncio.to_thread(_timed, planning.make_sync_plan, job, snap, job.plan)
                self._weigh(ids)
            except planning.NoPlan as e:
                error = f"no plan can run this job on the {len(ids)} live peers: {e}"
        if error:
            await self._stop_run(current, ids, epoch, term, names, error)
            return True
        if isinstance(plan, IslandsPlan):
            smap = replace(planning.islands_stage_map(plan, job, epoch, names, term, start, why),
                           start_data_step=start_data)
            log.info("planned %d islands for %d peers in %.2fs: %s; %s", len(plan.islands), len(ids),
                     time.perf_counter() - t0, smap.bottleneck, why)
        elif plan is not None:
            smap = replace(planning.to_stage_map(plan, job, epoch, names, term, start), sync_reason=why[:300])
            if improve and current is not None and same_layout(smap, current):
                log.info("re-plan gives the same stages, peers and schedule: nothing to move")
                return True
            log.info("planned %d stages for %d peers in %.2fs: predicted %.3fs per step, bottleneck %s",
                     smap.num_stages, len(ids), time.perf_counter() - t0, plan.step_s, plan.bottleneck)
        else:
            smap = replace(placeholder_map(ids, self.handle.num_layers, job.job_id, epoch=epoch, names=names,
                                           start_step=start, num_stages=job.stages), term=term)
            if current is not None:  # a fixed plan's one lever: recompute where a peer ran out of memory
                smap, error = refit_fixed(current, smap, out_of_memory(current, live), job.recompute, self.peer.name_of)
                if error:
                    await self._stop_run(current, ids, epoch, term, names, error)
                    return True
        if job.recompute == "full":  # the map says every stage's lever, whoever placed the layers
            smap = replace(smap, stages=tuple(replace(st, recompute="full") for st in smap.stages))
        if job.shard_optimizer == "full" and job.aggregate == "sum":  # likewise, on every replicated stage
            smap = replace(smap, stages=tuple(replace(st, shard=len(st.peers) > 1) for st in smap.stages))
        if not smap.islands:  # (with islands, a crash resumes from the islands' outer state)
            smap = replace(smap, copy_every=await self._copy_every(smap, snap))
        evicted = tuple(sorted(self.peer.evicted))
        named = dict(smap.names)
        smap = replace(smap, evicted=evicted, names=smap.names + tuple(
            (p, names[p]) for p in evicted if names.get(p) and p not in named))  # people read the evicted by name
        smap = replace(smap, reason=reason[:300])
        await self.records.publish_map(smap)
        self.published.append((time.monotonic(), smap.summary()))
        self.replans += current is not None
        log.info("published stage map epoch %d (term %d)", smap.epoch, term)
        if measured and plan is not None and not smap.islands:
            # that search was on these measurements: the next check waits its interval, and on the same ones
            # finds no gain unsearched (it searched at once: 0.45 s of CPU as cee-3region's training began)
            key = measurements_key(ids, profiles, links, smap)
            self._searched(time.monotonic(), ready, took, (key, 0.0, plan.step_s, plan.step_s))
        return True
