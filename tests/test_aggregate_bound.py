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
