"""Checkpoints in safetensors, one file per layer and step, and a swarm resumed from one onto
another stage layout that trains on exactly as if it had never stopped."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from spantrain_p2p.models import state as layer_state
from spantrain_p2p.models.checkpoint import CheckpointDir, layer_path, write_layers
from spantrain_p2p.launch import wait_until
from tests._helpers import swarm_json
from tests._reference_cache import default_losses


def _layer_with_adam_state():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()
    return layer, opt


def test_a_layer_s_state_round_trips_through_its_safetensors_file(tmp_path):
    layer, opt = _layer_with_adam_state()
    state = layer_state.capture(layer, opt)
    write_layers(str(tmp_path), "fp-a", "adam", 10, [(3, state)])
    with safe_open(layer_path(str(tmp_path), 10, 3), framework="pt") as f:
        assert f.metadata()["fingerprint"] == "fp-a" and f.metadata()["step"] == "10"
    ckpt = CheckpointDir(str(tmp_path), "fp-a", "adam")
    assert ckpt.inventory() == {3: [10]}
    back = dict(ckpt.load(3, 10, layer_state.expected_shapes(layer)))
    assert back.keys() == dict(state).keys()
    assert all(torch.equal(back[n], t) for n, t in state)  # weights and Adam's moments and step, bit for bit


def test_another_model_s_or_optimizer_s_files_are_left_out(tmp_path):
    layer, opt = _layer_with_adam_state()
    write_layers(str(tmp_path), "fp-a", "adam", 10, [(0, layer_state.capture(layer, opt))])
    assert CheckpointDir(str(tmp_path), "fp-b", "adam").inventory() == {}
    assert CheckpointDir(str(tmp_path), "fp-a", "sgd").inventory() == {}
    other = torch.nn.Linear(5, 3)
    assert CheckpointDir(str(tmp_path), "fp-a", "adam").load(0, 10, layer_state.expected_shapes(other)) is None


def test_a_peer_keeps_the_newest_two_steps_of_its_layers(tmp_path):
    layer, opt = _layer_with_adam_state()
    for step in (10, 20, 30):
        write_layers(str(tmp_path), "fp", "adam", step, [(0, layer_state.capture(layer, opt)),
                                                         (1, layer_state.capture(layer, opt))])
    assert CheckpointDir(str(tmp_path), "fp", "adam").inventory() == {0: [20, 30], 1: [20, 30]}
    assert sorted(os.listdir(tmp_path)) == ["step-00000020", "step-00000030"]


_REPLICA = """
import os, sys, time, torch
from spantrain_p2p.models import state as layer_state
from spantrain_p2p.models.checkpoint import write_layers
torch.manual_seed(0)
layer = torch.nn.Linear(4, 3)
open(os.path.join(sys.argv[2], str(os.getpid())), "w").close()
while not os.path.exists(os.path.join(sys.argv[2], "go")):
    time.sleep(0.001)
for step in range(1, 31):
    write_layers(sys.argv[1], "fp", "adam", step, [(0, layer_state.capture(layer, None))], {"job": 1})
"""


def test_replicas_of_a_stage_write_the_same_files_into_one_directory_at_once(tmp_path):
    """4 replicas of one stage in one local swarm share --checkpoint-dir: no write trips another's
    (each writes and prunes the same layer's files, here without waiting for the others)."""
    ckpt, ready = tmp_path / "ckpt", tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _REPLICA, str(ckpt), str(ready)], stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    wait_until(lambda: len(os.listdir(ready)) == 4, 60)
    (ready / "go").touch()  # all at once
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    assert CheckpointDir(str(ckpt), "fp", "adam").inventory() == {0: [29, 30]}


def _swarm(tmp_path, tag, *args):
    return swarm_json(tmp_path / tag, *args)


@pytest.mark.heavy
def test_a_swarm_resumed_onto_another_stage_count_trains_on_as_if_it_never_stopped(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ref = default_losses(40)
    first = _swarm(tmp_path, "a", "--steps", "20", "--stages", "4", "--checkpoint-every", "10",
                   "--checkpoint-dir", ckpt)
    assert [len(s["peers"]) for s in first["plan"]["stages"]] == [1, 1, 1, 1]
    assert sorted(os.listdir(ckpt)) == ["job.json", "step-00000010", "step-00000020"]
    resumed = _swarm(tmp_path, "b", "--steps", "40", "--stages", "2", "--resume", ckpt)
    assert [len(s["peers"]) for s in resumed["plan"]["stages"]] == [2, 2]
    assert resumed["steps"] == 20 and len(resumed["losses"]) == 20  # steps 20..39, none redone
    worst = max(abs(a - b) / b for a, b in zip(resumed["losses"], ref[20:]))
    print(f"\nresumed at step 20 on 2 stages x 2 replicas (was 4 stages): worst loss rel. error {worst:.2e} over "
          f"20 steps against an uninterrupted run; loss {resumed['losses'][0]:.4f} -> {resumed['losses'][-1]:.4f}")
    assert worst <= 1e-4
