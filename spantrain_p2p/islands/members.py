"""Islands: who takes part in each round's merge, so a silent island is left out and the others go on.

One peer, the *keeper* (the first stage's first replica of the island with the most steps a round,
``keeper_island``), decides each round's members. At its merge of round ``r`` it waits for the
islands it expects (``awaited_islands``: the last round's members and any island returning at
``r``) up to a round's time past its own round's end (``leave_after_s``), then takes every island
whose contributions to its layers are all there (``complete_islands``). Every other peer asks it
(``outer_members``) before merging and merges exactly the members' contributions, in island order,
so every island holds the same anchor. A left-out island's late contribution is refused (its round
is merged): none counts twice.

A left-out island drops its round's contribution and *catches up* before it contributes again
(``Membership._catch_up``). Round after round it brings its anchor to the members': it merges their
contributions itself where it holds them all, else fetches the keeper's latest outer state from a
member (while it fetches, it keeps the members' contributions of the rounds after it, up to
``CATCH_UP_AHEAD`` rounds ahead, so a fetch slower than a round still lands it on a round it can
merge forward from); it stops at the first round the keeper has not decided. Just behind (that is
the round after the dropped one) its progress since goes on; further behind, its progress is
dropped too and it rejoins at the round after (the rounds between are lost to it), and the keeper
waits for it there as for a member. The peers of a left-out island (its stages) each catch up on
their own layers; the keeper gives every one of them the same answer to the same question
(``_answers``), so they all reach the same round.

An island that cannot reach the keeper waits for it up to the job's receive timeout plus two
rounds, then fails the epoch, unless the keeper is alive (``swarm.liveness.is_alive``, the
planner's own question): then the link is cut, not the keeper gone, and it waits up to
``LIVE_KEEPER_WAIT_S`` more (a re-plan would give the same islands). A peer that lacks a member's
contribution past the keeper's wait takes the round as a replica of the same layers in its own
island merged it (``OuterSync._merged_nearby``); with no such replica, past the deadline, it fails
the epoch too (merging without it on one side and with it on another would split the anchors for
good). The next map resumes every island from the latest round they all hold. So a silent *keeper* island stops the others until it is back
or the epoch fails: the keeper is the island with the most compute, the one the others would least
want to leave out.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import NoReturn, Optional

from ..net.dataplane import RemoteError, Retry
from ..net.framing import FrameError, check_fields
from ..pipeline.executor import StepFailed
from ..swarm.liveness import is_alive, reachable_at

log = logging.getLogger("spantrain.train")

OUTER_MEMBERS = "outer_members"
LEAVE_ROUNDS = 1.0  # the keeper leaves out an island more than this many rounds late ...
LEAVE_MIN_S = 5.0  # ... and never sooner than this
POLL_S = 1.0  # the keeper holds a question about an undecided round this long before "retry"
KEEP_DECISIONS = 64  # decisions the keeper remembers (a peer further behind fails its epoch)
CATCH_UP_AHEAD = 16  # rounds ahead a catching-up peer keeps contributions of
LIVE_KEEPER_WAIT_S = 600.0  # past the deadline, a keeper still alive is waited for this long
MAX_INT = 1 << 50


def keeper_island(steps_per_round) -> int:
    """The island whose first peer decides each round's members: the one with the most steps a
    round (the most compute; the first of equals)."""
    return max(range(len(steps_per_round)), key=lambda i: (steps_per_round[i], -i))


def complete_islands(got, r: int, n_islands: int, layers) -> list[int]:
    """The islands whose contributions of round ``r`` to every one of ``layers`` are in ``got``
    (keys (round, island, layer)), in order."""
    return [i for i in range(n_islands) if all((r, i, layer) in got for layer in layers)]


def awaited_islands(r: int, n_islands: int, decisions: dict, returning: dict) -> set[int]:
    """The islands the keeper waits for at round ``r``: the last round's members (all of them at
    the first round it decides), and those returning at ``r`` (island -> round). An island left out
    is not waited for again; it is a member again once its contributions are there in time."""
    out = set(decisions[r - 1]) if r - 1 in decisions else set(range(n_islands))
    return out | {i for i, at in returning.items() if at == r}


def leave_after_s(round_s: float) -> float:
    """How long the keeper waits past its own round's end for an island's contributions."""
    return max(LEAVE_MIN_S, LEAVE_ROUNDS * round_s)


def parse_members(header, n_islands: int, island: int) -> tuple[list[int], Optional[tuple[int, int]]]:
    """The keeper's answer (untrusted): (the round's members, in order; for a left-out island the
    keeper's latest outer state: (version, the data step that round began at)."""
    if not isinstance(header, dict):
        raise FrameError("the keeper's answer has no header")
    members = header.get("members")
    if (not isinstance(members, list) or not members or len(members) > n_islands
            or any(type(i) is not int or not 0 <= i < n_islands for i in members) or members != sorted(set(members))):
        raise FrameError("the keeper's members are not a list of this map's islands")
    if island in members:
        return members, None
    latest = header.get("latest")
    if not isinstance(latest, list) or len(latest) != 2 or any(type(x) is not int or not 0 <= x < MAX_INT for x in latest):
        raise FrameError("the keeper left this island out without saying where the others are")
    return members, (latest[0], latest[1])


class Membership:
    """The members' part of ``outer_sync.OuterSync`` (a mixin: it uses the exchange's state)."""

    def _init_members(self) -> None:
        self._keeper: Optional[str] = None  # the peer that decides each round's members
        self.decisions: dict[int, list[int]] = {}  # the keeper's: round -> its members
        self._returning: dict[int, int] = {}  # the keeper's: island -> the round it returns at
        self._answers: dict[tuple, Optional[dict]] = {}  # the keeper's to a left-out island, by question
        self._decided = asyncio.Event()
        self._catching_up = False
        self.left_out: list[dict] = []  # the keeper's: rounds merged without some islands
        # the keeper's, by epoch: (rounds with an island left out, the left-out islands' data steps
        # of them), complete where the report lists only the last rows
        self.left_out_totals: dict[int, list[int]] = {}
        self.rejoins: list[dict] = []  # this peer's island left out: how it caught up

    def _begin_members(self, smap) -> None:
        self._keeper = self._owners[keeper_island([x.steps_per_round for x in smap.islands])][0][0]
        self.decisions, self._returning, self._answers, self._catching_up = {}, {}, {}, False

    # ---- the keeper -------------------------------------------------------------------------------
    async def _decide(self, r: int, layers: list[int], leave_at: float) -> list[int]:
        """Round ``r``'s members, at the keeper's merge of it: decided already (``_maybe_decide``: every
        awaited island's contributions came in time), else the islands whose contributions to the
        keeper's layers are here at ``leave_at`` (its own always are)."""
        n = len(self.smap.islands)
        while r not in self.decisions and time.time() < leave_at:
            await self._wait_arrival(leave_at)
            self._maybe_decide(r)
        if r not in self.decisions:
            self._record(r, complete_islands(self._got, r, n, layers))
        return self.decisions[r]

    def _maybe_decide(self, r: int) -> None:
        """The keeper decides round ``r`` as soon as it can: once it has ended that round itself, the
        round before is decided, and every awaited island's contributions to its layers are here.
        Deciding then, not at its own next round's end, lets every island merge as soon as it holds
        the round's contributions, however the islands' rounds fall against the keeper's."""
        if (self.peer.peer_id != self._keeper or self.outer is None or r in self.decisions
                or r >= self.round or (r > self._first_round and r - 1 not in self.decisions)):
            return
        n, layers = len(self.smap.islands), sorted(self.outer.params)
        members = complete_islands(self._got, r, n, layers)
        if self.island in members and awaited_islands(r, n, self.decisions, self._returning) <= set(members):
            self._record(r, members)

    def _record(self, r: int, members: list[int]) -> None:
        n = len(self.smap.islands)
        self.decisions[r] = members
        for old in sorted(self.decisions)[:-KEEP_DECISIONS]:
            del self.decisions[old]
        self._answers = {k: a for k, a in self._answers.items() if k[1] >= min(self.decisions)}
        self._returning = {i: at for i, at in self._returning.items() if at > r}
        self._decided.set()
        self._decided = asyncio.Event()
        out = [i for i in range(n) if i not in members]
        if out:
            log.warning("round %d: island(s) %s left out (no contribution within %.1fs of this island's round "
                        "end, or left out before); the others go on", r, out, leave_after_s(self._round_s()))
            self.left_out.append({"round": r, "islands": out, "epoch": self.smap.epoch})
            totals = self.left_out_totals.setdefault(self.smap.epoch, [0, 0])
            totals[0] += 1
            totals[1] += sum(self.smap.islands[i].steps_per_round for i in out)
            self.on_event({"kind": "island_left_out", "round": r, "islands": out, "t": time.time()})
        self._maybe_decide(r + 1)  # (its contributions may all be here already)

    async def on_members(self, header: dict, buffers):
        """The keeper's handler of ``outer_members``: round ``r``'s members once decided (held up to
        ``POLL_S``, then "retry"; at once for an island catching up, which the keeper then expects at
        the next round), and for a left-out island the keeper's latest outer state."""
        check_fields(header, {"job": str, "epoch": int, "round": int, "island": int})
        returning = header.get("returning")
        if returning is not None and (type(returning) is not int or not header["round"] <= returning <= header["round"] + 1):
            raise FrameError("returning must be the round asked about or the next")
        self._check_current(header, "question")
        if self.peer.peer_id != self._keeper:
            raise FrameError("this peer does not decide the rounds' members")
        r, i = header["round"], header["island"]
        if not 0 <= i < len(self.smap.islands):
            raise FrameError(f"island {i} is not an island of this map")
        # every peer of a left-out island hears the same answer to the same question, whenever it
        # asks: where the others are, and (catching up) whether the round was decided; so they all
        # catch up to the same round
        said = self._answers.get((i, r, returning), False)
        if said is not False:
            if said is None:
                raise Retry(f"round {r}'s members were not decided when this island first asked")
            return said, []
        if self.decisions and self._first_round <= r < min(self.decisions):
            # a round too old to remember: the asker is left out of it and far behind; it fetches the
            # latest state from the keeper's island (the "members" it is given to fetch from)
            latest = max(self.versions)
            return {"members": [self.island], "latest": [latest, self.versions[latest][0]]}, []
        self._maybe_decide(r)
        if r not in self.decisions:
            if r > self.round + 2 or r < self._first_round:
                raise FrameError(f"round {r} is not one this peer decides (it is in round {self.round})")
            if returning is not None:  # it contributes to that round next: waited for there
                self._expect_back(i, r, returning, f"round {r}'s members are not decided yet")
            try:
                await asyncio.wait_for(self._decided.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass
            if r not in self.decisions:
                raise Retry(f"round {r}'s members are not decided yet")
        members = self.decisions[r]
        if i not in members and returning == r + 1 and returning not in self.decisions and returning >= self._first_round:
            # caught up to round r's state while the keeper is still in the next: expected there, as
            # where r is undecided (else an island whose fetch takes as long as a round of the others
            # catches up to each round just after it is decided, for good: the cut-off test, 1 in 2)
            self._expect_back(i, r, returning, f"round {r}'s members were decided; this island is expected at round {returning}")
        out = {"members": members}
        if i not in members:
            latest = max(self.versions)
            out["latest"] = [latest, self.versions[latest][0]]
            self._answers[(i, r, returning)] = out
        return out, []

    def _expect_back(self, i: int, r: int, returning: int, why: str) -> NoReturn:
        """Island ``i``, catching up, contributes again at round ``returning``: the keeper waits for it
        there, and its question about round ``r`` gets this answer (a Retry) every time it is asked."""
        self._returning[i] = returning
        self._answers[(i, r, returning)] = None
        raise Retry(why)

    # ---- every other peer -------------------------------------------------------------------------
    async def _ask_members(self, r: int, deadline: float, returning: Optional[int] = None):
        """Round ``r``'s members from the keeper and, where this island is left out, the keeper's
        latest (version, data step). A keeper silent until ``deadline`` fails the epoch, unless it
        is alive (``is_alive``: with SWIM a ping past the emulated link; its membership record is no
        answer there: SWIM declares a member across a cut dead in seconds, and the view drops it):
        then the link to it is cut (a keeper that dies or hangs does not answer, and the planner
        re-plans without it), and failing the epoch would only
        re-plan the same islands and send every island back to the last round they all hold (a
        90 s cut on two-sites: 2 such re-plans, 52 data steps redone); it is waited for up to
        ``LIVE_KEEPER_WAIT_S`` more, and catches this island up once back. ``returning``: a
        catching-up island's question, with the round it contributes to next (``r`` or ``r + 1``),
        answered at once: None while undecided."""
        n = len(self.smap.islands)
        header = {"job": self.job.job_id, "epoch": self.smap.epoch, "round": r, "island": self.island,
                  "returning": returning}
        said_cut, asked = False, (0.0, False)  # (when, answer) of the last liveness ping
        while True:
            url = reachable_at(self.peer, self._keeper)
            try:
                if url is None:
                    raise ConnectionError("no live address")
                reply = await self.peer.client.send(url, OUTER_MEMBERS, header, timeout=POLL_S + self.job.recv_timeout_s,
                                                    link=self.peer.link_to(self._keeper), peer_id=self._keeper)
                return parse_members(reply[0] if reply else None, n, self.island)
            except RemoteError as e:
                if e.status == 503 and returning is not None:
                    return None
                if e.status != 503:
                    log.warning("round %d: the keeper %s refused the question: %s", r,
                                self.smap.name_of(self._keeper), e)
            except FrameError as e:
                log.warning("round %d: the keeper's answer is unusable: %s", r, e)
            except (OSError, ConnectionError, asyncio.TimeoutError) as e:
                log.debug("round %d: cannot reach the keeper: %r", r, e)
            now = time.time()
            if now >= deadline:
                if now - asked[0] >= POLL_S:  # (a failing send loops every 0.1 s: one ping a poll)
                    asked = (now, await is_alive(self.peer, self._keeper))
                live = asked[1]
                if not live or now >= deadline + LIVE_KEEPER_WAIT_S:
                    self.on_event({"kind": "island_silent", "round": r, "keeper": True, "t": now})
                    raise StepFailed(f"round {r}: the keeper {self.smap.name_of(self._keeper)} gave no members in time")
                if not said_cut:
                    said_cut = True
                    log.warning("round %d: the keeper %s does not answer but is alive (a cut "
                                "link?): waiting for it up to %.0fs more", r, self.smap.name_of(self._keeper),
                                LIVE_KEEPER_WAIT_S)
            await asyncio.sleep(0.1)

    async def _catch_up(self, r: int, members: list[int], layers: list[int],
                        latest: tuple[int, int]) -> Optional[tuple[int, int, int]]:
        """This island was left out of round ``r`` (or returned after it): its own contribution is
        dropped and it brings its anchor to the members' round by round (module docstring). Returns
        None where its progress since goes on (round ``r + 1``'s), else where it rejoins: (version
        x, round x's first data step, round x + 1's): round x + 1 from the anchor of version x."""
        per_round = sum(x.steps_per_round for x in self.smap.islands)
        dropped = all((r, self.island, layer) in self._got for layer in layers)
        base_r, x, fetched = self._round_base[r], r, []
        self._cancel_sends()  # its own contribution is dropped: none of it need arrive
        # each question and fetch has the whole receive timeout (plus two rounds): a cut may have
        # taken most of the one it was left out in
        deadline = lambda: time.time() + self._patience_s()  # noqa: E731
        # every peer of this island goes to the same version: the keeper gives them all the same
        # answers (``on_members``); each gets there by merging what it holds, else by fetching it
        target = max(latest[0], r + 1)
        self._catching_up = True
        try:
            while True:
                while x < target:
                    if x > r:  # (decided: the target is at most the keeper's latest state)
                        members, _latest = await self._ask_members(x, deadline())
                    if all((x, i, layer) in self._got for i in members for layer in layers):
                        self._apply(x, members, layers, 0.0)  # (the members' own arithmetic: the same anchor)
                        x += 1
                        continue
                    self.round = target  # contributions missing (a cut): while it fetches, later ones are kept
                    for layer in layers:
                        holders = [p for j, own in enumerate(self._owners) if j != self.island for p in own[layer]]
                        a, m = await self.fetch(layer, target, holders, self.outer.sizes()[layer], deadline=deadline())
                        self.outer.load(layer, a, m)
                    fetched.append(target)
                    for key in [k for k in self._got if k[0] < target]:
                        del self._got[key]
                    x = target
                # the anchor is version x now: where round x is past the run's end, it is the last;
                # else is round x decided (and this island out of it)?
                self.round = x + 1
                base_x = base_r + (x - r) * per_round
                if base_x >= self.job.steps:
                    break
                final = base_x + per_round >= self.job.steps  # round x is the run's last: wait for it
                answer = await self._ask_members(x, deadline(), returning=None if final else (x if x == r + 1 else x + 1))
                if answer is None:
                    break
                members, latest = answer
                if self.island in members:  # (it sent nothing of round x: not a member; a keeper's bug)
                    raise StepFailed(f"round {x}: the keeper counts this island in, which sent nothing")
                target = max(latest[0], x + 1)
        finally:
            self._catching_up = False
        for layer in layers:
            self.outer.feedback.clear(layer)  # what the codec held back of a dropped contribution
        jump = None if x == r + 1 else (x, base_x, base_x + per_round)
        how = (f"fetched the outer state of round(s) {fetched}" if fetched else "merged the members' contributions")
        log.warning("round %d: this island (%d) was left out%s; it %s%s", r, self.island,
                    " and its contribution dropped" if dropped else "", how,
                    f" and rejoins at round {x + 1}" if jump else "")
        self.rejoins.append({"round": r, "dropped": dropped, "fetched": fetched, "caught_up_to": x,
                             "rejoined": jump is not None, "epoch": self.smap.epoch})
        self.on_event({"kind": "island_rejoined", "round": r, "version": x, "t": time.time()})
        return jump
