"""The best-region baseline: what an operator does by hand, the planner's plan inside the one
fastest network group with the slow links left out. The planner, free to span regions, is never
slower, and is faster where one region is not enough."""
from __future__ import annotations

import math

import pytest

from spantrain_p2p import scenario
from spantrain_p2p.plan.planner import PlannerOptions, baseline, best_region_baseline, plan
from spantrain_p2p.plan.types import ModelProfile, Snapshot, default_planning_model
from spantrain_p2p.swarm.grouping import group

GPT13 = ModelProfile.from_model_config(default_planning_model())
OPTS = PlannerOptions(global_batch=256)


def _snap(name):
    return Snapshot.from_scenario(scenario.load(f"peers/{name}.toml"))


def test_best_region_uses_the_peers_of_one_network_group_only():
    for name in ("cee-3region", "edge-volunteers"):
        snap = _snap(name)
        groups = [set(g.peers) for g in group(snap, OPTS.grouping).groups]
        br = best_region_baseline(snap, GPT13, OPTS)
        used = set(br.peers())
        assert br.name == "best-region" and math.isfinite(br.step_s)
        assert any(used <= g for g in groups), (name, used)


@pytest.mark.heavy
def test_the_planner_is_never_slower_than_best_region_and_faster_when_it_spans_regions():
    """Offline, the 1.3B-parameter planning model at 256 samples a step (scenario units)."""
    ratios = {}
    for name in ("cee-3region", "edge-volunteers"):
        snap = _snap(name)
        mine = plan(snap, GPT13, OPTS).plan
        br = baseline("best-region", snap, GPT13, OPTS)
        ratios[name] = mine.samples_per_s / br.samples_per_s
        assert mine.samples_per_s >= br.samples_per_s * (1 - 1e-9), (name, ratios[name])
    print(f"\nplanner / best-region: {ratios}")
    assert ratios["cee-3region"] > 1.2 and ratios["edge-volunteers"] > 1.2  # both span regions
    full = _snap("cee-3region")  # one region alone: the planner's plan is best-region's
    cloud = Snapshot(tuple(p for p in full.peers if p.id.startswith("cloud")), full.network)
    assert plan(cloud, GPT13, OPTS).plan.step_s == best_region_baseline(cloud, GPT13, OPTS).step_s


def test_where_no_region_can_hold_the_model_best_region_is_infeasible_and_says_so():
    snap = _snap("edge-volunteers")
    small = Snapshot(tuple(p.__class__(**{**p.__dict__, "memory_bytes": p.memory_bytes / 40}) for p in snap.peers),
                     snap.network)
    br = best_region_baseline(small, GPT13, OPTS)
    assert not math.isfinite(br.step_s)
