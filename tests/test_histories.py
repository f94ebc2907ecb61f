"""/status's histories kept as the steps come (``train.histories``): the same rows as sorting and
thinning the whole run, at a cost that does not grow with the run."""
import random
import time

from spantrain_p2p.train.histories import HISTORY_POINTS, StepRows, Throughput


def thin(rows, most=HISTORY_POINTS):  # what /status did: the whole run sorted, then thinned
    if len(rows) <= most:
        return rows
    k = -(-len(rows) // most)
    return rows[::-1][::k][::-1]


def regrouped(step_times, tokens, most=HISTORY_POINTS):  # ... and every step's time regrouped
    k = 1
    while max(st for st, *_ in step_times) // k >= most:
        k *= 2
    groups = {}
    for st, s, e in step_times:
        g = groups.setdefault(st // k * k, [s, e, 0])
        g[0], g[1], g[2] = min(g[0], s), max(g[1], e), g[2] + 1
    return [[first, round(e, 3), round(tokens * n / max(e - s, 1e-6), 3)] for first, (s, e, n) in sorted(groups.items())]


def a_run(n, seed=0):
    """Steps 0..n-1 with two re-plans that go back and redo steps, and a joiner's late start."""
    rng = random.Random(seed)
    order = list(range(5, n // 2)) + list(range(n // 2 - 4, n)) + list(range(n - 3, n)) + [0, 1, 2]
    t = 1000.0
    for s in order:
        d = 0.05 + rng.random() * 0.1
        yield s, (rng.random(), 8, s // 100), t, t + d
        t += d + 0.001


def test_loss_rows_come_in_step_order_and_read_as_the_sorted_whole_run_did():
    for n in (7, 199, 200, 201, 1000, 4321):
        rows, plain = StepRows(), {}
        for s, row, *_ in a_run(n, seed=n):
            rows[s] = row
            plain[s] = row
        whole = sorted(plain.items())
        assert list(rows) == [s for s, _ in whole] and len(rows) == len(plain) and dict(rows.items()) == plain
        assert rows.last(30) == whole[-30:] and rows.last(0) == []
        assert rows.thinned() == thin(whole) and rows.thinned(7) == thin(whole, 7)
        assert len(rows.thinned()) <= HISTORY_POINTS and rows.thinned()[-1] == whole[-1]
    del rows[6]
    assert 6 not in rows and list(rows) == sorted(plain.keys() - {6}) and rows.get(3) is None
    rows[6] = (1.0, 8, 0)  # back, in its place (steps 3 and 4 never came)
    assert list(rows)[:5] == [0, 1, 2, 5, 6] and rows.get(6) == (1.0, 8, 0)


def test_throughput_groups_equal_a_regrouping_of_every_step_at_any_length():
    for n in (1, 150, 199, 200, 401, 5000):
        tp, times = Throughput(), []
        for s, _row, t0, t1 in a_run(n, seed=n):
            tp.add(s, t0, t1)
            times.append((s, t0, t1))
            if len(times) in (1, 50, 199, 200, 201) or len(times) == n:
                assert tp.rows(4096) == regrouped(times, 4096)
        assert len(tp.rows(4096)) <= HISTORY_POINTS


def test_a_page_at_step_100000_costs_what_one_at_step_1000_does():
    def page_s(n):
        rows, tp = StepRows(), Throughput()
        t = 0.0
        for s in range(n):
            rows[s] = (1.0, 8, 1)
            tp.add(s, t, t + 0.1)
            t += 0.1
        t0 = time.process_time()
        for _ in range(50):
            rows.last(30), rows.thinned(), tp.rows(4096)
        return (time.process_time() - t0) / 50

    small, large = page_s(1000), page_s(100_000)
    assert large < 10 * small + 0.002  # (flat: the whole run sorted took 75x as long at 100x the steps)
