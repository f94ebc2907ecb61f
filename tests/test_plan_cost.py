"""The cost model: compute, hops, schedule bubbles, all-reduce, memory, and naming the bottleneck."""
from __future__ import annotations

import math

import pytest

from spantrain_p2p.plan.cost import estimate
from spantrain_p2p.pipeline.assignment import microbatch_counts, microbatch_owners
from spantrain_p2p.plan.layout import LinkTable
from spantrain_p2p.plan.types import (LayerProfile, Link, ModelProfile, Network, PeerInfo, Plan, Snapshot,
                                      Stage)

TF = 1e12


def _model(n: int = 4, act: float = 1e6, params: float = 1e6, stash: float = 1e6) -> ModelProfile:
    return ModelProfile(tuple(LayerProfile(1e12, 1e12, 1e12, params, act, stash) for _ in range(n)))


def _snap(n: int, bw: float = 1e12, rtt: float = 0.0, flops=None, memory: float = 1e15) -> Snapshot:
    peers = tuple(PeerInfo(f"p{i}", (flops[i] if flops else 1.0) * TF, memory) for i in range(n))
    links = {(a.id, b.id): Link(rtt, bw) for a in peers for b in peers if a.id != b.id}
    return Snapshot(peers, Network(links))


def _chain(n: int, layers: int, schedule: str, m: int, comp: str = "none", b: int = 1) -> Plan:
    per = layers // n
    stages = tuple(Stage((f"p{i}",), (i * per, (i + 1) * per), (1.0,)) for i in range(n))
    return Plan(stages, schedule, b, m, (comp,) * (n - 1))


def test_one_peer_one_stage_is_its_compute_time():
    e = estimate(_chain(1, 4, "1f1b", 8), _snap(1), _model())
    assert e.step_s == pytest.approx(8 * 4 * 3.0)  # 8 micro-batches x 4 layers x (F + B + W) of 1 s each
    assert e.bottleneck == "compute:stage 0"


@pytest.mark.parametrize("schedule,bubble", [("gpipe", 3.0), ("1f1b", 3.0), ("zb-h1", 1.0)])
def test_uniform_pipeline_bubbles_match_the_schedules(schedule, bubble):
    """p = 4 stages of 1 layer, m = 16, T_F = T_B = T_W = 1 s: busy m(F+B+W) = 48 s, plus
    (p-1)(F+B+W) for GPipe and 1F1B and (p-1)(F+B-W) for ZB-H1."""
    e = estimate(_chain(4, 4, schedule, 16), _snap(4), _model())
    assert e.step_s == pytest.approx(48 + 3 * bubble, rel=0.02)


def test_a_slow_hop_is_the_bottleneck_and_compression_relieves_it():
    slow = _snap(2, bw=1e5)  # 1 MB activation per micro-batch: 10 s a message
    e = estimate(_chain(2, 4, "gpipe", 16), slow, _model())
    assert e.bottleneck == "link:p0->p1"
    e8 = estimate(_chain(2, 4, "gpipe", 16, comp="int8"), slow, _model())
    assert e8.step_s < 0.5 * e.step_s


def test_round_trips_over_high_latency_links_limit_1f1b():
    far = _snap(2, rtt=10.0)  # 5 s one way, compute 6 s per micro-batch per stage
    e = estimate(_chain(2, 4, "1f1b", 32), far, _model())
    assert e.bottleneck.startswith("latency:")
    assert e.step_s > 1.5 * estimate(_chain(2, 4, "1f1b", 32), _snap(2), _model()).step_s


def test_each_stage_ends_its_step_with_its_slowest_peers_optimizer_step():
    """A peer's measured seconds per byte of weights after a step (``profile.step_tail``: the
    optimizer's step) add to its stage's step, the slowest replica's, in the
    estimate and the simulator alike; an offloaded optimizer is priced by its own copies instead."""
    from dataclasses import replace

    from spantrain_p2p.sim.simulator import simulate

    model = _model(params=1e6)  # 4 layers of 1 MB of weights
    base = estimate(_chain(1, 4, "1f1b", 8), _snap(1), model).step_s
    snap = _snap(2)
    snap = replace(snap, peers=(replace(snap.peers[0], step_s_per_param_byte=1e-6),
                                replace(snap.peers[1], step_s_per_param_byte=3e-6)))
    e = estimate(_chain(1, 4, "1f1b", 8), snap, model)
    assert e.step_s == pytest.approx(base + 4e6 * 1e-6)  # p0's own stage: 4 s more
    two = Plan((Stage(("p0", "p1"), (0, 4), (0.5, 0.5)),), "1f1b", 1, 8)
    plain = estimate(two, _snap(2), model).step_s
    assert estimate(two, snap, model).step_s == pytest.approx(plain + 4e6 * 3e-6)  # p1, the slower
    assert simulate(two, snap, model, jitter=False).step_s == pytest.approx(
        simulate(two, _snap(2), model, jitter=False).step_s + 4e6 * 3e-6)
    offloaded = replace(model, host_step_s_per_param_byte=0.5e-6)
    assert estimate(two, snap, offloaded).step_s == pytest.approx(plain + 4e6 * 0.5e-6)


def test_replicas_pay_a_ring_all_reduce_over_their_link():
    snap = _snap(2, bw=1e6, rtt=0.01)
    plan = Plan((Stage(("p0", "p1"), (0, 4), (0.5, 0.5)),), "1f1b", 1, 8)
    e = estimate(plan, snap, _model(params=1e8))
    # 2(n-1) steps of params/n over the link: 100 s per layer's 1e8 bytes, 4 layers, 2 x 5 ms delay;
    # the last layer's part leaves once the last fused backward (4 layers x 2 s) has done it: 2 s
    # into that 8 s op, and the other three queue behind it
    ring = 2 * (2 - 1) * (0.005 + 4e8 / 2 / 1e6)
    assert e.step_s == pytest.approx(4 * 4 * 3.0 - 8.0 + 2.0 + ring, rel=1e-6)
    assert e.bottleneck == "allreduce:stage 0"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_fast_ring_hides_behind_the_last_backward_but_for_the_first_layer(schedule):
    """Layer by layer, a ring that moves a layer's gradients in less time than the backward of
    the layer below adds only the first layer's part (and the delays) to the step."""
    snap = _snap(2, bw=1e9, rtt=0.01)  # 0.1 s a layer's 1e8 bytes, backward 1 or 2 s a layer
    plan = Plan((Stage(("p0", "p1"), (0, 4), (0.5, 0.5)),), schedule, 1, 8)
    e = estimate(plan, snap, _model(params=1e8))
    assert e.step_s == pytest.approx(4 * 4 * 3.0 + 0.1 + 0.01, rel=1e-6)
    assert e.parts["allreduce_tail_s"] == pytest.approx(0.11, rel=1e-6)


def test_micro_batches_are_shared_in_proportion_to_speed():
    assert microbatch_counts([3.0, 1.0], 16) == [12, 4]
    assert sum(microbatch_counts([0.5, 0.3, 0.2], 7)) == 7
    owners = microbatch_owners([0.75, 0.25], 8)
    assert owners.count(0) == 6 and owners.count(1) == 2
    assert owners[:4].count(1) == 1  # spread over the step, not bunched at the end
    snap = _snap(2, flops=[3.0, 1.0])
    plan = Plan((Stage(("p0", "p1"), (0, 4), (0.75, 0.25)),), "1f1b", 1, 16)
    assert estimate(plan, snap, _model(params=0.0)).step_s == pytest.approx(12 * 4 * 3.0 / 3.0)


def test_a_plan_that_does_not_fit_in_memory_is_infinite():
    snap = _snap(1, memory=3e6)  # 4 layers x 1 MB weights x 4 (weights, grads, Adam) > 3 MB
    e = estimate(_chain(1, 4, "1f1b", 4), snap, _model())
    assert math.isinf(e.step_s) and e.bottleneck == "memory:p0" and e.samples_per_s == 0.0


def test_gpipe_holds_every_micro_batch_and_1f1b_only_its_warm_up():
    # weights 2 layers x 4 x 1 MB = 8 MB; stash 2 MB a micro-batch; 16 micro-batches
    snap = _snap(2, memory=8e6 + 10 * 2e6)
    assert math.isinf(estimate(_chain(2, 4, "gpipe", 16), snap, _model()).step_s)
    assert math.isfinite(estimate(_chain(2, 4, "1f1b", 16), snap, _model()).step_s)


def test_unknown_links_are_estimated_from_the_others():
    snap = _snap(3, bw=1e6)
    links = dict(snap.network.links)
    links[("p0", "p1")] = links[("p1", "p0")] = None
    table = LinkTable(Snapshot(snap.peers, Network(links)), {"p0": 0, "p1": 0, "p2": 0})
    assert table.get("p0", "p1").bandwidth == pytest.approx(1e6)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fewer_micro_batches_than_stages_run_like_gpipe_over_unequal_stages(schedule):
    """m = 4 micro-batches over p = 8 stages of unequal speed behind a slow, far hop: the first
    stages' warm-ups cover all m forwards, so no latency cycle paces them (the model once charged
    one and over-predicted by a quarter), while the backwards cannot start before every forward has
    crossed the slow hop. The model agrees with the discrete-event simulator."""
    from spantrain_p2p.sim import simulate

    speeds = [4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 0.5, 0.5]
    peers = tuple(PeerInfo(f"p{i}", s * TF, 1e15) for i, s in enumerate(speeds))
    links = {(a.id, b.id): (Link(40.0, 1e6) if (int(a.id[1:]) < 2) != (int(b.id[1:]) < 2) else Link(0.5, 1e9))
             for a in peers for b in peers if a.id != b.id}
    snap = Snapshot(peers, Network(links))
    plan = _chain(8, 8, schedule, 4)
    model = _model(8, act=2e5)
    e, s = estimate(plan, snap, model), simulate(plan, snap, model, seed=0, jitter=False)
    assert e.step_s == pytest.approx(s.step_s, rel=0.05)
