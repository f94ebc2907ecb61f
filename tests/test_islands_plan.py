"""Islands in the planner (pure logic): rounds that hide the exchange, the data each island trains
on, the exchange's cost, and --sync auto's choice."""
from __future__ import annotations

import math

import pytest

from spantrain_p2p import scenario
from spantrain_p2p.compress import codecs
from spantrain_p2p.plan import islands
from spantrain_p2p.plan.layout import LinkTable
from spantrain_p2p.plan.planner import PlannerOptions, baseline, plan
from spantrain_p2p.plan.types import Plan, Snapshot, Stage
from spantrain_p2p.swarm.grouping import group
from spantrain_p2p.models.workload import profile_of


def test_sync_specs_parse_and_bad_ones_are_named():
    assert islands.parse_sync("global") == ("global", 0)
    assert islands.parse_sync("islands") == ("islands", 0)
    assert islands.parse_sync("islands:25") == ("islands", 25)
    assert islands.parse_sync("auto") == ("auto", 0)
    for bad in ("island", "islands:0", "islands:x", "auto:3", "global:2", ""):
        with pytest.raises(ValueError, match="--sync"):
            islands.parse_sync(bad)


@pytest.mark.parametrize("codec", ["int8", "int:4", "topk:0.1", "topk:0.01"])
def test_the_exchange_ratio_is_what_the_codec_puts_on_the_wire(codec):
    n = 1 << 20
    assert islands.exchange_ratio(codec) == pytest.approx(codecs.wire_ratio(codec, (n,)), rel=1e-3)


def test_rounds_hide_the_exchange_and_fast_islands_take_more_steps():
    steps, window = islands.round_lengths([0.1, 0.5], exchange_s=2.0)
    assert steps == (25, 5) and window == pytest.approx(2.5)
    assert islands.hidden_fraction(steps, [0.1, 0.5], 2.0) == 1.0
    # capped: the fastest island takes at most MAX_STEPS_PER_ROUND steps; the exchange then shows
    steps, _ = islands.round_lengths([0.01, 0.02], exchange_s=10.0)
    assert steps == (islands.MAX_STEPS_PER_ROUND, islands.MAX_STEPS_PER_ROUND // 2)
    assert islands.hidden_fraction(steps, [0.01, 0.02], 10.0) == pytest.approx(0.1)
    assert islands.round_period(steps, [0.01, 0.02], 10.0) == 10.0
    # --sync islands:H sets the fastest island's steps; a slow island still takes one
    assert islands.round_lengths([0.1, 0.5], 0.0, fixed_steps=3)[0] == (5, 1)
    assert islands.round_lengths([0.1, 0.5], 0.0, fixed_steps=20)[0] == (20, 4)


def test_islands_train_on_disjoint_data_that_together_covers_the_job_in_order():
    H, total = (5, 2, 3), 47
    seen = []
    rounds = [list(islands.data_steps(H, i, total)) for i in range(3)]
    assert len({len(r) for r in rounds}) == 1  # every island runs the same rounds
    for r in range(len(rounds[0])):
        for i in range(3):
            assert rounds[i][r][:2] == (r, 10 * r)
            seen.extend(rounds[i][r][2])
    assert seen == list(range(total))
    # resumed at round 3 (data step 30) under the same rounds: the same data from there on
    assert list(islands.data_steps(H, 1, total, start_round=3, first_data_step=30)) == rounds[1][3:]
    # ... or under other rounds (a re-plan): round 7 starts where round 3 did
    again = [list(islands.data_steps((4, 4), i, total, start_round=7, first_data_step=30)) for i in range(2)]
    assert again[0][0] == (7, 30, [30, 31, 32, 33]) and again[1][0] == (7, 30, [34, 35, 36, 37])
    assert sorted(s for i in range(2) for _r, _b, steps in again[i] for s in steps) == list(range(30, total))


def _plan(peers_by_stage, layers, step_s):
    stages = tuple(Stage(tuple(ps), rng, tuple([1 / len(ps)] * len(ps))) for ps, rng in zip(peers_by_stage, layers))
    return Plan(stages, "1f1b", 1, 4, step_s=step_s, samples_per_s=4 / step_s)


def test_each_layer_goes_from_one_replica_of_each_island_to_every_holder_in_the_others():
    a = _plan([["a1", "a2"], ["a3"]], [(0, 2), (2, 4)], 1.0)
    b = _plan([["b1"]], [(0, 4)], 2.0)
    routes = islands.exchange_routes([a, b], 4)
    assert sorted(routes) == sorted([("a1", "b1", 0, 0), ("a1", "b1", 0, 1), ("a3", "b1", 0, 2), ("a3", "b1", 0, 3),
                                     ("b1", "a1", 1, 0), ("b1", "a2", 1, 0), ("b1", "a1", 1, 1), ("b1", "a2", 1, 1),
                                     ("b1", "a3", 1, 2), ("b1", "a3", 1, 3)])


def _cee():
    snap = Snapshot.from_scenario(scenario.load("peers/cee-testbed-real.toml"))
    prof = profile_of("hf:gpt2", 1024)
    opts = PlannerOptions(global_batch=16, micro_batch_sizes=(4,), compressions=("none", "fp16", "int8"))
    grouping = group(snap, opts.grouping)
    links = LinkTable(snap, grouping.group_of())
    return snap, prof, opts, grouping, links


def test_on_the_cee_testbed_islands_use_the_edge_gpus_the_global_plan_leaves_idle():
    """GPT-2 at 16 samples a step: the best step-synchronous plan is the cloud's alone (activations
    over 100 Mbit/s cost more than the edge gives); islands add the edge servers and end PCs."""
    snap, prof, opts, grouping, links = _cee()
    glob = plan(snap, prof, opts).plan
    br = baseline("best-region", snap, prof, opts)
    ip = islands.plan_islands(snap, prof, [g.peers for g in grouping.groups], links,
                              lambda region: plan(region, prof, opts, regions=False).plan)
    assert ip is not None and len(ip.islands) >= 3
    used = [p for isl in ip.islands for p in isl.peers()]
    assert len(used) == len(set(used))  # no peer in two islands
    assert ip.hidden == 1.0 and ip.round_s >= ip.exchange_s
    assert ip.samples_per_s > 1.2 * br.samples_per_s
    assert islands.choose(glob, ip, "auto")[0] == "islands"
    assert islands.choose(glob, ip, "global")[0] == "global"
    print(f"\nislands {ip.figures()}\nglobal {glob.samples_per_s:.1f} samples/s, best-region {br.samples_per_s:.1f}")


def test_a_split_island_plans_its_share_of_a_data_step_and_takes_it_split_times():
    """--island-split 2: each island's plan is a step of half the micro-batches, and a data step
    costs the island two of them (so a round of the same steps takes that long)."""
    import dataclasses

    snap, prof, opts, grouping, links = _cee()
    half = dataclasses.replace(opts, global_batch=opts.global_batch // 2)
    ip = islands.plan_islands(snap, prof, [g.peers for g in grouping.groups], links,
                              lambda region: plan(region, prof, half, regions=False).plan, split=2)
    assert ip is not None and ip.split == 2 and ip.figures()["split"] == 2
    assert all(p.micro_batch_size * p.num_micro_batches == opts.global_batch // 2 for p in ip.islands)
    assert ip.step_s == tuple(2 * p.step_s for p in ip.islands)
    assert ip.samples_per_step == opts.global_batch  # rounds count data steps, as without a split
    assert ip.samples_per_s == pytest.approx(ip.samples_per_round / ip.round_s)


def test_auto_keeps_the_global_plan_where_islands_cannot_form_or_are_slower():
    snap, prof, opts, grouping, links = _cee()
    glob = plan(snap, prof, opts).plan
    assert islands.choose(glob, None, "auto")[0] == "global"
    with pytest.raises(ValueError, match="two network groups"):
        islands.choose(glob, None, "islands")
    ip = islands.plan_islands(snap, prof, [g.peers for g in grouping.groups], links,
                              lambda region: plan(region, prof, opts, regions=False).plan)
    slow = glob.__class__(**{**glob.__dict__, "samples_per_s": ip.samples_per_s * 2, "step_s": 1e-9})
    assert islands.choose(slow, ip, "auto")[0] == "global"
    assert not math.isnan(ip.bytes_per_sample)


def test_a_group_that_cannot_hold_the_model_is_left_out():
    snap, prof, opts, grouping, links = _cee()

    def plan_group(region):
        if any(p.id.startswith("cloud") for p in region.peers):
            raise ValueError("no feasible plan: too small")
        return plan(region, prof, opts, regions=False).plan

    ip = islands.plan_islands(snap, prof, [g.peers for g in grouping.groups], links, plan_group)
    assert ip is not None and {"cloud-1", "cloud-2"} <= set(ip.left_out)
    assert any("left out" in n for n in ip.notes)


def test_the_summary_of_a_run_with_islands_counts_data_steps_waits_and_sending():
    from spantrain_p2p.launch.report import islands_summary

    def peer(name, island, stage, steps, t0, dt, rounds, sends):
        return {"name": name, "island": island, "stage": stage, "layers": [0, 2], "steps_done": len(steps),
                "step_s_median": dt, "compute_s_median": dt, "error": None, "plan": {}, "full_plan": {"epoch": 1},
                "loss_sums": [[s, 2.0 * 4, 4, 1] for s in steps],
                "step_times": [[s, t0 + i * dt, t0 + (i + 1) * dt, 1] for i, s in enumerate(steps)],
                "islands": {"codec": "int8", "bytes_sent": 1000 * len(sends), "rounds": rounds, "sends": sends}}

    # 4 rounds of 3 + 1 data steps: island 0 takes 0-2, 4-6, ..., island 1 takes 3, 7, ...
    a = [s for r in range(4) for s in range(4 * r, 4 * r + 3)]
    b = [4 * r + 3 for r in range(4)]
    rounds = [{"round": r, "epoch": 1, "wait_s": w} for r, w in enumerate((0.0, 0.5, 3.0, 9.0))]
    sends = [{"round": r, "send_s": 2.0, "bytes": 1000} for r in range(4)]
    s = islands_summary([peer("a", 0, 0, a, 100.0, 1.0, rounds, sends), peer("b", 1, 0, b, 100.0, 3.0, rounds, sends)],
                        samples_per_step=4, seq_len=10)
    assert s["sync"] == "islands" and s["steps"] == 16 and s["losses"] == [2.0] * 16
    isl = s["islands"]
    assert isl["rounds"] == 4 and isl["exchange_bytes"] == 8000
    assert isl["exchange_bytes_per_token"] == 8000 / (16 * 4 * 10)
    # steady rounds only (0 and 1: the last round and the one merged at its end are left out)
    assert isl["wait_s_median"] == 0.25 and isl["hidden"] == round(1 - 0.25 / 2.0, 4)
    # samples/s from the moment both islands finished a step to the last step's end
    assert s["samples_per_s"] == round(12 * 4 / (112.0 - 103.0), 3)  # 9 of a's steps and 3 of b's end after 103


def test_sync_auto_on_the_shipped_realistic_scenarios():
    """Predicted: islands on the CEE testbed (the edge servers each hold GPT-2 alone) and across the
    continents (each region holds Llama-7B); volunteers' consumer GPUs hold Llama-7B in no group
    alone, so their run stays one global plan."""
    from spantrain_p2p.train import planning
    from spantrain_p2p.job.spec import JobSpec

    picks = {}
    for name, wl, b, m in (("cee-testbed-real", "hf:gpt2", 4, 4), ("volunteers-real", "hf:llama-7b", 1, 16),
                           ("continents-real", "hf:llama-7b", 1, 16)):
        snap = Snapshot.from_scenario(scenario.load(f"peers/{name}.toml"))
        job = JobSpec(workload=wl, micro_batch_size=b, num_micro_batches=m, sync="auto", compression="adaptive",
                      schedule="auto")
        chosen, why = planning.make_sync_plan(job, snap)
        picks[name] = "islands" if isinstance(chosen, islands.IslandsPlan) else "global"
        assert why.startswith(picks[name])
        if picks[name] == "islands":
            assert chosen.hidden == 1.0 and chosen.samples_per_s > planning.make_plan(job, snap).samples_per_s
    assert picks == {"cee-testbed-real": "islands", "volunteers-real": "global", "continents-real": "islands"}


def test_the_job_may_fix_the_exchange_codec_and_split_the_islands_steps():
    from spantrain_p2p.train import planning
    from spantrain_p2p.job.spec import JobSpec

    snap = Snapshot.from_scenario(scenario.load("peers/cee-testbed-real.toml"))
    job = JobSpec(workload="hf:gpt2", micro_batch_size=4, num_micro_batches=4, sync="islands", compression="adaptive")
    auto = planning.make_islands(job, snap)
    fixed = planning.make_islands(JobSpec(**{**job.to_dict(), "exchange_compression": "int:4", "island_split": 2}), snap)
    assert auto.codec != "int:4" and fixed.codec == "int:4" and fixed.split == 2
    assert all(p.num_micro_batches == 2 for p in fixed.islands)
