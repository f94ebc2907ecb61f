"""fp16 with dynamic loss scaling: the scale follows torch's GradScaler step for step, survives in
layer states and checkpoints, and a swarm skips exactly the steps one process with GradScaler
skips, on every peer, then trains like it."""
import random

import pytest
import torch

from spantrain_p2p.pipeline.loss_scale import STATE_KEYS, LossScale, nonfinite, sanitized, scaled, unscale_
from spantrain_p2p.models import state as layer_state
from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.job.reference import reference_run
from tests._helpers import swarm_json


def test_the_scale_follows_gradscaler_through_overflows_and_growth():
    rng = random.Random(0)
    ours = LossScale(2.0 ** 20, interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    for _ in range(60):
        found = rng.random() < 0.3
        theirs.scale(torch.ones(()))  # (GradScaler makes its scale tensor lazily)
        p.grad = torch.full((4,), float("inf") if found else 1.0)
        theirs.step(opt)  # unscales, finds the inf, skips
        theirs.update()
        ours.update(found)
        assert ours.scale == theirs.get_scale() and ours.growth_tracker == theirs._growth_tracker.item()


def test_scaling_and_unscaling_are_gradscaler_s_arithmetic():
    loss = torch.tensor(2.718281828)
    theirs = torch.amp.GradScaler("cpu", init_scale=3.0 * 2 ** 13)
    assert torch.equal(scaled(loss, 3.0 * 2 ** 13), theirs.scale(loss))
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    a.grad = torch.randn(5) * 1e4
    b.grad = a.grad.clone()
    theirs.unscale_(torch.optim.SGD([b], lr=0.1))
    unscale_([a], 3.0 * 2 ** 13)
    assert torch.equal(a.grad, b.grad)


def test_an_overflowed_tensor_leaves_as_zeros_and_is_flagged():
    t = torch.tensor([1.0, float("inf"), float("nan"), -2.0], dtype=torch.float16)
    clean, bad = sanitized(t)
    assert bad and clean.tolist() == [1.0, 0.0, 0.0, -2.0] and clean.dtype == torch.float16
    same, bad = sanitized(torch.ones(3))
    assert not bad and torch.equal(same, torch.ones(3))
    assert nonfinite([None, torch.ones(2), t]) and not nonfinite([None, torch.ones(2)])


def test_the_scale_travels_in_layer_states_and_bad_ones_are_not_taken():
    layer = torch.nn.Linear(3, 2)
    s = LossScale(2.0 ** 21, growth_tracker=17)
    header, bufs = layer_state.encode(layer_state.capture(layer, None, s.state()))
    st = layer_state.decode(header, [memoryview(bytes(b)) for b in bufs], layer_state.expected_shapes(layer))
    got = LossScale()
    assert got.load(layer_state.run_entries(st)) and (got.scale, got.growth_tracker) == (2.0 ** 21, 17)
    layer_state.apply(layer, None, st)  # the run's entries are not the layer's
    assert not LossScale().load({})
    for scale, growth in ((float("inf"), 0), (0.0, 0), (2.0 ** 10, 2.5), (2.0 ** 10, 5000)):
        assert not LossScale().load({STATE_KEYS[0]: torch.tensor(scale), STATE_KEYS[1]: torch.tensor(growth)})
    with pytest.raises(ValueError, match="loss scale"):
        JobSpec(precision="fp16", loss_scale=float("nan"))


def test_the_scale_survives_a_checkpoint_and_comes_back_with_the_layers(tmp_path):
    """What a resumed or recovered stage starts from: the scale its layers' states carry."""
    from spantrain_p2p.models.checkpoint import CheckpointDir, write_layers

    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(layer.parameters())
    s = LossScale(2.0 ** 22, growth_tracker=5)
    write_layers(str(tmp_path), "fp", "adam", 8, [(0, layer_state.capture(layer, opt, s.state()))], {"job": 1})
    st = CheckpointDir(str(tmp_path), "fp", "adam").load(0, 8, layer_state.expected_shapes(layer))
    got = LossScale()
    assert st is not None and got.load(layer_state.run_entries(st))
    assert (got.scale, got.growth_tracker) == (2.0 ** 22, 5)


@pytest.mark.heavy
def test_a_swarm_in_fp16_skips_the_steps_gradscaler_skips(tmp_path):
    """An initial scale of 2^30 overflows fp16 for the first 12 steps. 4 peers (2 stages x 2
    replicas: overflowed parts of the gradient sum too) skip every step one process with GradScaler
    skips, on every peer, end at its scale, and train as it does."""
    steps, init = 16, 2.0 ** 30
    skipped = []
    ref, _ = reference_run(JobSpec(steps=steps, precision="fp16", loss_scale=init), steps, skipped=skipped)
    out = swarm_json(tmp_path, "--steps", str(steps), "--stages", "2", "--precision", "fp16",
                     "--loss-scale", str(init))
    assert [len(s["peers"]) for s in out["plan"]["stages"]] == [2, 2]
    worst = max(abs(a - b) / b for a, b in zip(out["losses"], ref))
    print(f"\nfp16 from scale 2^30: GradScaler skipped steps {skipped}, the swarm {out['skipped_steps']}; worst "
          f"loss rel. error {worst:.2e} over {steps} steps; final scale {out['loss_scale']:g}")
    assert skipped == list(range(12)) and out["skipped_steps"] == skipped
    assert out["loss_scale"] == init / 2 ** 12
    assert len(out["losses"]) == steps and worst < 1e-4
