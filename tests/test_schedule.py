"""Pipeline schedules as data: shape, memory, bubbles, text form, and what validate() catches."""
from __future__ import annotations

import pytest

from spantrain_p2p.pipeline.schedule import (
    SCHEDULE_NAMES,
    Action,
    Op,
    all_stages,
    peak_stashed,
    from_text,
    fuse_adjacent_backward,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    peak_pending_weight_grads,
    schedule,
    simulate,
    to_text,
    validate,
    zb_h1,
)

# m < p, m = p, m > p, and the degenerate single stage / single micro-batch cases.
SIZES = [(1, 1), (1, 3), (2, 1), (4, 2), (4, 4), (4, 8), (3, 7), (8, 16)]


def compute_only(actions: list[Action]) -> str:
    return to_text([a for a in actions if a.op in (Op.F, Op.B, Op.W, Op.BW)])


def activations_held(actions: list[Action]) -> int:
    """Most micro-batches whose forward is done and whose weight-grad is not."""
    return peak_stashed(actions)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p,m", SIZES)
def test_every_schedule_validates_for_fewer_as_many_and_more_microbatches_than_stages(name, p, m):
    validate(all_stages(name, p, m))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p,m", SIZES)
def test_each_stage_does_one_forward_and_one_backward_per_microbatch(name, p, m):
    for s, actions in enumerate(all_stages(name, p, m)):
        by_op = {op: sorted(a.mb for a in actions if a.op is op) for op in Op}
        assert by_op[Op.F] == list(range(m)), f"stage {s}"
        if name == "zb-h1":
            assert by_op[Op.B] == by_op[Op.W] == list(range(m)) and by_op[Op.BW] == []
        else:
            assert by_op[Op.BW] == list(range(m)) and by_op[Op.B] == by_op[Op.W] == []


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_receives_come_right_before_and_sends_right_after_their_compute(name):
    p, m = 4, 6
    for s, actions in enumerate(all_stages(name, p, m)):
        ops = [a.op for a in actions]
        for i, a in enumerate(actions):
            before = actions[i - 1] if i > 0 else None
            after = actions[i + 1] if i + 1 < len(actions) else None
            if a.op is Op.F:
                assert (before == Action(Op.RECV_F, a.mb)) == (s > 0)
                assert (after == Action(Op.SEND_F, a.mb)) == (s < p - 1)
            if a.op in (Op.B, Op.BW):
                assert (before == Action(Op.RECV_B, a.mb)) == (s < p - 1)
                assert (after == Action(Op.SEND_B, a.mb)) == (s > 0)
        if s == 0:
            assert Op.RECV_F not in ops and Op.SEND_B not in ops
        if s == p - 1:
            assert Op.SEND_F not in ops and Op.RECV_B not in ops


def test_single_stage_needs_no_communication():
    for name in SCHEDULE_NAMES:
        assert all(a.op not in (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)
                   for a in schedule(name, 1, 3, 0))


def test_actions_print_and_parse():
    assert str(Action(Op.F, 3)) == "F3"
    assert str(Action(Op.SEND_B, 3)) == "SEND_B3"
    assert Action.parse("F3") == Action(Op.F, 3)
    assert Action.parse("BW12") == Action(Op.BW, 12)
    assert Action.parse("RECV_F0") == Action(Op.RECV_F, 0)
    assert Action("W", 1) == Action(Op.W, 1)


@pytest.mark.parametrize("bad", ["", "F", "X3", "F-1", "f3", "SEND3", "BW 3", "F3x"])
def test_parse_rejects_malformed_actions(bad):
    with pytest.raises(ValueError):
        Action.parse(bad)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_text_form_round_trips(name):
    for actions in all_stages(name, 4, 8):
        text = to_text(actions)
        assert " " in text and "\n" not in text
        assert from_text(text) == actions
    with pytest.raises(ValueError, match="Q7"):
        from_text("F0 Q7 BW0")


def test_1f1b_holds_at_most_p_minus_stage_microbatches_while_gpipe_holds_all():
    p, m = 4, 8
    assert [peak_in_flight(gpipe(p, m, s)) for s in range(p)] == [m] * p
    assert [peak_in_flight(one_f_one_b(p, m, s)) for s in range(p)] == [4, 3, 2, 1]
    assert [activations_held(one_f_one_b(p, m, s)) for s in range(p)] == [4, 3, 2, 1]


@pytest.mark.parametrize("p,m", [(4, 2), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_keeps_1f1b_memory(p, m):
    for s in range(p):
        actions = zb_h1(p, m, s)
        # waiting for their input-grad: as 1F1B, at most p - s
        assert peak_in_flight(actions) == peak_in_flight(one_f_one_b(p, m, s)) <= p - s
        # waiting for their deferred weight-grad: at most s + 1
        assert peak_pending_weight_grads(actions) <= s + 1
        # activations kept until W: never more than 1F1B's peak (p, on its first stage)
        assert activations_held(actions) <= min(p, m)


def test_zb_h1_follows_the_paper_pattern_for_4_stages():
    p, m = 4, 8
    first, last = zb_h1(p, m, 0), zb_h1(p, m, p - 1)
    assert compute_only(first) == (
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7")
    assert compute_only(last) == (
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7")
    # W lags B by `stage` backward slots on every stage
    for s in range(p):
        order = [a for a in zb_h1(p, m, s) if a.op in (Op.B, Op.W)]
        first_w = next(i for i, a in enumerate(order) if a.op is Op.W)
        assert [a.op for a in order[:first_w]] == [Op.B] * (s + 1)


def test_a_b_followed_at_once_by_its_own_w_runs_fused_and_nothing_else_does():
    """What the peers run (``assignment.peer_lists``): on ZB-H1's first stage each W follows its own B
    at once (it lags by nothing, and a first stage sends nothing back), so each pair is one BW; on the
    other stages a send or other micro-batches' work lies between, and they stay split."""
    from spantrain_p2p.pipeline.assignment import peer_actions

    assert to_text(fuse_adjacent_backward(from_text("F0 B0 W0 F1 B1 SEND_B1 W1 B2 W3 W2"))) == \
        "F0 BW0 F1 B1 SEND_B1 W1 B2 W3 W2"
    p, m = 4, 8
    lists = peer_actions([[f"s{k}"] * m for k in range(p)], "zb-h1")
    assert compute_only(lists[(0, "s0")]) == "F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 F6 BW3 F7 BW4 BW5 BW6 BW7"
    for k in range(1, p):
        assert lists[(k, f"s{k}")] == zb_h1(p, m, k)  # the paper's pattern, B and W apart
    # two replicas of a first stage: each one's own B and W are still adjacent
    two = peer_actions([["a", "b"] * (m // 2), ["c"] * m], "zb-h1")
    assert all(a.op not in (Op.B, Op.W) for peer in "ab" for a in two[(0, peer)])
    validate([fuse_adjacent_backward(zb_h1(p, m, s)) for s in range(p)])


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 16)])
def test_unit_times_bubbles_match_the_zero_bubble_paper(p, m):
    runs = {name: simulate(all_stages(name, p, m), 1, 1, 1) for name in SCHEDULE_NAMES}
    work = 3 * m
    assert all(r["stage_busy"] == [work] * p for r in runs.values())
    # 1F1B: (p-1)(t_f + t_b + t_w) idle on every stage; ZB-H1: (p-1)(t_f + t_b - t_w), a third
    assert runs["1f1b"]["stage_bubble"] == [3 * (p - 1)] * p
    assert runs["zb-h1"]["stage_bubble"] == [1 * (p - 1)] * p
    assert runs["1f1b"]["makespan"] == work + 3 * (p - 1)
    assert runs["gpipe"]["makespan"] == runs["1f1b"]["makespan"]
    assert runs["zb-h1"]["makespan"] == work + (p - 1) < runs["1f1b"]["makespan"]
    assert runs["zb-h1"]["bubble_fraction"] == pytest.approx((p - 1) / (work + p - 1))
    assert runs["1f1b"]["bubble_fraction"] == pytest.approx(3 * (p - 1) / (work + 3 * (p - 1)))


def test_zb_h1_bubble_with_unequal_pass_times():
    p, m, t_f, t_b, t_w = 4, 8, 2.0, 2.0, 1.0
    zb = simulate(all_stages("zb-h1", p, m), t_f, t_b, t_w)
    f1b = simulate(all_stages("1f1b", p, m), t_f, t_b, t_w)
    assert zb["stage_bubble"] == [pytest.approx((p - 1) * (t_f + t_b - t_w))] * p
    assert f1b["stage_bubble"] == [pytest.approx((p - 1) * (t_f + t_b + t_w))] * p


def test_simulate_takes_per_stage_times_and_link_latency():
    p, m = 4, 8
    slow_stage = simulate(all_stages("1f1b", p, m), [1, 1, 2, 1], [1, 1, 2, 1], [1, 1, 2, 1])
    assert slow_stage["stage_busy"] == [24, 24, 48, 24]
    assert slow_stage["makespan"] >= 48 + 3  # the slow stage bounds the step
    base = {n: simulate(all_stages(n, p, m), 1, 1, 1)["makespan"] for n in SCHEDULE_NAMES}
    for n in SCHEDULE_NAMES:
        r = simulate(all_stages(n, p, m), 1, 1, 1, t_comm=[0.5, 0.5, 0.5])
        assert r["makespan"] >= base[n] + 2 * (p - 1) * 0.5  # fill and drain cross each link
        assert r["stage_busy"] == [24] * p
    slow_links = {n: simulate(all_stages(n, p, m), 1, 1, 1, t_comm=0.5)["makespan"]
                  for n in SCHEDULE_NAMES}
    assert slow_links["zb-h1"] < slow_links["1f1b"]
    with pytest.raises(ValueError, match="t_f"):
        simulate(all_stages("1f1b", p, m), [1, 1], 1, 1)
    with pytest.raises(ValueError, match="t_comm"):
        simulate(all_stages("1f1b", p, m), 1, 1, 1, t_comm=[0.5] * p)


def test_validate_catches_a_missing_send():
    stages = all_stages("1f1b", 4, 8)
    stages[1] = [a for a in stages[1] if a != Action(Op.SEND_F, 2)]
    with pytest.raises(ValueError, match="stage 1: no SEND_F2"):
        validate(stages)


def test_validate_catches_a_deadlock_from_swapped_order():
    # Each stage is fine on its own, but stage 1 wants micro-batch 1 first, which stage 0
    # only sends after micro-batch 0's gradient comes back.
    stages = [
        from_text("F0 SEND_F0 RECV_B0 BW0 F1 SEND_F1 RECV_B1 BW1"),
        from_text("RECV_F1 F1 BW1 SEND_B1 RECV_F0 F0 BW0 SEND_B0"),
    ]
    with pytest.raises(ValueError, match="deadlock: stage 0 waits at RECV_B0"):
        validate(stages)
    # The same in a real schedule: the last 1F1B stage takes micro-batches 0 and 2 swapped.
    stages = all_stages("1f1b", 4, 8)
    swap = {0: 2, 2: 0}
    stages[3] = [Action(a.op, swap.get(a.mb, a.mb)) for a in stages[3]]
    with pytest.raises(ValueError, match="deadlock"):
        validate(stages)
    with pytest.raises(ValueError, match="deadlock"):
        simulate(stages, 1, 1, 1)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s[0].remove(Action(Op.W, 3)), "stage 0: micro-batch 3 has a split backward without W3"),
    (lambda s: s[2].append(Action(Op.F, 1)), "stage 2: F1 appears twice"),
    (lambda s: s[0].insert(0, Action(Op.RECV_F, 0)), "first stage reads its input from data"),
    (lambda s: s[3].insert(0, Action(Op.RECV_B, 0)), "last stage starts its backward from its loss"),
    (lambda s: s[1].remove(Action(Op.RECV_B, 4)), "stage 1: B4 has no RECV_B4"),
])
def test_validate_names_the_first_problem(edit, message):
    stages = all_stages("zb-h1", 4, 8)
    edit(stages)
    with pytest.raises(ValueError, match=message):
        validate(stages)


def test_validate_rejects_weight_grad_before_input_grad():
    stages = all_stages("zb-h1", 2, 2)
    i = stages[0].index(Action(Op.B, 0))
    j = stages[0].index(Action(Op.W, 0))
    stages[0][i], stages[0][j] = stages[0][j], stages[0][i]
    with pytest.raises(ValueError, match=r"W0 \(action \d+\) comes before B0"):
        validate(stages)


@pytest.mark.parametrize("args", [
    ("pipedream", 4, 8, 0), ("1f1b", 0, 8, 0), ("1f1b", 4, 0, 0), ("1f1b", 4, 8, 4),
    ("zb-h1", 4, 8, -1), ("gpipe", 4.0, 8, 0),
])
def test_schedule_rejects_unknown_names_and_bad_sizes(args):
    with pytest.raises(ValueError):
        schedule(*args)


def test_schedule_dispatches_by_name():
    assert schedule("gpipe", 3, 5, 1) == gpipe(3, 5, 1)
    assert schedule("1f1b", 3, 5, 1) == one_f_one_b(3, 5, 1)
    assert schedule("zb-h1", 3, 5, 1) == zb_h1(3, 5, 1)


def test_backward_done_fractions_run_last_layer_first_by_work():
    from spantrain_p2p.pipeline.schedule import backward_done_fractions

    assert backward_done_fractions([1.0, 2.0, 1.0]) == [1.0, 0.75, 0.25]
    assert backward_done_fractions([0.0, 0.0]) == [1.0, 0.5]  # no work counted: evenly
