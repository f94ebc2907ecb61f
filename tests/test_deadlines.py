"""Receive deadlines follow the recent waits: a multiple of their 95th percentile, within bounds."""
import pytest

from spantrain_p2p.pipeline.deadlines import Deadlines


def test_until_enough_waits_are_known_the_cap_is_the_deadline():
    d = Deadlines(min_samples=8)
    for _ in range(7):
        d.observe("act", 0.1)
    assert d.typical("act") is None and d.deadline("act", 60.0) == 60.0


def test_the_deadline_is_a_multiple_of_the_95th_percentile_of_recent_waits():
    d = Deadlines(multiple=4.0, floor_s=0.1)
    for i in range(100):
        d.observe("act", 0.5 if i % 10 == 0 else 0.1)  # one wait in ten is slow: over the 95th percentile
    assert d.typical("act") == 0.5 and d.deadline("act", 60.0) == pytest.approx(2.0)
    assert d.deadline("grad", 60.0) == 60.0  # kinds are kept apart


def test_the_deadline_stays_within_its_floor_and_the_cap():
    d = Deadlines(multiple=4.0, floor_s=2.0)
    for _ in range(10):
        d.observe("act", 0.01)
    assert d.deadline("act", 60.0) == 2.0
    for _ in range(64):
        d.observe("act", 30.0)
    assert d.deadline("act", 60.0) == 60.0


def test_old_waits_leave_the_window_so_the_deadline_follows_the_weather():
    d = Deadlines(multiple=4.0, floor_s=0.1, window=16)
    for _ in range(16):
        d.observe("act", 2.0)  # a degraded link
    assert d.deadline("act", 60.0) == 8.0
    for _ in range(16):
        d.observe("act", 0.2)  # restored
    assert d.deadline("act", 60.0) == pytest.approx(0.8)


def test_nonsense_is_refused_or_ignored():
    with pytest.raises(ValueError):
        Deadlines(multiple=0.5)
    d = Deadlines(min_samples=1)
    d.observe("act", float("nan"))
    d.observe("act", -1.0)
    assert d.typical("act") is None
