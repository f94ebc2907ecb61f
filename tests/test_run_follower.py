"""What `spantrain swarm` makes of the peers' reports: the loss curve (the newest epoch of a step counts,
and any one complete report of a step will do) and the plans it shows."""
from spantrain_p2p.launch import RunFollower, summarize


def follower(rows_by_peer):
    f = RunFollower([], None, print, [])
    for (epoch, name), rows in rows_by_peer.items():
        f.losses[(epoch, name)] = {step: (total, count) for step, total, count in rows}
    return f


def test_a_redone_step_replaces_the_abandoned_one():
    f = follower({(1, "a"): [(0, 8.0, 4), (1, 7.0, 4)], (2, "b"): [(1, 6.0, 4)]})
    assert f.loss_curve() == [2.0, 1.5]


def test_replicas_reporting_the_whole_step_are_not_counted_twice_and_one_report_is_enough():
    # a and b replicate the last stage; b died before its step-1 report was read
    f = follower({(1, "a"): [(0, 8.0, 4), (1, 6.0, 4)], (1, "b"): [(0, 8.0, 4)]})
    assert f.loss_curve() == [2.0, 1.5]


def test_a_partial_report_never_beats_the_whole_one():
    f = follower({(1, "a"): [(0, 3.0, 2)], (1, "buddy-of-b"): [(0, 8.0, 4)]})
    assert f.loss_curve() == [2.0]


def test_summary_takes_one_whole_report_per_step():
    def report(name, loss_sums):
        return {"name": name, "stage": 0, "layers": [0, 6], "plan": None, "loss_sums": loss_sums,
                "steps_done": 2, "step_times": [[0, 0.0, 1.0], [1, 1.0, 2.0]], "step_s_median": 1.0,
                "compute_s_median": 0.5, "error": None}
    out = summarize([report("a", [[0, 8.0, 4, 1], [1, 6.0, 4, 1]]), report("b", [[0, 8.0, 4, 1]])], 4, 16)
    assert out["losses"] == [2.0, 1.5]


def test_a_plan_is_described_with_its_stages_peers_and_prediction():
    from spantrain_p2p.launch import describe_plan
    text = describe_plan({"epoch": 2, "term": 1, "schedule": "zb-h1", "predicted_step_s": 0.1234,
                          "bottleneck": "compute:stage 0",
                          "stages": [{"peers": ["a", "b"], "layers": [0, 4], "microbatch_share": {"a": 0.75, "b": 0.25}},
                                     {"peers": ["c"], "layers": [4, 8], "microbatch_share": {"c": 1.0}}]})
    assert text.splitlines() == [
        "plan epoch 2 (planner term 1), schedule zb-h1, predicted 0.123s per step (bottleneck compute:stage 0):",
        "  stage 0: layers 0-3 on a 75%, b 25%",
        "  stage 1: layers 4-7 on c"]


def test_each_epoch_gets_its_measured_and_predicted_samples_per_second():
    from spantrain_p2p.launch import epoch_figures
    reports = [{"step_times": [[0, 0.0, 1.0, 1], [1, 1.0, 2.0, 1], [2, 2.0, 3.0, 1],
                               [2, 5.0, 6.0, 2], [3, 6.0, 6.5, 2], [4, 6.5, 7.0, 2]]},
               {"step_times": [[1, 1.0, 2.2, 1], [2, 2.0, 3.2, 1]]}]
    plans = {1: {"predicted_step_s": 1.0}, 2: {"predicted_step_s": 0.4}}
    first, second = epoch_figures(reports, plans, 8)
    # epoch 1: steps end at 1.0, 2.2, 3.2 (the later peer counts): gaps 1.2 and 1.0, median 1.1 s
    assert first == {"epoch": 1, "steps": 3, "first_step": 0, "samples_per_s": round(8 / 1.1, 3),
                     "predicted_samples_per_s": 8.0, "ratio": round(8 / 1.1 / 8, 3)}
    assert second["steps"] == 3 and second["first_step"] == 2 and second["samples_per_s"] == 16.0
    assert second["predicted_samples_per_s"] == 20.0 and second["ratio"] == 0.8


def test_a_chaos_event_not_yet_due_does_not_hold_back_one_that_is():
    from types import SimpleNamespace

    from spantrain_p2p.launch.chaos import Chaos
    launched, said = [], []
    f = RunFollower([], None, said.append, [Chaos("degrade", "a-b", at_t=1e6, factor=0.1),
                                            Chaos("join", "p9", at_step=5)], launch_peer=launched.append)
    sts = [(SimpleNamespace(name="p0"), {"train": {"stage": 0, "steps_done": 5}})]
    f.fire_chaos(sts)
    assert launched == ["p9"] and [c.action for _, c in f.chaos] == ["degrade"]
    assert [e["kind"] for e in f.events] == ["join"]


def _training(epoch, step, state="training"):
    return {"state": state, "train": {"plan": {"epoch": epoch}, "step": step, "stage": 0}}


def test_a_kill_is_recovered_by_a_newer_epoch_past_the_step_or_at_once_outside_the_map():
    """A killed stage peer needs a newer epoch that trains past the step reached; a killed peer the
    map in force does not hold (a relay, a spare) needs no re-plan: that map training past the step
    is its recovery (CI once ended a run with such a kill never marked recovered)."""
    f = RunFollower([], None, lambda *a: None, [])
    f.t0 = 0.0
    f.plans = {2: {"stages": [{"peers": ["b", "c"]}]}}
    inside = {"kind": "kill", "target": "b", "step": 40, "t_s": 0.0, "epoch_before": 2}
    outside = {"kind": "kill", "target": "a", "step": 40, "t_s": 0.0, "epoch_before": 2}
    f.pending_recovery = [inside, outside]
    f.check_recovery([(None, _training(2, 40)), (None, _training(2, 41))])
    assert "recovery_s" not in outside and "recovery_s" not in inside  # not past step 40 yet
    f.check_recovery([(None, _training(2, 41)), (None, _training(2, 42))])
    assert outside["recovery_s"] is not None and "recovery_s" not in inside
    f.check_recovery([(None, _training(3, 41)), (None, _training(3, 41, "done"))])
    assert inside["recovery_s"] is not None and f.pending_recovery == []


def test_a_quiet_run_is_polled_again_when_its_last_step_is_due_and_at_most_a_second_later(monkeypatch):
    from types import SimpleNamespace

    from spantrain_p2p.launch import follow

    now = [100.0]
    monkeypatch.setattr(follow.time, "monotonic", lambda: now[0])
    f = RunFollower([], SimpleNamespace(steps=60), print, [])
    assert f._until_next_poll(10) == 1.0  # nothing to go by yet
    now[0] += 1.0
    assert f._until_next_poll(30) == 1.0  # 20 steps a second: the last in 1.5 s
    now[0] += 1.0
    assert abs(f._until_next_poll(50) - 0.5) < 1e-9  # 10 left: due in half a second
    now[0] += 0.5
    assert f._until_next_poll(59) == 0.1  # due at once: not sooner than 0.1 s
    now[0] += 0.1
    assert f._until_next_poll(59) == 1.0  # no progress (a slow step): the usual second
    assert RunFollower([], None, print, [])._until_next_poll(5) == 1.0
