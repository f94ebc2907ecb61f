"""The trainer's decisions, as plain functions over plain data (no network, no clock of their own):
re-plan now or hold, is the running epoch broken, where to resume, which peer holds a copy of this
peer's layers, and when each peer pings its short links. Each is unit-tested without a swarm
(tests/test_decide.py); the components that act on them live beside this module."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Collection, Mapping, Optional, Sequence

from ..plan.stagemap import MAX_COPY_EVERY, StageMap
from ..models import state as layer_state

REPLAN_GAIN = 0.15  # a new plan must be predicted this much faster...
REPLAN_HOLD_S = 10.0  # ...for this long (checked every REPLAN_CHECK_S) before stages move
REPLAN_CHECK_S = 5.0
# the planner's search for a better plan (on each change of the measurements) takes at most this
# share of a core: at lan-20 it searched every 5 s as links changed (0.08-0.40 s of CPU each), and
# was most of the planner's 13 % of a core for the control plane (issue 33, ``scripts/control_cpu.py``)
REPLAN_CPU_SHARE = 0.02
REPLAN_CHECK_MAX_S = 60.0  # (a newcomer is searched for at once, ``Coordinator._worth_replanning``)
REPLAN_WINDOW_S = 60.0  # ...a share kept over this window: searches may come REPLAN_CHECK_S apart within it


def replan_check_s(search_cpu_s: float) -> float:
    """Seconds between two searches for a better plan on the same peers, the last of which took
    ``search_cpu_s`` of CPU: ``REPLAN_CHECK_S``, or longer where a search costs more than
    ``REPLAN_CPU_SHARE`` of a core at that pace (a large swarm's planner), ``REPLAN_CHECK_MAX_S`` at most."""
    return min(REPLAN_CHECK_MAX_S, max(REPLAN_CHECK_S, search_cpu_s / REPLAN_CPU_SHARE))


def search_due(newcomer: bool, hold_due: bool, measured_changed: bool, since_search_s: float, every_s: float,
               window_cpu_s: float, expected_cpu_s: float, share: float = REPLAN_CPU_SHARE,
               window_s: float = REPLAN_WINDOW_S) -> bool:
    """Whether the planner searches for a better plan at this check (checks come ``REPLAN_CHECK_S``
    apart): at once for a newcomer or a held gain whose hold is over; never for unchanged
    measurements, which give the last answer again; for changed ones (a record says a newer profile
    or links than the planner holds) while the searches of the last ``window_s`` (``window_cpu_s``
    of CPU) and this one (about ``expected_cpu_s``, the last one's) stay within ``share`` of a core
    over that window, or else ``every_s`` (``replan_check_s``) after the last search (a search
    dearer than the whole window's share: a large swarm's).

    A cut link reaches the planner piece by piece, each peer's links entry as that peer sees it,
    over several seconds: with searches ``every_s`` apart (11-17 s on cee-3region, 0.22-0.34 s of CPU
    each), the one that saw the cut whole came 2-16 s after the cut, and the re-plan 10 s after
    that (the hold). Paced by the window, a quiet swarm searches each piece as it comes."""
    if newcomer or hold_due:
        return True
    if not measured_changed:
        return False
    return since_search_s >= every_s or window_cpu_s + expected_cpu_s <= share * window_s


def same_layout(a: StageMap, b: StageMap) -> bool:
    """Same stages on the same peers with the same layers, micro-batch shares (to 1 %) and schedule."""
    def key(m: StageMap):
        return m.schedule, [(tuple(sorted((p, round(v, 2)) for p, v in st.share_of().items())), tuple(st.layers))
                            for st in m.stages]
    return key(a) == key(b)


@dataclass
class ReplanHysteresis:
    """Re-plan only when a new plan is predicted at least ``gain`` faster, and still is ``hold_s``
    later: a short blip never moves a stage. ``update`` takes each fresh prediction and says what
    to do: "move", "hold" (a gain appeared: wait), "gone" (a held gain vanished) or "stay"."""

    gain: float = REPLAN_GAIN
    hold_s: float = REPLAN_HOLD_S
    since: Optional[float] = None  # when the current run of large gains began

    def update(self, gain: float, now: float) -> str:
        if gain < self.gain:
            verdict = "gone" if self.since is not None else "stay"
            self.since = None
            return verdict
        if self.since is None:
            self.since = now
            return "hold"
        if now - self.since < self.hold_s:
            return "stay"
        self.since = None
        return "move"

    def defer(self, now: float) -> None:
        """A move the planner could not make yet (no quorum yet on the groups of the peers it would
        plan on): held long enough already, it is checked again, and made, at the next check.
        Without this, such a move was never tried again: the hold was reset and the measurements the
        gain was on did not change again, so two joiners were never planned in (a suite run,
        2026-12-02)."""
        self.since = now - self.hold_s

    def due(self, now: float) -> bool:
        """Whether a held gain has been held ``hold_s``: to be checked again then, not at the
        search's interval (a planner whose search took 0.47 s of CPU searched every 23 s, and held
        two newcomers' 144 % gain for 22 s, not 10; at a large swarm's pace a minute)."""
        return self.since is not None and now - self.since >= self.hold_s


def epoch_verdict(smap: StageMap, live: Mapping[str, object], done: Collection[str] = ()) -> tuple[bool, list[str]]:
    """(broken, peers to ask): the epoch is broken if a peer of the map abandoned it (state
    ``recovering`` with this ``failed_epoch``); peers of the map with no fresh record are returned
    in map order, to be asked whether they still answer (a record that expired on a busy machine
    is no death), but not those ``done`` (whose last record said they were done with the job): one
    that left then broke nothing (a planner that re-planned when the done peers left published a
    map for a job over). ``live``: peer id -> record (``state``, ``progress``)."""
    absent = []
    for st in smap.stages:
        for p in st.peers:
            r = live.get(p)
            if r is None:
                if p not in done:
                    absent.append(p)
            elif r.state == "recovering" and r.progress.get("failed_epoch") == smap.epoch:
                return True, []
    return False, absent


MAX_STALLED_EPOCHS = 6  # epochs broken in a row with no new step trained: the run stops, saying why


def stalled(before: tuple[int, int], steps_now: int) -> tuple[int, int]:
    """(the most steps the run has trained, epochs broken in a row since that last grew), after one
    more broken epoch whose live peers have trained ``steps_now`` steps at most. A step that fails
    every time (a model that raises, a stage too slow for the receive timeout) breaks epoch after
    epoch at the same step: with ``MAX_STALLED_EPOCHS`` of them the planner stops the run with the
    error instead of re-planning it forever; a run that trains past its best step starts over at 0."""
    best, n = before
    return (steps_now, 0) if steps_now > best else (best, n + 1)


def resume_point(inventories: Sequence[Mapping[int, Sequence[int]]], num_layers: int,
                 stages: Sequence[tuple[int, int]]) -> tuple[Optional[int], str]:
    """(step to redo from, error): the latest step at which a state of every layer survives in
    ``inventories`` (layer -> steps held, one per peer). Step 0 is every layer's initial state, which
    any peer rebuilds from the job's seed. ``stages``: the layer ranges, for the error message."""
    invs = [*inventories, {i: [0] for i in range(num_layers)}]
    step, missing = layer_state.resume_step(invs, num_layers)
    if missing:
        spans = [(a, b) for a, b in stages if any(a <= m < b for m in missing)]
        return None, (f"layers {missing} (of stage range {spans}) have no surviving copy: no live replica and "
                      f"no checkpoint on any live peer; the run cannot continue without losing them")
    if step is None:
        return None, "the surviving copies of the layers share no common step"
    return step, ""


def choose_buddy(smap: StageMap, stage: int, me: str, rtt_ms: Callable[[str], float]) -> Optional[str]:
    """Where a peer's layers are copied after each step: nowhere if a replica of its stage holds
    them anyway, else the peer of the map nearest to it (smallest RTT, then peer id). A sharded
    stage's replica holds its own layers' optimizer state alone: those are copied (to host memory:
    a replica of the same fast group is likely the nearest)."""
    if len(smap.stages[stage].peers) > 1 and not smap.stages[stage].shard:
        return None
    others = [p for st in smap.stages for p in st.peers if p != me]
    if not others:
        return None
    return min(others, key=lambda p: (rtt_ms(p), p))


COPY_MARGIN = 2.0  # a buddy copy is given this many times its predicted transfer time


PEER_MTBF_S = 3600.0  # a peer's mean time between failures before any is seen (volunteers' sessions last hours)
FAILURE_SPACED_MAX = 8  # failure-spaced copies at most this many steps apart (a copy carries 8 loss rows)


def copy_every(copies: Sequence[tuple[float, float]], step_s: float, limit: int = MAX_COPY_EVERY,
               cost_s_per_byte: float = 0.0, mtbf_s: float = math.inf) -> int:
    """How many steps apart buddy copies are taken (``StageMap.copy_every``): ``copies`` holds, per
    stage whose layers go to a buddy, (bytes of its state, bytes/s of its slowest peer's link to its
    nearest other peer); ``step_s``: the map's step time. The larger of two intervals:

    - landing: every peer keeps its own snapshots of the last few multiples, so a copy must land
      within one interval: the slowest copy, with a margin, over the step. A 19 MB stage over
      20 Mbit/s with 2 s steps: 8 s a copy, every 8 steps.
    - failures (with ``cost_s_per_byte``, the CPU seconds a copied byte costs its two ends, and
      ``mtbf_s``, the swarm's mean time between failures, ``swarm_mtbf_s``): Young's interval
      sqrt(2 C M), where C is the largest stage's copy cost (each peer copies its own stage at
      once, on its own CPU, to a peer that receives one): copying after every step pays C every
      step to save at most one step's redo per failure, which comes once in M. At most
      ``FAILURE_SPACED_MAX`` steps. A crash then redoes the steps since the last copy: none lost.

    1 (a copy after every step) where neither says more, or where nothing is known."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    every = 1
    worst = max((b / bw for b, bw in copies if b > 0 and bw > 0), default=0.0)
    if worst > 0 and math.isfinite(worst):
        every = max(1, min(limit, math.ceil(COPY_MARGIN * worst / step_s)))
    cost = cost_s_per_byte * max((b for b, _ in copies if b > 0 and math.isfinite(b)), default=0.0)
    if cost > 0 and math.isfinite(cost) and mtbf_s > 0:
        young = math.sqrt(2 * cost * mtbf_s)  # inf where no failure is expected
        steps = young // step_s if math.isfinite(young) else math.inf
        every = max(every, int(min(FAILURE_SPACED_MAX, limit, steps)))
    return every


def swarm_mtbf_s(peers: int, failures: int = 0, watched_peer_s: float = 0.0, prior_s: float = PEER_MTBF_S) -> float:
    """The swarm's mean time between failures, for ``copy_every``: a peer's (the prior, one failure's
    worth, plus what was watched: ``watched_peer_s`` peer-seconds with ``failures`` peers lost in
    them), shared by ``peers``."""
    per_peer = (prior_s + max(0.0, watched_peer_s)) / (1 + max(0, failures))
    return per_peer / max(1, peers)


@dataclass(frozen=True)
class PingSlots:
    """When the peers with short links ping them again, one turn after another."""

    turn: tuple[str, ...]  # peers with short links, in slot order
    t0: float  # unix time the first slot starts
    end: float  # unix time the last slot ends
    slot_s: float
    at_once: int

    def start_of(self, peer_id: str) -> Optional[float]:
        if peer_id not in self.turn:
            return None
        return self.t0 + (self.turn.index(peer_id) // self.at_once) * self.slot_s


def ping_slots(records: Mapping[str, tuple[bool, float]], members: set, at_once: int, slot_s: float,
               margin_s: float = 0.3) -> Optional[PingSlots]:
    """Every peer derives the same slots from the same PINGS records (peer id -> (has short links,
    unix time its pings finished)): they start ``margin_s`` after the last peer finished, and take
    the peers with short links in peer-id order, ``at_once`` per slot. Records of non-members or
    with a non-finite time get no slot; None when nobody has short links."""
    recs = {p: v for p, v in records.items() if p in members and math.isfinite(v[1])}
    turn = sorted(p for p, (has, _) in recs.items() if has)
    if not turn:
        return None
    t0 = max(f for _, f in recs.values()) + margin_s
    return PingSlots(tuple(turn), t0, t0 + -(-len(turn) // at_once) * slot_s, slot_s, at_once)


# ---- a peer out of memory ---------------------------------------------------------------------------
MAX_MEMORY_CAP = 2**50  # bytes: a cap above this is no figure (records are untrusted)
CAP_MARGIN = 0.9  # a peer that ran out under a plan is planned below this share of what it was predicted to hold


def memory_caps(live: Mapping[str, object]) -> dict[str, int]:
    """Peer -> the bytes it says it can hold at most (``progress["memory_cap"]``, set after it ran
    out of memory under a plan): a peer can only lower its own figure, so an invalid cap is ignored."""
    caps = {}
    for p, r in live.items():
        cap = r.progress.get("memory_cap")
        if isinstance(cap, int) and not isinstance(cap, bool) and 0 < cap <= MAX_MEMORY_CAP:
            caps[p] = cap
    return caps


def out_of_memory(smap: StageMap, live: Mapping[str, object]) -> list[str]:
    """The peers of ``smap`` that abandoned it because their device ran out of memory."""
    return [p for st in smap.stages for p in st.peers
            if (r := live.get(p)) is not None and r.state == "recovering"
            and r.progress.get("failed_epoch") == smap.epoch and r.progress.get("oom") == 1]


def refit_fixed(current: StageMap, new: StageMap, oom: Sequence[str], lever: str,
                name_of: Callable[[str], str] = str) -> tuple[StageMap, str]:
    """A fixed plan (``--plan even``, ``--stages``) after peers ran out of memory under ``current``:
    ``new`` with activation recomputation on every stage of ``new`` whose layers a stage of
    ``current`` recomputed or held on a peer that ran out, when the job lets the planner choose it
    (``lever`` auto). (map, error): an error where a peer ran out with recomputation already on, or
    with it off by the job (``--recompute none``): a fixed plan has no other lever, and the same map
    again would only fail again."""
    ran_out = {st.layers: st for st in current.stages if set(st.peers) & set(oom)}
    for st in ran_out.values():
        if st.recompute != "none" or lever == "none":
            who = ", ".join(name_of(p) for p in st.peers if p in oom)
            return new, (f"{who} ran out of memory on layers [{st.layers[0]},{st.layers[1]}) with activation "
                         f"recomputation {st.recompute}: this fixed plan does not fit its device; more peers, "
                         f"--plan auto (which places layers by memory) or a smaller micro-batch would")
    full = {st.layers for st in current.stages if st.recompute == "full"} | set(ran_out)
    return replace(new, stages=tuple(replace(st, recompute="full") if st.layers in full else st
                                     for st in new.stages)), ""
