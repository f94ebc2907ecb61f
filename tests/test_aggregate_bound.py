"""The aggregate-compute bound: samples/s if every peer's device, used by the plan or not, ran the
model's FLOPs at full speed; and the swarm's MFU over the peers that train."""
from spantrain_p2p.launch.report import _swarm_mfu, aggregate_bound


def _report(peak, work=None):
    return {"device_peak_flops_per_s": peak, "model_flops_per_sample": 2e9, "work": work}


def test_every_peer_s_device_counts_in_the_bound_used_or_not():
    reports = [_report(4e12), _report(2e12), _report(1e12)]  # the third idle
    assert aggregate_bound(reports) == 3500.0  # 7e12 FLOP/s over 2e9 FLOPs a sample
    assert aggregate_bound([_report(4e12), _report(None)]) is None  # a peer that cannot say: no bound
    assert aggregate_bound([]) is None


def test_the_swarm_s_mfu_is_over_the_peers_that_train():
    w = {"achieved_flops_per_s": 1e12, "peak_flops_per_s": 4e12}
    reports = [_report(4e12, w), _report(4e12, {**w, "achieved_flops_per_s": 3e12}), _report(1e12)]
    assert _swarm_mfu(reports) == 0.5  # (1 + 3) / (4 + 4); the idle peer is not in it
    assert _swarm_mfu([_report(1e12)]) is None


def test_a_joiners_planned_milestone_is_the_first_plan_any_planner_weighed_it_in_from_its_own_start():
    from spantrain_p2p.launch.report import _milestones, _weighed

    reports = [{"peer_id": "a", "weighed": {"j": 1010.0, "a": 1000.0}},
               {"peer_id": "b", "weighed": {"j": 1007.5}},  # a planner before it, in another term
               {"peer_id": "j", "started_unix": 1000.0, "milestones": {"idle": 0.4, "map": 7.3}}]
    w = _weighed(reports)
    assert w == {"j": 1007.5, "a": 1000.0}
    assert _milestones(reports[2], w) == {"idle": 0.4, "map": 7.3, "planned": 7.5}
    assert _milestones({"peer_id": "k", "milestones": {"idle": 1.0}}, w) == {"idle": 1.0}  # never weighed
