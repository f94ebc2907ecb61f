"""The discrete-event simulator: exact on the textbook cases, free of deadlock with replicas, and
the cost model's check: within 10 % of it on the shipped scenarios."""
from __future__ import annotations

import itertools
import math

import pytest

from spantrain_p2p import scenario
from spantrain_p2p.pipeline.schedule import all_stages, simulate as schedule_simulate
from spantrain_p2p.cli.plan import ladder_configs
from spantrain_p2p.plan.cost import estimate
from spantrain_p2p.plan.layout import LinkTable
from spantrain_p2p.plan.planner import PlannerOptions, baselines, plan, plan_largest
from spantrain_p2p.plan.types import (LayerProfile, Link, ModelProfile, Network, PeerInfo, Plan, Snapshot, Stage,
                                      default_planning_model)
from spantrain_p2p.sim import simulate

TF = 1e12


def _model(n: int, act: float = 1e6) -> ModelProfile:
    return ModelProfile(tuple(LayerProfile(1e12, 2e12, 1e12, 1e6, act, 1e3) for _ in range(n)))


def _snap(n: int, bw: float = 1e15, rtt: float = 0.0, jitter: float = 0.0, flops=None) -> Snapshot:
    peers = tuple(PeerInfo(f"p{i}", (flops[i] if flops else 1.0) * TF, 1e15) for i in range(n))
    return Snapshot(peers, Network({(a.id, b.id): Link(rtt, bw, jitter) for a in peers for b in peers if a != b}))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", [(1, 3), (3, 7), (4, 16)])
def test_one_peer_per_stage_matches_the_schedule_module(schedule, p, m):
    plan_ = Plan(tuple(Stage((f"p{i}",), (i, i + 1), (1.0,)) for i in range(p)), schedule, 1, m)
    sim = simulate(plan_, _snap(p), _model(p))
    ref = schedule_simulate(all_stages(schedule, p, m), 1.0, 2.0, 1.0)["makespan"]
    assert sim.step_s == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_stages_of_several_replicas_never_deadlock(schedule):
    for sizes in itertools.product([1, 2, 3], repeat=3):
        n = sum(sizes)
        ids = iter(range(n))
        stages = []
        for s, k in enumerate(sizes):
            members = tuple(f"p{next(ids)}" for _ in range(k))
            stages.append(Stage(members, (s, s + 1), tuple([1.0 / k] * k)))
        for m in (1, 5, 12):
            sim = simulate(Plan(tuple(stages), schedule, 1, m), _snap(n, bw=1e7, rtt=0.01), _model(3))
            assert math.isfinite(sim.step_s)


def _runtime_compute(plan_: Plan) -> dict[str, list[str]]:
    """Each peer's compute actions as the peers run them: the plan's stage map off the wire, its
    stages' micro-batch owners and ``peer_actions`` (what the trainer calls)."""
    from spantrain_p2p.pipeline.assignment import peer_actions
    from spantrain_p2p.pipeline.schedule import COMPUTE_OPS
    from spantrain_p2p.plan.stagemap import StageMap

    smap = StageMap(1, "j", plan_.stages, schedule=plan_.schedule)
    smap = StageMap.from_dict(smap.to_dict(), plan_.num_layers)
    assigns = [st.assign(plan_.num_micro_batches) for st in smap.stages]
    return {peer: [str(a) for a in acts if a.op in COMPUTE_OPS]
            for (_, peer), acts in peer_actions(assigns, smap.schedule).items() if acts}


def _simulated_compute(plan_: Plan, snap: Snapshot, prof: ModelProfile) -> dict[str, list[str]]:
    trace: list = []
    simulate(plan_, snap, prof, trace=trace)
    out: dict[str, list[str]] = {}
    for peer, what, _start, _end in trace:
        if "->" not in what:  # a compute action, not a message
            out.setdefault(peer, []).append(what)
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["cee-3region", "edge-volunteers"])
def test_the_simulator_runs_what_the_peers_run(name):
    snap = Snapshot.from_scenario(scenario.load(f"peers/{name}.toml"))
    prof = ModelProfile.from_model_config(default_planning_model())
    for plan_ in [plan(snap, prof).plan, *baselines(snap, prof).values()]:
        assert _simulated_compute(plan_, snap, prof) == _runtime_compute(plan_), plan_.name


def test_the_simulator_runs_what_the_peers_run_with_uneven_replicas():
    plan_ = Plan((Stage(("p0", "p1", "p2"), (0, 1), (0.5, 0.3, 0.2)), Stage(("p3", "p4"), (1, 3), (0.6, 0.4))),
                 "zb-h1", 1, 13)
    assert _simulated_compute(plan_, _snap(5), _model(3)) == _runtime_compute(plan_)


def test_a_link_carries_one_message_at_a_time():
    # 2 stages, compute 0 s, 1 MB messages at 1 MB/s: the link needs m seconds each way
    prof = ModelProfile(tuple(LayerProfile(0.0, 0.0, 0.0, 0.0, 1e6) for _ in range(2)))
    plan_ = Plan((Stage(("p0",), (0, 1), (1.0,)), Stage(("p1",), (1, 2), (1.0,))), "gpipe", 1, 8)
    assert simulate(plan_, _snap(2, bw=1e6), prof).step_s == pytest.approx(16.0)


def test_jitter_is_repeatable_for_a_seed_and_varies_with_it():
    plan_ = Plan((Stage(("p0",), (0, 2), (1.0,)), Stage(("p1",), (2, 4), (1.0,))), "1f1b", 1, 8)
    snap = _snap(2, bw=1e7, rtt=0.5, jitter=0.2)
    a, b = simulate(plan_, snap, _model(4), seed=1), simulate(plan_, snap, _model(4), seed=1)
    assert a.step_s == b.step_s
    assert simulate(plan_, snap, _model(4), seed=2).step_s != a.step_s


def test_running_out_of_memory_makes_the_step_infinite():
    prof = ModelProfile((LayerProfile(1e12, 1e12, 1e12, 1e9, 1e6, 1e9),))
    snap = Snapshot((PeerInfo("p0", TF, 5e9),), Network({}))
    sim = simulate(Plan((Stage(("p0",), (0, 1), (1.0,)),), "gpipe", 1, 4), snap, prof)
    assert math.isinf(sim.step_s) and sim.out_of_memory == ("p0",)


@pytest.mark.parametrize("name", ["lan-4", "cee-3region", "edge-volunteers"])
def test_cost_model_agrees_with_the_simulator_within_ten_percent_on_the_shipped_scenarios(name):
    snap = Snapshot.from_scenario(scenario.load(f"peers/{name}.toml"))
    opts = PlannerOptions(global_batch=256)
    _, prof, result = plan_largest(snap, ladder_configs(), opts)  # as `spantrain plan`: the largest that fits
    links = LinkTable(snap, result.grouping.group_of())
    plans = [result.plan] + [p for p in baselines(snap, prof, opts, links).values() if math.isfinite(p.step_s)]
    for p in plans:
        sim = simulate(p, snap, prof, links, seed=0).step_s
        model = estimate(p, snap, prof, links).step_s
        assert abs(model / sim - 1) < 0.10, f"{name} {p.name}: cost model {model:.1f} s, simulator {sim:.1f} s"
