"""Islands live: two sites train as islands (--sync islands), each on its own data steps, meet once a
round over the slow link with compressed pseudo-gradients, and end holding the same weights."""
from __future__ import annotations

import json
import pathlib

import pytest

from tests._helpers import run_swarm_json

STEPS = 30


def _warnings(run_dir, lines: int = 40) -> str:
    """The peers' warnings, errors and island lines, for a failure's message (what stalled, and where:
    this test failed once in nine runs on 2026-11-26, island a training 3 steps through the cut)."""
    out = []
    for log in sorted(pathlib.Path(run_dir).glob("*.log")):
        found = [x for x in log.read_text(errors="replace").splitlines()
                 if (" W " in x or " E " in x or "island" in x) and "torchao" not in x]
        out += [f"{log.stem}: {x}" for x in found[-lines:]]
    return "\n".join(out)


def _reports(run_dir) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(pathlib.Path(run_dir, "reports").glob("*.json"))]


@pytest.mark.heavy
def test_islands_train_on_their_own_data_and_end_with_the_same_weights(tmp_path):
    """With --island-split 2: each island takes a data step as two optimizer steps of half its
    micro-batches, and the data step's loss is all its micro-batches'."""
    s = run_swarm_json("--scenario", "peers/two-sites.toml", "--steps", str(STEPS), "--sync", "islands",
                       "--micro-batches", "4", "--island-split", "2", "--run-dir", str(tmp_path))
    plan = s["plan"]
    assert s["sync"] == "islands" and len(plan["islands"]) == 2, plan
    assert plan["sync_reason"].startswith("islands: asked for")
    isl = s["islands"]
    sites = sorted(tuple(x["peers"]) for x in isl["islands"])
    assert sites == [("a1", "a2"), ("b1",)], sites
    assert all(x["steps"] > 0 for x in isl["islands"]) and sum(x["steps"] for x in isl["islands"]) == STEPS
    # every data step trained once, by one island: the loss curve has each step of the job
    assert s["steps"] == STEPS and len(s["losses"]) == STEPS
    reports = _reports(tmp_path)
    by_island: dict[int, set] = {}
    for r in reports:
        by_island.setdefault(r["island"], set()).update(st for st, *_ in r["step_times"])
    a, b = by_island.values()
    assert not a & b and a | b == set(range(STEPS))
    for r in reports:  # two steps of 2 micro-batches a data step, and its loss over all 4
        assert len(r["step_times"]) == 2 * len({st for st, *_ in r["step_times"]}), r["name"]
        assert all(count == 4 for _ds, _sum, count, _ep in r["loss_sums"]), r["name"]
    # the exchange happened every round, compressed, and every island ends on the same anchor
    assert isl["rounds"] >= 3 and isl["codec"] and isl["exchange_bytes"] > 0
    digests: dict[str, set] = {}
    for r in reports:
        for layer, d in r["islands"]["digests"].items():
            digests.setdefault(layer, set()).add(d)
    assert digests and all(len(v) == 1 for v in digests.values()), digests
    merged = {row["round"] for r in reports for row in r["islands"]["rounds"]}
    assert merged == set(range(isl["rounds"]))  # each round merged once on every peer
    assert sum(s["losses"][-5:]) / 5 < s["losses"][0] - 0.5


@pytest.mark.heavy
def test_a_peer_killed_mid_round_costs_its_islands_the_round_and_the_run_finishes(tmp_path):
    """a2 dies: the planner re-plans the islands without it, every island resumes from the outer
    state of the latest round every layer still has (fetched from the other island where a peer
    lacks it), the rounds after it are redone, none is merged twice in an epoch."""
    steps = 40
    s = run_swarm_json("--scenario", "peers/two-sites.toml", "--steps", str(steps), "--sync", "islands",
                       "--chaos", "kill:a2@step=6", "--run-dir", str(tmp_path))
    kill = [e for e in s["events"] if e["kind"] == "kill"]
    assert kill and kill[0]["recovery_s"] is not None, s["events"]
    assert s["steps"] == steps and len(s["losses"]) == steps and s["lost_steps"] == 0
    assert s["plans"][-1]["islands"] and "a2" not in str(s["plans"][-1]["stages"])
    reports = [r for r in _reports(tmp_path) if r.get("islands")]
    final = s["plans"][-1]["epoch"]
    survivors = [r for r in reports if r["name"] in ("a1", "b1")]
    assert len(survivors) == 2
    assert survivors[0]["islands"]["digests"] == survivors[1]["islands"]["digests"]
    for r in survivors:
        merged = [(row["epoch"], row["round"]) for row in r["islands"]["rounds"]]
        assert len(merged) == len(set(merged)), merged  # no round merged twice in an epoch
        last = sorted(rnd for ep, rnd in merged if ep == final)
        assert last == list(range(last[0], last[0] + len(last)))  # the final epoch's rounds, in order
    assert sum(s["losses"][-5:]) / 5 < s["losses"][0] - 0.5


@pytest.mark.heavy
@pytest.mark.serial  # a cut of a set length against the keeper's leave deadline
def test_an_island_cut_off_is_left_out_the_other_goes_on_and_it_catches_up(tmp_path):
    """The link between the sites carries nothing for 12 s (well past the keeper's 5 s wait), from
    once every peer has trained 4 steps (a slow start does not move the cut before training): the
    keeper's island (a) leaves b out and goes on, without a re-plan; once the link is back b fetches
    the state it lacks, rejoins, and the run ends with every peer on the same anchor, no round
    merged twice.

    With both cores busy (two shell loops, 2026-11-25) it failed 2 times in 4 runs: island a stalled
    through the cut and nobody was left out. b's contributions of the last round had come just before
    the cut, so b stayed a member of it, and a's peers waited for their own sends of it to b, stuck
    on the cut link, before the next round's (``OuterSync._settle_sends``). They now wait for such a
    send no longer than the keeper waits for an island: 3 of 3 passed with both cores busy. It stays
    in the serial half, as a cut of a set length against the keeper's deadline."""
    steps = 260
    s = run_swarm_json("--scenario", "peers/two-sites.toml", "--steps", str(steps), "--sync", "islands",
                       "--chaos", "degrade:a-b:0@step=4", "--chaos", "restore:a-b@after=12", "--run-dir", str(tmp_path))
    isl = s["islands"]
    cut = [e for e in s["events"] if e["kind"] in ("degrade", "restore")]
    print(f"\ncut at step {cut[0]['step']}, restored at step {cut[1]['step']} ({cut[1]['t_s'] - cut[0]['t_s']:.1f}s); "
          f"{s['steps']} of {steps} data steps trained; left out {[r['round'] for r in isl['left_out']]}; "
          f"rejoins {[(r['peer'], r.get('round')) for r in isl['rejoins']]}")
    assert [p["epoch"] for p in s["plans"]] == [1], ([(p["epoch"], p.get("reason")) for p in s["plans"]],
                                                     _warnings(tmp_path))  # no re-plan: the islands handled it
    assert isl["left_out"] and {row["island"] for row in isl["left_out"]} == {1}, (isl["left_out"], _warnings(tmp_path))
    assert isl["rejoins"] and all(row["peer"] == "b1" for row in isl["rejoins"]), isl["rejoins"]
    reports = [r for r in _reports(tmp_path) if r.get("islands")]
    digests = {json.dumps(r["islands"]["digests"], sort_keys=True) for r in reports}
    assert len(digests) == 1, digests
    for r in reports:
        merged = [(row["epoch"], row["round"]) for row in r["islands"]["rounds"]]
        assert len(merged) == len(set(merged)), (r["name"], merged)
    keeper = [r for r in reports if r["islands"]["left_out"]]
    assert len(keeper) == 1 and keeper[0]["island"] == 0
    rounds = keeper[0]["islands"]["rounds"]
    assert [row["round"] for row in rounds] == list(range(len(rounds)))  # a went through every round
    assert rounds[-1]["members"] == [0, 1]  # b is back in by the end
    # the data steps of the rounds b lost are not trained: the loss curve has fewer steps than the job
    assert 0 < steps - s["steps"] < steps // 2
    assert sum(s["losses"][-5:]) / 5 < s["losses"][0] - 0.5
