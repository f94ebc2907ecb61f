"""Who takes part in a round's merge: the keeper, the islands it waits for and takes, and the
answers a left-out island reads (pure logic; the live leave-out is in test_islands_swarm)."""
from __future__ import annotations

import pytest

from spantrain_p2p.net.framing import FrameError
from spantrain_p2p.islands.members import LEAVE_MIN_S, awaited_islands, complete_islands, keeper_island, leave_after_s, parse_members


def test_the_keeper_is_the_island_with_the_most_steps_a_round_the_first_of_equals():
    assert keeper_island([21, 100, 21, 5]) == 1
    assert keeper_island([7, 7]) == 0
    assert keeper_island([3]) == 0


def test_an_island_is_complete_once_every_layer_of_its_round_is_here():
    got = {(4, 0, 0), (4, 0, 1), (4, 1, 0), (4, 2, 0), (4, 2, 1), (3, 1, 1), (5, 1, 1)}
    assert complete_islands(got, 4, 3, [0, 1]) == [0, 2]  # island 1 lacks layer 1 of round 4
    assert complete_islands(got, 4, 3, [0]) == [0, 1, 2]
    assert complete_islands(set(), 4, 3, [0]) == []


def test_the_keeper_waits_for_the_last_rounds_members_and_the_returning_not_for_the_left_out():
    decisions = {6: [0, 2]}  # island 1 was left out of round 6
    assert awaited_islands(7, 3, decisions, {}) == {0, 2}
    assert awaited_islands(7, 3, decisions, {1: 7}) == {0, 1, 2}  # it said it contributes to round 7
    assert awaited_islands(7, 3, decisions, {1: 8}) == {0, 2}
    assert awaited_islands(0, 3, {}, {}) == {0, 1, 2}  # the first round decided: everyone


def test_the_keeper_leaves_an_island_out_a_round_late_never_sooner_than_the_floor():
    assert leave_after_s(0.5) == LEAVE_MIN_S
    assert leave_after_s(40.0) == 40.0


def test_a_members_answer_is_checked_before_it_is_used():
    assert parse_members({"members": [0, 2]}, 3, 0) == ([0, 2], None)
    assert parse_members({"members": [0, 2], "latest": [9, 120]}, 3, 1) == ([0, 2], (9, 120))
    bad = [None, {}, {"members": []}, {"members": [0, 3]}, {"members": [2, 0]}, {"members": [0, 0]},
           {"members": [True]}, {"members": "0,1"}, {"members": [0, 1, 2, 2]}]
    for header in bad:
        with pytest.raises(FrameError):
            parse_members(header, 3, 0)
    for latest in (None, [9], [9, -1], ["9", 120], [9, 1 << 60], [9.0, 1]):  # left out: where the others are
        with pytest.raises(FrameError):
            parse_members({"members": [0, 2], "latest": latest}, 3, 1)
