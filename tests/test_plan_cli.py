"""`spantrain plan`: one JSON object on the last line in the issue-5 shape, or a readable table."""
from __future__ import annotations

import argparse
import json

import pytest

from spantrain_p2p.cli.plan import add_plan_arguments, plan_command


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="spantrain plan")
    add_plan_arguments(parser)
    rc = plan_command(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.heavy
def test_plan_a_scenario_as_json(capsys):
    rc, out, _ = _run(capsys, "--scenario", "peers/cee-3region.toml", "--json")
    assert rc == 0
    d = json.loads(out.strip().splitlines()[-1])
    assert d["plan_seconds"] > 0
    planner = d["planner"]
    assert {"samples_per_s", "step_s", "bottleneck", "stages"} <= set(planner)
    for st in planner["stages"]:
        assert set(st) >= {"peers", "layers", "microbatch_share"}
        assert sum(st["microbatch_share"].values()) == pytest.approx(1.0, abs=1e-4)
    assert planner["stages"][0]["layers"][0] == 0 and planner["stages"][-1]["layers"][1] == d["model"]["layers"]
    assert set(d["baselines"]) == {"gpipe-uniform", "1f1b-uniform", "greedy", "best-region"}
    for b in d["baselines"].values():
        assert "samples_per_s" in b and "step_s" in b
    best = max(b["samples_per_s"] for k, b in d["baselines"].items() if k != "best-region")
    assert planner["samples_per_s"] >= 1.5 * best  # simulated, not predicted
    assert planner["samples_per_s"] >= 1.2 * d["baselines"]["best-region"]["samples_per_s"]  # it spans regions


def test_the_plan_gives_the_islands_and_the_auto_pick_beside_the_global_plan_and_each_stage_s_levers(capsys):
    """Two sites, GPT-2: two islands, and what --sync auto would run (here the global plan, predicted
    faster) with its reason, as `spantrain swarm` plans them; every stage names its lever."""
    rc, out, _ = _run(capsys, "--scenario", "peers/two-sites.toml", "--workload", "hf:gpt2", "--json")
    assert rc == 0
    d = json.loads(out.strip().splitlines()[-1])
    isl = d["islands"]
    assert isl["islands"] == 2 and len(isl["plans"]) == 2 and isl["samples_per_s"] > 0
    assert len({p for plan in isl["plans"] for p in plan["peers"]}) == d["peers"] - len(isl["left_out"])
    assert d["sync_auto"]["pick"] in ("global", "islands") and "samples/s predicted" in d["sync_auto"]["why"]
    assert (d["sync_auto"]["pick"] == "islands") == (isl["samples_per_s"] > d["planner"]["samples_per_s"])
    assert all(st["recompute"] in ("none", "full") for st in d["planner"]["stages"])


@pytest.mark.heavy
def test_plan_a_synthetic_swarm(capsys):
    rc, out, _ = _run(capsys, "--synthetic-peers", "40", "--regions", "4", "--seed", "3", "--global-batch", "256", "--json",
                     "--no-baselines")  # (the baselines: the tests of a scenario below)
    assert rc == 0
    d = json.loads(out.strip().splitlines()[-1])
    assert d["peers"] == 40 and d["grouping"]["groups"] == 4
    assert d["planner"]["samples_per_s"] > 0


def test_plan_from_measurements(tmp_path, capsys):
    meas = {
        "devices": [{"peer": f"n{i}", "tflops": 1.0 + i, "memory_gb": 40} for i in range(4)],
        "links": [{"src": f"n{i}", "dst": f"n{j}", "rtt_ms": 2.0 if (i < 2) == (j < 2) else 60.0,
                   "mbps": 1000.0 if (i < 2) == (j < 2) else 50.0, "status": "ok"}
                  for i in range(4) for j in range(4) if i != j],
    }
    path = tmp_path / "m.json"
    path.write_text(json.dumps(meas))
    rc, out, _ = _run(capsys, "--measurements", str(path), "--model-dim", "1024", "--model-depth", "8", "--json")
    assert rc == 0
    d = json.loads(out.strip().splitlines()[-1])
    assert d["model"]["dim"] == 1024 and d["model"]["depth"] == 8
    assert d["grouping"]["groups"] == 2


def test_the_table_names_the_planner_the_baselines_and_the_bottleneck(capsys):
    rc, out, _ = _run(capsys, "--scenario", "peers/lan-4.toml")
    assert rc == 0
    for word in ("planner", "gpipe-uniform", "1f1b-uniform", "greedy", "bottleneck", "stage 0"):
        assert word in out


@pytest.mark.parametrize("argv,msg", [
    ((), "give --scenario"),
    (("--scenario", "peers/nope.toml"), "not found"),
    (("--synthetic-peers", "10", "--scenario", "peers/lan-4.toml"), "cannot be combined"),
    (("--synthetic-peers", "10", "--compressions", "zip"), "unknown compression"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_code_one(capsys, argv, msg):
    rc, out, err = _run(capsys, *argv)
    assert rc == 1 and msg in err and out == ""


def test_peers_too_small_get_a_plan_only_with_recomputation(capsys):
    """peers/tight-memory.toml, the tiny Llama at 8 x 128 tokens: --recompute none finds no plan and says
    why; auto (the default) plans, with the stages that need it recomputing."""
    argv = ("--scenario", "peers/tight-memory.toml", "--workload", "hf:llama-tiny", "--seq-len", "128",
            "--global-batch", "32", "--micro-batch-sizes", "8", "--no-baselines", "--json")
    rc, _, err = _run(capsys, *argv, "--recompute", "none")
    assert rc == 1 and "does not fit in the peers' memory" in err
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    stages = json.loads(out.strip().splitlines()[-1])["planner"]["stages"]
    assert any(st["recompute"] == "full" for st in stages)


def test_a_7b_model_fits_consumer_gpus_only_with_the_memory_levers(capsys):
    """peers/consumer-gpus.toml: 16 cards of 8 and 10 GB; Llama-7B's training state alone (~108 GB)
    needs all of them, and its activations only fit recomputed: no plan without the levers; with
    them every card is used and every peer's predicted peak is under its device's memory."""
    argv = ("--scenario", "peers/consumer-gpus.toml", "--workload", "hf:llama-7b", "--seq-len", "1024",
            "--global-batch", "64", "--no-baselines", "--json")
    rc, _, err = _run(capsys, *argv, "--recompute", "none")
    assert rc == 1 and "does not fit in the peers' memory" in err
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    planner = json.loads(out.strip().splitlines()[-1])["planner"]
    assert planner["peers_used"] == 16 and any(st["recompute"] == "full" for st in planner["stages"])
    assert len(planner["memory"]) == 16
    for peer, m in planner["memory"].items():
        assert 0 < m["peak_bytes"] <= m["device_bytes"] <= 10 * 2**30, (peer, m)
