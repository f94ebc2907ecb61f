"""The trainer's decisions, without a swarm: re-plan hysteresis, a broken epoch, the resume point,
the buddy and the ping slots (same_layout: tests/test_job_stagemap.py)."""
from __future__ import annotations

import math
import types

import pytest

from spantrain_p2p.plan.stagemap import Stage, StageMap
from spantrain_p2p.train.decide import (REPLAN_GAIN, REPLAN_HOLD_S, ReplanHysteresis, choose_buddy, epoch_verdict,
                                        ping_slots, resume_point)
from spantrain_p2p.train import decide as dc

MAP = StageMap(3, "j", (Stage(("a", "b"), (0, 2), (0.5, 0.5)), Stage(("c",), (2, 4), (1.0,)),
                        Stage(("d",), (4, 6), (1.0,))))


def _rec(state="training", **progress):
    return types.SimpleNamespace(state=state, progress=progress)


def test_a_lasting_gain_moves_stages_once_it_held_long_enough():
    h = ReplanHysteresis()
    assert h.update(REPLAN_GAIN + 0.1, now=100.0) == "hold"
    assert h.update(REPLAN_GAIN + 0.1, now=100.0 + REPLAN_HOLD_S - 1) == "stay"
    assert h.update(REPLAN_GAIN + 0.1, now=100.0 + REPLAN_HOLD_S) == "move"
    assert h.update(REPLAN_GAIN + 0.1, now=200.0) == "hold"  # after a move, a new gain holds again


def test_a_held_gain_is_due_for_a_check_once_its_hold_is_over_and_not_before():
    h = ReplanHysteresis()
    assert not h.due(0.0)  # nothing held
    h.update(0.5, now=100.0)
    assert not h.due(100.0 + REPLAN_HOLD_S - 1) and h.due(100.0 + REPLAN_HOLD_S)
    h.update(0.5, now=100.0 + REPLAN_HOLD_S)  # moved
    assert not h.due(1000.0)


def test_a_short_blip_moves_nothing():
    h = ReplanHysteresis()
    assert h.update(0.5, now=0.0) == "hold"
    assert h.update(0.01, now=5.0) == "gone"  # the gain went away before the hold ended
    assert h.update(0.5, now=10.0) == "hold"  # and the next one starts its hold afresh
    assert h.update(0.5, now=10.0 + REPLAN_HOLD_S * 0.9) == "stay"
    assert h.update(REPLAN_GAIN - 0.01, now=30.0) == "gone"
    assert h.update(0.0, now=31.0) == "stay"


def test_an_epoch_is_broken_when_a_peer_abandoned_it():
    live = {p: _rec() for p in "abcd"}
    assert epoch_verdict(MAP, live) == (False, [])
    live["c"] = _rec("recovering", failed_epoch=3)
    assert epoch_verdict(MAP, live) == (True, [])
    live["c"] = _rec("recovering", failed_epoch=2)  # an older epoch's failure says nothing of this one
    assert epoch_verdict(MAP, live) == (False, [])


def test_peers_without_a_fresh_record_are_to_be_asked_in_map_order():
    live = {"a": _rec(), "c": _rec()}
    assert epoch_verdict(MAP, live) == (False, ["b", "d"])
    assert epoch_verdict(MAP, live, done={"b"}) == (False, ["d"])  # b was done with the job: it left


def test_a_run_stalls_after_epochs_in_a_row_break_with_no_new_step_and_training_past_its_best_starts_over():
    st = (-1, 0)
    st = dc.stalled(st, 25)  # epoch 1 trained 25 steps, then a peer died: progress
    assert st == (25, 0)
    st = dc.stalled(st, 18)  # resumed at 18, broke again before 25: no new step
    st = dc.stalled(st, 25)
    assert st == (25, 2)
    assert dc.stalled(st, 26) == (26, 0)  # past the best: counting starts over
    for _ in range(dc.MAX_STALLED_EPOCHS - 2):
        st = dc.stalled(st, 3)
    assert st == (25, dc.MAX_STALLED_EPOCHS)


def test_resume_from_the_latest_step_every_layer_survives_at():
    assert resume_point([{0: [4, 5], 1: [4]}, {2: [3, 4]}], 3, [(0, 3)]) == (4, "")
    assert resume_point([{i: [4, 5] for i in range(6)}, {2: [5]}], 6, [(0, 6)]) == (5, "")


def test_resume_from_the_start_when_nothing_survives_but_the_seed():
    step, err = resume_point([], 4, [(0, 4)])
    assert (step, err) == (0, "")


def test_lost_layers_stop_the_run_with_the_reason():
    step, err = resume_point([{0: [3], 1: [3]}, {2: [3]}], 4, [(0, 2), (2, 4)])
    # layer 3 survives only as its initial state: the run redoes from step 0, nothing is lost
    assert step == 0 and err == ""


def test_a_replicated_stage_needs_no_buddy_and_a_single_peer_takes_the_nearest():
    rtt = {"a": 5.0, "b": 5.0, "c": 1e9, "d": 2.0}.get
    assert choose_buddy(MAP, 0, "a", rtt) is None
    assert choose_buddy(MAP, 1, "c", rtt) == "d"
    assert choose_buddy(MAP, 2, "d", rtt) == "a"  # a tie on RTT goes to the smaller peer id
    alone = StageMap(1, "j", (Stage(("x",), (0, 6), (1.0,)),))
    assert choose_buddy(alone, 0, "x", rtt) is None


def test_ping_slots_start_after_the_last_peer_finished_and_take_turns():
    recs = {"p3": (True, 100.0), "p1": (True, 101.0), "p2": (False, 102.0), "p4": (True, 99.0),
            "gone": (True, 500.0), "bad": (True, math.nan)}
    slots = ping_slots(recs, {"p1", "p2", "p3", "p4", "bad"}, at_once=2, slot_s=0.5)
    assert slots.turn == ("p1", "p3", "p4")  # short links only, peer-id order, members with a valid time
    assert slots.t0 == 102.0 + 0.3
    assert slots.start_of("p1") == slots.start_of("p3") == 102.3
    assert slots.start_of("p4") == 102.8
    assert slots.end == 102.3 + 2 * 0.5
    assert slots.start_of("p2") is None


def test_no_slots_when_no_peer_has_short_links():
    assert ping_slots({"a": (False, 1.0), "b": (False, 2.0)}, {"a", "b"}, at_once=1, slot_s=0.5) is None


def test_buddy_copies_are_spaced_to_land_within_an_interval():
    from spantrain_p2p.train.decide import copy_every

    mb = 1e6
    assert copy_every([], 1.0) == 1 and copy_every([(19 * mb, 2.5 * mb)], 0.0) == 1  # nothing known
    assert copy_every([(1 * mb, 100 * mb)], 0.1) == 1  # a copy in a fifth of a step
    # 19 MB over 20 Mbit/s: 7.6 s a copy; twice that over 2 s steps: every 8 steps
    assert copy_every([(19 * mb, 2.5 * mb), (1 * mb, 2.5 * mb)], 2.0) == 8
    assert copy_every([(1e15, 1.0)], 0.1) == 10_000  # bounded
    assert copy_every([(mb, float("nan"))], 1.0) == 1 and copy_every([(mb, 0.0)], 1.0) == 1


def test_buddy_copies_are_spaced_by_their_cost_against_the_failure_rate():
    """Young's interval sqrt(2 C M): a 6 MB stage at 3.5 ns a byte (21 ms a copy) in a swarm of 4
    peers that each fail once an hour (M = 900 s) copies every 6.1 s: every 8 steps of 0.75 s, at
    most 8 (a copy carries 8 loss rows); a swarm that fails often, or cheap copies, copy every step."""
    from spantrain_p2p.train.decide import FAILURE_SPACED_MAX, copy_every, swarm_mtbf_s

    mb = 1e6
    stage = [(6 * mb, 1e10), (3 * mb, 1e10)]  # fast links: landing says every step
    assert copy_every(stage, 0.75) == 1  # the cost unknown
    m = swarm_mtbf_s(4)
    assert m == 900.0
    assert copy_every(stage, 0.75, cost_s_per_byte=3.5e-9, mtbf_s=m) == FAILURE_SPACED_MAX == 8
    assert copy_every(stage, 2.0, cost_s_per_byte=3.5e-9, mtbf_s=m) == 3  # 6.5 s over 2 s steps
    # the largest stage's copy counts (each peer copies its own at once), not the sum
    assert copy_every([(6 * mb, 1e10)] * 4, 2.0, cost_s_per_byte=3.5e-9, mtbf_s=m) == 3
    # 12 failures watched over 4 peers x 1 h: a peer fails every 1,385 s, the swarm every 346 s: 3.8 s
    busy = swarm_mtbf_s(4, failures=12, watched_peer_s=4 * 3600)
    assert round(busy) == 346 and copy_every(stage, 2.0, cost_s_per_byte=3.5e-9, mtbf_s=busy) == 1
    assert copy_every(stage, 0.75, cost_s_per_byte=0.2e-9, mtbf_s=m) == 1  # plain copies: 1 ms
    # landing still rules where it asks for more; the failure term never exceeds the map's bound
    assert copy_every([(19 * mb, 2.5 * mb)], 2.0, cost_s_per_byte=3.5e-9, mtbf_s=m) == 8
    assert copy_every([(1e15, 1.0)], 0.1, cost_s_per_byte=3.5e-9, mtbf_s=m) == 10_000
    assert copy_every(stage, 0.75, limit=2, cost_s_per_byte=3.5e-9, mtbf_s=m) == 2
    # nonsense figures say nothing
    assert copy_every(stage, 0.75, cost_s_per_byte=float("nan"), mtbf_s=m) == 1
    assert copy_every(stage, 0.75, cost_s_per_byte=3.5e-9, mtbf_s=float("inf")) == 8
    assert copy_every(stage, float("inf"), cost_s_per_byte=3.5e-9, mtbf_s=m) == 1


@pytest.mark.serial  # compares two CPU costs 0.2-0.5 ns a byte apart: a loaded box's noise is larger
def test_a_copied_bytes_cost_is_measured_through_the_copy_path():
    from spantrain_p2p.train.recovery import copy_cost_s_per_byte

    enc, plain = copy_cost_s_per_byte(True, 1 << 20), copy_cost_s_per_byte(False, 1 << 20)
    assert 0 < plain < enc < 1e-6  # sealing and opening cost more than the copies alone, and a byte < 1 us


def _crash_resume(every: int, lag: int, crash: int) -> int:
    """Four lone stages (layer k on peer k), each copying its layer to the next peer after the
    multiples of ``every`` (a copy starts only once the one before has landed); a copy lands ``lag``
    steps after it starts. Peer 0 dies after ``crash`` steps: the step the others resume from."""
    from spantrain_p2p.models.state import Store

    own = [Store(keep_steps=3) for _ in range(4)]
    copies = [Store(keep_steps=3) for _ in range(4)]
    in_flight: dict[int, tuple[int, int]] = {}  # sender -> (step copied, step it lands at)
    for step in range(crash + 1):
        for k in range(4):
            if k in in_flight and in_flight[k][1] <= step:
                copies[(k + 1) % 4].put(k, in_flight.pop(k)[0], [])
            own[k].put(k, step, [], pin_every=every)
            if step % every == 0 and k not in in_flight:
                in_flight[k] = (step, step + lag)
    survivors = [{**own[k].inventory(), **copies[k].inventory()} for k in (1, 2, 3)]
    step, err = resume_point(survivors, 4, [(k, k + 1) for k in range(4)])
    assert not err
    return step


def test_copies_spaced_to_land_leave_a_step_every_layer_was_kept_at():
    """Copies after every step that take 4 steps to land: the dead peer's copies (steps 36, 40, 44)
    are older than anything the others kept (47-49), and the run starts again at step 0. Spaced by
    ``copy_every`` (twice the landing time, 8 steps), the swarm resumes at the last copy that landed."""
    assert _crash_resume(every=1, lag=4, crash=49) == 0
    assert _crash_resume(every=8, lag=4, crash=49) == 40
    assert all(_crash_resume(every=8, lag=4, crash=c) >= c - 2 * 8 for c in range(8, 80))


def test_the_search_for_a_better_plan_keeps_to_its_share_of_a_core():
    from spantrain_p2p.train.decide import REPLAN_CHECK_S, REPLAN_CPU_SHARE, replan_check_s

    assert replan_check_s(0.01) == REPLAN_CHECK_S  # a small swarm's search: every check
    assert replan_check_s(0.5) == 0.5 / REPLAN_CPU_SHARE  # lan-20's: 25 s apart, 2 % of a core
    assert replan_check_s(0.5) >= REPLAN_CHECK_S
    assert replan_check_s(30.0) == 60.0  # at most a minute apart


def test_a_changed_measurement_is_searched_at_once_while_the_minutes_searches_keep_to_their_share():
    """A link cut reaches the planner piece by piece: a quiet swarm's planner searches each piece at
    its next check, not at the next of checks spaced by its search's CPU; unchanged measurements are
    not searched again; changing ones keep to the share of a core over the window; a newcomer and a
    held gain at once; a search dearer than the window's share still runs ``every_s`` apart."""
    from spantrain_p2p.train.decide import REPLAN_CHECK_S, REPLAN_CPU_SHARE, REPLAN_WINDOW_S, search_due

    took, every = 0.34, 0.34 / REPLAN_CPU_SHARE  # cee-3region's planner: 17 s apart
    assert search_due(False, False, True, 5.0, every, window_cpu_s=took, expected_cpu_s=took)  # the cut's first piece
    assert search_due(False, False, True, 5.0, every, window_cpu_s=2 * took, expected_cpu_s=took)  # its next
    assert not search_due(False, False, False, 600.0, every, window_cpu_s=0.0, expected_cpu_s=took)  # nothing new
    assert search_due(True, False, False, 1.0, every, window_cpu_s=9.0, expected_cpu_s=took)  # a newcomer
    assert search_due(False, True, False, 10.0, every, window_cpu_s=9.0, expected_cpu_s=took)  # a held gain
    # links that change at every check: the searches of a window keep to the share
    t, spent = 0.0, []
    while t < 600.0:
        window = sum(c for s, c in spent if t - s <= REPLAN_WINDOW_S)
        if search_due(False, False, True, t - (spent[-1][0] if spent else -1e9), every, window, took):
            spent.append((t, took))
        t += REPLAN_CHECK_S
    assert len(spent) * took / 600.0 <= REPLAN_CPU_SHARE * 1.1, len(spent)
    # a search of 5 s of CPU (a large swarm's): never within the window's share, every_s apart still
    assert not search_due(False, False, True, 30.0, 60.0, window_cpu_s=5.0, expected_cpu_s=5.0)
    assert search_due(False, False, True, 60.0, 60.0, window_cpu_s=5.0, expected_cpu_s=5.0)


def test_a_planner_reads_the_versions_its_members_records_say_and_none_where_one_says_none():
    import types

    from spantrain_p2p.swarm import measure
    from spantrain_p2p.train.held_measurements import measure_versions

    def rec(p, prof, links):
        return types.SimpleNamespace(peer_id=p, progress={measure.version_field(measure.PROFILES): prof,
                                                          measure.version_field(measure.LINKS): links})

    a = measure_versions([rec("b", 1, 2), rec("a", 1, 1)])
    assert a == measure_versions([rec("a", 1, 1), rec("b", 1, 2)])  # the order of the view does not count
    assert a != measure_versions([rec("a", 1, 1), rec("b", 1, 3)])  # b published new links
    assert measure_versions([rec("a", 1, 1), rec("b", None, 2)]) is None  # a peer before versions
    assert measure_versions([rec("a", 1, True)]) is None  # a bool is no version
    # as held: the record says links 3, the read brought 2 (its key lags): not what the record says
    held = measure_versions([rec("a", 1, 1), rec("b", 1, 3)], {"a": {"mv": 1}, "b": {"mv": 1}},
                             {"a": ({}, 1), "b": ({}, 2)})
    assert held == a and held != measure_versions([rec("a", 1, 1), rec("b", 1, 3)])
    assert measure_versions([rec("a", 1, 1)], {}, {}) == (("a", (-1, -1)),)  # nothing held yet
