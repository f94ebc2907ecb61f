"""The planner: near the exhaustive optimum, fast at a thousand peers, and ahead of the baselines."""
from __future__ import annotations

import math
import random
import time

import pytest

from spantrain_p2p import scenario
from spantrain_p2p.cli.plan_figures import small_instance
from spantrain_p2p.plan.planner import PlannerOptions, baselines, greedy_baseline, plan, uniform_baseline
from spantrain_p2p.plan.synthetic import synthetic_swarm
from spantrain_p2p.plan.types import ModelProfile, Snapshot, default_planning_model

GPT13 = ModelProfile.from_model_config(default_planning_model())


@pytest.mark.heavy
def test_dp_is_within_five_percent_of_exhaustive_search_on_small_instances():
    """6 peers, 8 layers, 8 random instances; both searches use the same cost model and the same
    rule for a stage (replicas of one compute class of one network group)."""
    rng = random.Random(2024)
    opts = PlannerOptions(global_batch=64, micro_batch_sizes=(1, 4))
    gaps = []
    for _ in range(8):
        snap, prof = small_instance(rng)
        dp = plan(snap, prof, opts).plan
        best = plan(snap, prof, opts, exhaustive=True).plan
        gaps.append(dp.step_s / best.step_s - 1)
    assert max(gaps) <= 0.05, [f"{g:+.3f}" for g in gaps]


def test_exhaustive_mode_refuses_large_instances():
    with pytest.raises(ValueError, match="small instances"):
        plan(synthetic_swarm(12, 2), GPT13, exhaustive=True)


def _speedup(name: str) -> float:
    snap = Snapshot.from_scenario(scenario.load(f"peers/{name}.toml"))
    opts = PlannerOptions(global_batch=256)
    mine = plan(snap, GPT13, opts).plan
    # the pipeline baselines (systems that place every peer); best-region has its own test (test_best_region)
    best_baseline = max(p.samples_per_s for k, p in baselines(snap, GPT13, opts).items() if k != "best-region")
    return mine.samples_per_s / best_baseline


def test_planner_beats_the_best_baseline_by_half_again_on_cee_3region():
    assert _speedup("cee-3region") >= 1.5


def test_planner_beats_the_best_baseline_twice_over_on_edge_volunteers():
    assert _speedup("edge-volunteers") >= 2.0


def test_a_thousand_peers_in_ten_regions_plan_in_seconds():
    snap = synthetic_swarm(1000, 10, seed=0)
    t0 = time.process_time()
    result = plan(snap, GPT13, PlannerOptions(global_batch=2048))
    elapsed = time.process_time() - t0
    # the figure (about 1.3-1.7 s here, idle) comes from scripts/plan_figures.sh; this only catches
    # a planner gone quadratic: CPU seconds, not wall-clock ones (with the suite's other tests on
    # both cores the wall clock read 8.7 s once)
    assert elapsed < 8.0, f"planning 1000 peers took {elapsed:.2f} CPU-s"
    assert result.plan.samples_per_s > 0 and result.plan.num_stages > 1


@pytest.mark.heavy
def test_the_plan_does_not_depend_on_the_order_peers_are_listed_in():
    snap = Snapshot.from_scenario(scenario.load("peers/edge-volunteers.toml"))
    shuffled = list(snap.peers)
    random.Random(5).shuffle(shuffled)
    a = plan(snap, GPT13).plan
    b = plan(Snapshot(tuple(shuffled), snap.network), GPT13).plan
    assert a.to_dict() == b.to_dict()


def test_stages_keep_all_reduce_inside_a_network_group():
    snap = Snapshot.from_scenario(scenario.load("peers/edge-volunteers.toml"))
    result = plan(snap, GPT13)
    where = result.grouping.group_of()
    for stage in result.plan.stages:
        assert len({where[p] for p in stage.peers}) == 1


def test_uniform_baseline_is_one_peer_per_stage_in_join_order_without_compression():
    snap = Snapshot.from_scenario(scenario.load("peers/cee-3region.toml"))
    p = uniform_baseline(snap, GPT13, "1f1b")
    assert [s.peers for s in p.stages] == [(x.id,) for x in snap.peers]
    sizes = [s.layers[1] - s.layers[0] for s in p.stages]
    assert max(sizes) - min(sizes) <= 1 and set(p.compression) == {"none"}


def test_greedy_baseline_covers_every_layer_once_by_speed():
    snap = Snapshot.from_scenario(scenario.load("peers/cee-3region.toml"))
    p = greedy_baseline(snap, GPT13)
    assert p.stages[0].layers[0] == 0 and p.stages[-1].layers[1] == GPT13.num_layers
    first = p.stages[0]
    assert first.peers == ("cloud-1",) and first.layers[1] - first.layers[0] > 5  # a fast peer takes a long span


def _two_regions(memory_b: float, memory_a: float = 1e15):
    """Two equal peers in two regions; compute (1 s a layer) dwarfs the link; b's memory is ``memory_b``."""
    from spantrain_p2p.plan.types import LayerProfile, Link, Network, PeerInfo
    prof = ModelProfile(tuple(LayerProfile(1e12, 1e12, 1e12, 1e6, 1e3, 1e3) for _ in range(8)))
    peers = (PeerInfo("a", 1e12, memory_a), PeerInfo("b", 1e12, memory_b))
    links = {("a", "b"): Link(0.05, 1e7), ("b", "a"): Link(0.05, 1e7)}
    return Snapshot(peers, Network(links)), prof


def _layers_of(p, peer: str) -> int:
    return sum(st.layers[1] - st.layers[0] for st in p.stages if peer in st.peers)


def test_a_peer_whose_memory_cannot_hold_its_share_gets_less():
    opts = PlannerOptions(global_batch=8, micro_batch_sizes=(1,))
    roomy = plan(*_two_regions(1e15), opts).plan
    assert _layers_of(roomy, "b") == 8  # compute dominates: b replicates the whole model
    # 8 layers x 1 MB weights x 4 (weights, grads, Adam moments) = 32 MB; b can hold 2 layers' worth
    tight = plan(*_two_regions(9e6), opts).plan
    assert 0 < _layers_of(tight, "b") <= 2 and _layers_of(tight, "a") >= 6
    assert math.isfinite(tight.step_s)


def test_a_model_that_fits_nowhere_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="does not fit in the peers' memory"):
        plan(*_two_regions(9e6, memory_a=9e6), PlannerOptions(global_batch=8, micro_batch_sizes=(1,)))
