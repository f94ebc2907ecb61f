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
