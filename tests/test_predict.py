"""The launcher prices the plan a live run followed as `spantrain plan` does (cost model and
simulator on the scenario's configured world), so `spantrain bench` sets measured beside simulated."""
import json

import pytest

from spantrain_p2p import scenario
from spantrain_p2p.cli.plan import main as plan_main
from spantrain_p2p.launch import predict, real_time
from spantrain_p2p.job.spec import JobSpec


def _offline(capsys, name, workload, batch):
    assert plan_main(["--scenario", f"peers/{name}.toml", "--workload", workload, "--global-batch", str(batch),
                      "--micro-batch-sizes", "1", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("name,workload", [("cee-testbed-real", "hf:gpt2"), ("volunteers-real", "hf:llama-7b")])
def test_a_live_runs_plan_is_priced_as_spantrain_plan_prices_it_in_real_time(capsys, name, workload):
    d = _offline(capsys, name, workload, 16)
    p = d["planner"]
    # the run summary's form of the stage map: peers by name, shares by name, the plan's codecs
    summary_plan = {"schedule": p["schedule"], "compression": p["compression"],
                    "stages": [{"peers": list(st["microbatch_share"]), "layers": st["layers"],
                                "microbatch_share": st["microbatch_share"], "recompute": st["recompute"]}
                               for st in p["stages"]]}
    job = JobSpec(workload=workload, micro_batch_size=1, num_micro_batches=16, schedule=p["schedule"]).to_dict()
    s = scenario.load(f"peers/{name}.toml")
    got = predict.configured(summary_plan, job, s)
    # emulation time: the world runs time_dilation times slower; in real time it is the offline figure
    summary = {"samples_per_step": 16, "samples_per_s": 0.9 * 16 / got["simulated_step_s"], **got}
    summary.update(predict.rates(summary))
    real = real_time.run_summary(summary, s.time_dilation)
    assert real["simulated_step_s"] == pytest.approx(p["simulated_step_s"], rel=1e-4)
    assert real["configured_predicted_step_s"] == pytest.approx(p["predicted_step_s"], rel=1e-4)
    assert real["simulated_samples_per_s"] == pytest.approx(p["samples_per_s"], rel=1e-3)
    assert real["measured_over_simulated"] == pytest.approx(0.9, abs=1e-3)


def test_nothing_to_price_says_so_and_a_bad_plan_says_why():
    s = scenario.load("peers/cee-testbed-real.toml")
    assert predict.configured(None, {"workload": "hf:gpt2"}, s) == {}
    job = JobSpec(model="mypkg.models:build").to_dict()  # a user model: no FLOP model of it
    plan = {"stages": [{"peers": ["cloud-1"], "layers": [0, 2]}]}
    assert predict.configured(plan, job, s) == {}
    bad = {"stages": [{"peers": ["nobody"], "layers": [0, 14]}]}
    out = predict.configured(bad, JobSpec(workload="hf:gpt2").to_dict(), s)
    assert "nobody" in out["prediction_error"]
    assert predict.rates({"samples_per_step": 4, "samples_per_s": 2.0})["measured_over_simulated"] is None
