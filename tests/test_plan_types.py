"""Planner data: snapshots from scenarios and measurements, model profiles, plans and their JSON."""
from __future__ import annotations

import math

import pytest

from spantrain_p2p import scenario
from spantrain_p2p.plan.types import (GIB, HOST_BYTES_PER_S, ModelProfile, Plan, Snapshot, Stage, compression_ratio,
                                      default_planning_model)
from spantrain_p2p.plan.model import ModelConfig, num_params


def test_scenario_numbers_become_flops_bytes_and_seconds():
    sc = scenario.load("peers/cee-3region.toml")
    snap = Snapshot.from_scenario(sc)
    assert snap.peer("cloud-1").flops == pytest.approx(4.0e12)
    assert snap.peer("end-1").memory_bytes == pytest.approx(16 * GIB)
    wan = snap.network.link("cloud-1", "edge-1")
    assert wan.bandwidth == pytest.approx(100e6 / 8) and wan.rtt_s == pytest.approx(0.040)
    emulated = Snapshot.from_scenario(sc, emulated=True)
    assert emulated.peer("cloud-1").flops == pytest.approx(4.0e12 * sc.compute_scale)


def test_measurements_json_gives_a_snapshot_with_unknown_links_left_unknown():
    snap = Snapshot.from_measurements({
        "devices": [{"peer": "a", "tflops": 2.0, "memory_gb": 8, "step_s_per_param_byte": 2e-9,
                     "host_step_s_per_param_byte": 3e-10, "host_bytes_per_s": 5e9},
                    {"peer": "b", "tflops": 1.0, "memory_gb": 4}],
        "links": [{"src": "a", "dst": "b", "rtt_ms": 10.0, "mbps": 80.0, "status": "ok"},
                  {"src": "b", "dst": "a", "rtt_ms": None, "mbps": None, "status": "unknown"},
                  {"src": "a", "dst": "ghost", "rtt_ms": 1.0, "mbps": 1.0}],
    })
    assert snap.peer("a").flops == pytest.approx(2e12)
    assert (snap.peer("a").step_s_per_param_byte, snap.peer("b").step_s_per_param_byte) == (2e-9, 0.0)
    assert (snap.peer("a").host_step_s_per_param_byte, snap.peer("b").host_step_s_per_param_byte) == (3e-10, 0.0)
    assert (snap.peer("a").host_bytes_per_s, snap.peer("b").host_bytes_per_s) == (5e9, HOST_BYTES_PER_S)  # b: unmeasured
    assert snap.network.link("a", "b").bandwidth == pytest.approx(10e6)
    assert snap.network.links[("b", "a")] is None
    assert snap.network.link("b", "a") is not None  # falls back to the known direction


@pytest.mark.parametrize("bad,field", [
    ({"devices": []}, "devices"),
    ({"devices": [{"peer": "a", "tflops": -1, "memory_gb": 1}]}, "tflops"),
    ({"devices": [{"peer": "", "tflops": 1, "memory_gb": 1}]}, "peer"),
    ({"devices": [{"peer": "a", "tflops": 1, "memory_gb": 1, "step_s_per_param_byte": -1}]}, "step_s_per_param_byte"),
    ({"devices": [{"peer": "a", "tflops": 1, "memory_gb": 1, "host_step_s_per_param_byte": "x"}]},
     "host_step_s_per_param_byte"),
    ({"devices": [{"peer": "a", "tflops": 1, "memory_gb": 1, "host_bytes_per_s": -1}]}, "host_bytes_per_s"),
    ({"devices": [{"peer": "a", "tflops": 1, "memory_gb": 1}, {"peer": "b", "tflops": 1, "memory_gb": 1}],
      "links": [{"src": "a", "dst": "b", "rtt_ms": "fast", "mbps": 1}]}, "rtt_ms"),
    ("not a dict", "object"),
])
def test_bad_measurements_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        Snapshot.from_measurements(bad)


def test_profile_of_the_reference_transformer():
    cfg = ModelConfig(vocab=1000, dim=256, depth=4, heads=4, seq_len=128)
    prof = ModelProfile.from_model_config(cfg)
    assert prof.num_layers == cfg.depth + 2
    assert prof.total_param_bytes() == pytest.approx(4 * num_params(cfg))
    block = prof.layers[1]
    # matmul backward: input-grad and weight-grad each about the forward
    assert block.bwd_input_flops == pytest.approx(block.fwd_flops, rel=0.3)
    assert block.bwd_weight_flops == pytest.approx(block.fwd_flops, rel=0.3)
    assert block.activation_bytes_out == 128 * 256 * 4
    assert prof.layers[-1].activation_bytes_out == 0


def test_a_model_profile_goes_through_json_unchanged_and_a_bad_one_is_refused():
    """A peer's ``/report`` hands the launcher its model profile, which prices the run's plan with it
    instead of building the model again."""
    import json
    from dataclasses import replace

    prof = replace(ModelProfile.from_model_config(ModelConfig(dim=64, depth=2, heads=2, vocab=128, seq_len=16)),
                   name="tiny", wire_dtype_bytes=2, optimizer_bytes_per_param_byte=0.25)
    assert ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    d = prof.to_dict()
    for bad in ([], {**d, "layers": "x"}, {**d, "extra": 1}, {**d, "layers": [{"fwd_flops": "1"}]},
                {**d, "layers": [{**d["layers"][0], "mystery": 1.0}]}, {**d, "name": 3}, {**d, "wire_dtype_bytes": 2.5},
                {**d, "layers": [{**d["layers"][0], "fwd_flops": float("inf")}]}, {**d, "layers": []}):
        with pytest.raises(ValueError):
            ModelProfile.from_dict(bad)


def test_default_planning_model_is_a_gpt_of_about_a_billion_parameters():
    cfg = default_planning_model()
    assert 1.0e9 < num_params(cfg) < 1.6e9 and cfg.depth == 24 and cfg.seq_len == 1024


def test_compression_ratios():
    assert compression_ratio("none") == 1.0
    assert compression_ratio("fp16") == 0.5
    assert 0.25 < compression_ratio("int8") < 0.26
    assert compression_ratio("topk:0.1") == pytest.approx(0.15)
    with pytest.raises(ValueError):
        compression_ratio("zip")


def _plan(**kw) -> Plan:
    stages = (Stage(("a", "b"), (0, 3), (0.75, 0.25)), Stage(("c",), (3, 6), (1.0,)))
    return Plan(stages, kw.pop("schedule", "zb-h1"), 2, 8, ("int8",), **kw)


def test_plan_json_has_the_contract_shape():
    d = _plan(step_s=4.0, samples_per_s=4.0, bottleneck="compute:stage 1").to_dict()
    assert {"samples_per_s", "step_s", "bottleneck", "stages"} <= set(d)
    assert d["stages"][0] == {"peers": ["a", "b"], "layers": [0, 3], "microbatch_share": {"a": 0.75, "b": 0.25},
                              "recompute": "none"}
    assert d["samples_per_s"] == pytest.approx(16 / 4.0)
    assert math.isnan(_plan().step_s)


@pytest.mark.parametrize("stages,msg", [
    ((Stage(("a",), (0, 3), (1.0,)), Stage(("b",), (4, 6), (1.0,))), "starts at layer 4"),
    ((Stage(("a",), (0, 3), (1.0,)), Stage(("a",), (3, 6), (1.0,))), "already in another stage"),
])
def test_plans_with_gaps_or_a_peer_twice_are_refused(stages, msg):
    with pytest.raises(ValueError, match=msg):
        Plan(stages, "1f1b", 1, 4)


def test_a_plans_stage_shares_must_sum_to_one():
    with pytest.raises(ValueError, match="sum to 1"):
        Plan((Stage(("a", "b"), (0, 1), (0.5, 0.6)),), "1f1b", 1, 4)


def test_a_stage_map_keeps_its_raw_shares_and_normalizes_them_when_asked():
    st = Stage(("a", "b"), (0, 1), (3.0, 1.0))
    assert st.share_of() == {"a": 0.75, "b": 0.25}
    assert Stage(("a", "b"), (0, 1)).share_of() == {"a": 0.5, "b": 0.5}
    with pytest.raises(ValueError, match=">= 0"):
        Stage(("a", "b"), (0, 1), (1.0, -1.0))


def test_planning_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys, spantrain_p2p.plan, spantrain_p2p.plan.planner, spantrain_p2p.sim; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "importing the planner imported torch"
