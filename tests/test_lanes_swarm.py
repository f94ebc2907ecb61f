"""Swarms with --lanes (``train.lane_hops``): steps on the compute threads, tensors on lanes between
peers of this machine; the same arithmetic as through the event loops, and no step lost to a kill."""
import glob
import json
import os

import pytest

from spantrain_p2p.job.reference import reference_run
from spantrain_p2p.job.spec import JobSpec
from tests._helpers import run_swarm_json

# four peers of one machine on links too fast for the emulator to shape (as the side-by-side's): every
# hop can have a lane
FAST = """\
name = "fast-4"
description = "4 peers of this machine on loopback-fast links"
compute_scale = 1.0

[link_classes.loopback]
rtt_ms = 0.01
mbps = 100000

[device_classes.d]
tflops = 1000000
memory_gb = 64

[regions.local]
link = "loopback"
""" + "".join(f'\n[[peers]]\nname = "p{i}"\nregion = "local"\ndevice = "d"\nhost = "this"\n' for i in range(4))

UNDEFENDED = ["--aggregate", "sum", "--verify", "0", "--compression", "none"]
PLAIN = [*UNDEFENDED, "--plan", "even", "--no-measure"]


def _lanes_of(run_dir) -> dict[str, dict]:
    out = {}
    for path in glob.glob(os.path.join(run_dir, "reports", "*.json")):
        with open(path) as f:
            r = json.load(f)
        out[os.path.basename(path)[:-5]] = r.get("lanes")
    return out


def _scenario(tmp_path) -> str:
    path = tmp_path / "fast-4.toml"
    path.write_text(FAST)
    return str(path)


@pytest.mark.heavy
@pytest.mark.parametrize("schedule,stages,micro_batches", [("zb-h1", 4, 4), ("1f1b", 2, 6)])
def test_a_swarm_on_lanes_trains_like_one_process(schedule, stages, micro_batches, tmp_path):
    """Four stages (ZB-H1: B and W apart), or two stages of two replicas each (the gradient sum told of
    each layer from the compute thread): the losses of one process, and the tensors on lanes."""
    steps = 12
    out = run_swarm_json("--scenario", _scenario(tmp_path), "--steps", str(steps), "--stages", str(stages),
                         "--schedule", schedule, "--micro-batches", str(micro_batches), *PLAIN, "--lanes",
                         "--run-dir", str(tmp_path / "run"))
    ref, _ = reference_run(JobSpec(steps=steps, num_micro_batches=micro_batches), steps)
    assert len(out["losses"]) == steps
    worst = max(abs(a - b) / b for a, b in zip(out["losses"], ref))
    assert worst <= 1e-4, worst
    lanes = _lanes_of(tmp_path / "run")
    assert len(lanes) == 4 and all(v is not None for v in lanes.values()), lanes
    # every tensor went on a lane: stages - 1 hops, each way, every micro-batch of every step
    assert sum(v["lane"] for v in lanes.values()) == 2 * (stages - 1) * micro_batches * steps, lanes
    assert sum(v["loop"] for v in lanes.values()) == 0, lanes


@pytest.mark.heavy
def test_hops_an_emulated_link_shapes_go_through_the_event_loops(tmp_path):
    """lan-4's 1 Gbit/s links are the emulator's to shape: with --lanes the steps run on the compute
    threads, and every tensor is handed to the loop (its sends and receives as before)."""
    steps = 6
    out = run_swarm_json("--scenario", "peers/lan-4.toml", "--steps", str(steps), "--stages", "4",
                         "--micro-batches", "4", *PLAIN, "--lanes", "--run-dir", str(tmp_path / "run"))
    ref, _ = reference_run(JobSpec(steps=steps, num_micro_batches=4), steps)
    assert max(abs(a - b) / b for a, b in zip(out["losses"], ref)) <= 1e-4
    lanes = _lanes_of(tmp_path / "run")
    assert sum(v["lane"] for v in lanes.values()) == 0, lanes
    assert sum(v["loop"] for v in lanes.values()) == 2 * 3 * 4 * steps, lanes


@pytest.mark.heavy
@pytest.mark.parametrize("world", ["fast", "lan-4"])
def test_a_peer_killed_on_lanes_costs_no_step(world, tmp_path):
    """A worker killed at step 8: its neighbours' lanes end (fast), or their compute threads wait on
    the loop for its tensors (lan-4: every hop handed to the loop), their steps fail, the swarm
    re-plans without it and trains on to the last step with the losses of one process."""
    steps = 20
    scenario = _scenario(tmp_path) if world == "fast" else "peers/lan-4.toml"
    out = run_swarm_json("--scenario", scenario, "--steps", str(steps), "--micro-batches", "4",
                         *UNDEFENDED, "--lanes", "--chaos", "kill:worker@step=8",
                         "--run-dir", str(tmp_path / "run"))
    assert out["lost_steps"] == 0 and len(out["losses"]) == steps
    (event,) = out["events"]
    assert event["kind"] == "kill" and out["replans"] >= 1
    ref, _ = reference_run(JobSpec(steps=steps, num_micro_batches=4), steps)
    worst = max(abs(a - b) / b for a, b in zip(out["losses"], ref))
    assert worst <= 1e-3, worst
