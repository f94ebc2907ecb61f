"""The passive estimate of a link from the transfers a peer makes anyway (``net.passive``): what it reads
from back-to-back, stalled, latency-bound, sparse, queued and interleaved transfers, which changes are
published (``link_update``) and how a flapping figure is held back (``FlapDamper``). Every test runs
on a fake clock (``now=``); the ones on real traffic are in ``test_prober.py``."""
import pytest

from spantrain_p2p.net.passive import FlapDamper, PassiveEstimator, link_update


def detection_time(est_at, drop_t, pre, factor=0.2):
    """Seconds after ``drop_t`` until the estimate first falls to ``factor`` × ``pre``."""
    for t, e in est_at:
        if t >= drop_t and e <= factor * pre:
            return t - drop_t
    return None


def test_the_passive_estimate_sees_a_10x_drop_within_5_seconds_fake_clock():
    est = PassiveEstimator(tau_s=1.0)
    seen, t = [], 0.0
    while t < 20.0:  # back-to-back 1 MB transfers; 100 MB/s until t=10, then 10 MB/s
        rate = 100e6 if t < 10.0 else 10e6
        dur = 1e6 / rate
        t += dur
        est.observe("b", 1_000_000, dur, now=t)
        seen.append((t, est.estimate("b", now=t)))
    pre = [e for t, e in seen if t <= 10.0][-1]
    assert pre == pytest.approx(100e6, rel=0.01)
    d = detection_time(seen, 10.0, pre)
    assert d is not None and d < 5.0, d
    print(f"FIGURE passive estimate (fake clock): a 10x drop shows as a 5x lower estimate {d:.2f} s after it")
    assert seen[-1][1] == pytest.approx(10e6, rel=0.05)
    assert est.estimate("b", now=100.0) is None and est.estimate("zzz") is None  # old data expires


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_passive_estimate_is_not_fooled_by_a_fifth_of_transfers_stalling(seed):
    """A busy receiver makes some transfers slow: with every fifth one (at random) 10x slower,
    the estimate stays the link's 100 MB/s, and a real 10x drop still shows within 3 s."""
    import random

    rnd = random.Random(seed)
    est = PassiveEstimator()
    seen, t = [], 0.0
    while t < 20.0:
        rate = 100e6 if t < 10.0 else 10e6
        dur = 1e6 / rate * (10 if rnd.random() < 0.2 else 1)
        t += dur
        est.observe("b", 1_000_000, dur, now=t)
        seen.append((t, est.estimate("b", now=t)))
        t += 0.02  # idle moments between sends: each transfer its own busy period
    steady = [e for t_, e in seen if 3.0 < t_ <= 10.0]
    assert min(steady) == pytest.approx(100e6, rel=0.1)
    d = detection_time(seen, 10.0, 100e6)
    assert d is not None and d < 3.0, d


def test_latency_bound_transfers_give_a_lower_bound_that_shows_a_recovered_link():
    est = PassiveEstimator(tau_s=1.0)
    # degraded: 32 KiB takes 26 ms of bytes after 20 ms of latency: counted
    est.observe("b", 32 << 10, 0.046, latency_s=0.02, now=1.0)
    assert est.estimate("b", now=1.0) == pytest.approx((32 << 10) / 0.026)
    assert est.lower_bound("b", now=1.0) is None
    # restored: 2.6 ms of bytes in 22.6 ms: mostly latency, so not counted, but the link carries
    # at least 32 KiB / (0.2 x 22.6 ms)
    est.observe("b", 32 << 10, 0.0226, latency_s=0.02, now=2.0)
    assert est.estimate("b", now=2.0) == pytest.approx((32 << 10) / 0.026)  # the old sample is all it has
    assert est.lower_bound("b", now=2.0) == pytest.approx((32 << 10) / (0.2 * 0.0226))
    assert est.lower_bound("b", now=6.0) is None  # stale evidence says nothing


@pytest.mark.parametrize("published,probed,estimate,bound,want", [
    (100, 100, None, None, None),     # no informative traffic: as probed
    (100, 100, 60, None, None),       # noise, or small transfers: not a change
    (100, 100, 10, None, 10),         # a 10x cut
    (100, 100, 10, 120, None),        # ...contradicted by a fresh latency-bound transfer
    (10, 100, 12, None, None),        # still cut
    (10, 100, 10, 52, 100),           # recovered: a latency-bound transfer shows >= 52 Mbit/s
    (10, 100, 30, None, 30),          # partly recovered
    (100, 100, 400, None, None),      # faster than probed: left alone
])
def test_only_sizeable_link_changes_are_published(published, probed, estimate, bound, want):
    assert link_update(published, probed, estimate, bound) == want


def test_a_link_whose_figure_goes_down_and_up_is_held_back_longer_each_time():
    d = FlapDamper(5.0, max_hold_s=40.0)
    # the loopback run's sequence (11:30 UTC): 3043 -> 1171 -> 562 -> 1321 -> 414 -> 1408 ... Mbit/s
    assert d.allow("p3", 3043, 1171, now=0.0)
    assert d.allow("p3", 1171, 562, now=3.0)  # further down: at once
    assert not d.allow("p3", 562, 1321, now=6.0)  # back up 3 s after the last change: held
    assert d.allow("p3", 562, 1321, now=8.0)  # 5 s after it: let through, the hold doubles
    assert d.hold_s("p3") == 10.0
    assert not d.allow("p3", 1321, 414, now=17.0)  # down again within 10 s: held
    assert d.allow("p3", 1321, 414, now=18.0)
    assert d.hold_s("p3") == 20.0
    assert d.allow("p3", 414, 200, now=19.0)  # the same way: at once, the hold kept
    assert not d.allow("p3", 200, 900, now=38.0)
    assert d.allow("p3", 200, 900, now=39.0) and d.hold_s("p3") == 40.0
    assert d.allow("p3", 900, 300, now=80.0) and d.hold_s("p3") == 40.0  # capped
    assert d.allow("p3", 300, 3043, now=80.0 + 4 * 40.0)  # left alone for four holds: back at the base
    assert d.hold_s("p3") == 5.0
    assert d.allow("p1", 100, 10, now=0.0) and not d.allow("p1", 10, 10, now=100.0)  # (per link; no change)


def test_a_busy_receiver_now_and_then_does_not_look_like_a_slower_link():
    est = PassiveEstimator(tau_s=1.0)
    t = 0.0
    for i in range(200):  # 32 KiB at 1 Gbit/s (0.26 ms), but one transfer in five waits 20 ms on a busy loop
        dur = 0.02 if i % 5 == 0 else 0.00026
        t += 0.01
        est.observe("b", 32 << 10, dur, now=t)
    assert est.estimate("b", now=t) * 8 / 1e6 == pytest.approx(1000, rel=0.05)


def sparse_link_readings(min_samples: int, drop_at: float = float("inf")) -> list[tuple[float, float]]:
    """(time, Mbit/s) of the estimate of a link that replicas use once a step: one 200 KB gradient
    part every 0.5 s over 1 Gbit/s (1.6 ms of bytes), and in every six, three in a row 3-7 ms late
    (a sender's event loop on a busy host's cores: cee-3region's replicas read 2.7-8.5 ms for
    theirs); the link cut to a tenth at ``drop_at``."""
    est = PassiveEstimator(min_samples=min_samples)
    n, out, t = 200_212, [], 0.0
    for i in range(240):
        t += 0.5
        rate = 125e6 if t < drop_at else 12.5e6
        late = (0.003, 0.007, 0.004)[i % 6 - 3] if i % 6 >= 3 else 0.0
        est.observe("b", n, n / rate + late, now=t)
        out.append((t, est.estimate_mbps("b", now=t)))
    return out


def test_a_sparse_link_is_not_read_from_its_last_late_transfers_and_a_drop_still_shows():
    # weighed by age alone (tau_s), the last few decide, and three late ones read under half
    assert min(e for _, e in sparse_link_readings(min_samples=1)) < 500
    steady = min(e for _, e in sparse_link_readings(min_samples=6))
    assert steady > 900
    seen = sparse_link_readings(min_samples=6, drop_at=60.0)
    d = detection_time(seen, 60.0, 1000.0, factor=0.5)
    assert d is not None and d < 5.0, d
    assert seen[-1][1] == pytest.approx(100, rel=0.1)
    print(f"FIGURE passive estimate of a sparse link (fake clock): lowest {steady:.0f} Mbit/s of 1000 with "
          f"late transfers; a 10x drop under half {d:.1f} s after it")


def test_a_peers_estimate_does_not_time_a_message_too_small_to_say_anything_of_its_link():
    """A replica's 264-byte loss, the first message on its link in an epoch, took 0.16 ms (the send's
    fixed cost): timed, it read a 1 Gbit/s link at 13 Mbit/s, and was published as a drop."""
    from spantrain_p2p.train.measuring import Measuring

    est = Measuring(None, lambda *a: None).passive
    est.observe("b", 264, 0.00016, now=1.0)
    assert est.estimate("b", now=1.0) is None
    for t in (1.5, 2.0, 2.5):  # trace-drop's activations, at 1 Gbit/s (three: ``PASSIVE_MIN_COUNT``)
        est.observe("b", 32 << 10, (32 << 10) / 125e6, now=t)
    assert est.estimate_mbps("b", now=2.5) == pytest.approx(1000, rel=0.01)


def test_a_peers_estimate_does_not_read_a_link_from_its_first_transfer_alone():
    """A replica link's first gradient part of an epoch took 4.97 ms for 200 KB on 1 Gbit/s (1.6 ms of
    bytes): the only transfer on that link, it read 322 Mbit/s, was published as a drop a second into
    training, and put back 7 s later (cee-3region, 2026-12-02); the next ones took 0.4-1.8 ms."""
    from spantrain_p2p.train.measuring import Measuring

    est = Measuring(None, lambda *a: None).passive
    for t, ms in ((1.0, 4.97), (1.55, 1.40), (2.09, 1.28)):  # the logged run's first three, 0.5 s apart
        est.observe("b", 200212, ms / 1e3, now=t)
        if t < 2.0:
            assert est.estimate("b", now=t) is None  # one or two transfers: no estimate yet
    assert est.estimate_mbps("b", now=2.09) > 500  # three: the link, not its first send
    old = PassiveEstimator(min_bytes=16 << 10)  # as a peer's was: the first transfer alone
    old.observe("b", 200212, 4.97e-3, now=1.0)
    assert old.estimate_mbps("b", now=1.0) < 500


def test_a_burst_of_sends_queued_on_one_link_is_not_taken_for_a_slow_link():
    est = PassiveEstimator(tau_s=1.0)
    # 8 activations of 32 KiB sent at once over 100 Mbit/s with 20 ms one-way latency: the i-th
    # completes at 20 ms + i x 2.6 ms; timed from its own start it would look 8x slower
    per = (32 << 10) / 12.5e6
    for i in range(1, 9):
        est.observe("b", 32 << 10, 0.02 + i * per, latency_s=0.02, now=1.0 + 0.02 + i * per)
    assert est.estimate("b", now=1.1) * 8 / 1e6 == pytest.approx(100, rel=0.05)


def test_interleaved_sends_that_finish_together_are_not_taken_for_a_fast_link():
    est = PassiveEstimator(tau_s=1.0)
    # what the live trace-drop run showed after a cut to 10 Mbit/s (40 ms RTT): four 256 KiB
    # activations started within 0.26 s of each other share the link, so the last two complete
    # 20 ms apart; timed from the previous completion the fourth looked like 100 Mbit/s
    n, rate, lat = 262400, 10e6 / 8, 0.04
    t = 0.0
    for burst in range(6):
        t0 = t
        starts = [t0, t0 + 0.08, t0 + 0.23, t0 + 0.26]
        ends = [t0 + lat + 0.42, t0 + lat + 0.63, t0 + lat + 0.82, t0 + lat + 4 * n / rate]
        for s, e in zip(starts, ends):
            est.observe("b", n, e - s, latency_s=lat, now=e)
        t = ends[-1] + 1.0  # the stage computes before its next burst
    assert est.estimate("b", now=t) * 8 / 1e6 == pytest.approx(10, rel=0.1)


def test_a_drop_in_the_middle_of_a_long_stream_shows():
    est = PassiveEstimator(tau_s=1.0)
    # two sends always in flight (each starts before the previous completes), 1 MB each:
    # 100 MB/s until t=10, then 10 MB/s; never an idle moment on the link
    t, seen = 0.0, []
    while t < 20.0:
        rate = 100e6 if t < 10.0 else 10e6
        t += 1e6 / rate
        est.observe("b", 1_000_000, 2 * 1e6 / rate, now=t)
        seen.append((t, est.estimate("b", now=t)))
    pre = [e for t_, e in seen if t_ <= 10.0][-1]
    assert pre == pytest.approx(100e6, rel=0.05)
    d = detection_time(seen, 10.0, pre)
    assert d is not None and d < 6.0, d
    assert seen[-1][1] == pytest.approx(10e6, rel=0.1)
