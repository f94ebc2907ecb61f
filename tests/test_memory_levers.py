"""Memory levers (``pipeline.memory``): activation recomputation is exact, and what a stage keeps of
its forwards is measured as autograd keeps it."""
from dataclasses import replace

import pytest
import torch
from torch import nn

from spantrain_p2p.job import spec
from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.pipeline import memory

from spantrain_p2p.job.inprocess import run_pipeline

LLAMA = JobSpec(model="hf:llama-tiny", seq_len=64, micro_batch_size=4, num_micro_batches=4, steps=6, lr=1e-3)


def test_the_job_and_the_executor_know_the_same_recompute_modes():
    assert spec.RECOMPUTE == memory.RECOMPUTE
    with pytest.raises(ValueError, match="recompute"):
        JobSpec(recompute="some")
    with pytest.raises(ValueError, match="recompute"):
        memory.layer_call("selective")


def test_the_meter_counts_each_saved_storage_once_and_leaves_the_weights_out():
    """Linear, ReLU, Linear: the first Linear keeps its input (4 x 16 floats), the ReLU its output,
    which the second Linear keeps too (4 x 32 floats, one storage); the weights are not counted. Under
    full recomputation the checkpoint keeps the input alone."""
    layer = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    meter = memory.StashMeter(list(layer.parameters()))
    x = torch.randn(4, 16, requires_grad=True)
    for mode, want in (("none", 4 * 16 * 4 + 4 * 32 * 4), ("full", 4 * 16 * 4)):
        stash: dict = {}
        with meter.saving(stash):
            y = memory.layer_call(mode)(layer, x)
        assert meter.kept(stash) == want, mode
        y.sum().backward()
        meter.freed(want)
    assert meter.held == 0 and meter.peak == meter.largest == 4 * 16 * 4 + 4 * 32 * 4


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
async def test_full_recomputation_trains_bit_identically_on_a_fraction_of_the_activations(schedule):
    """Tiny Llama, 2 stages x 2 replicas: fp32 losses equal to the last bit with and without full
    recomputation, and every peer's most activation bytes held at once down by more than 60 %."""
    job = replace(LLAMA, schedule=schedule)
    kept, recomputed = {}, {}
    base, _ = await run_pipeline(job, 2, 6, widths=[2, 2], stash=kept)
    losses, _ = await run_pipeline(job, 2, 6, widths=[2, 2], recompute="full", stash=recomputed)
    assert losses == base
    assert kept.keys() == recomputed.keys()
    for peer, (peak, _) in kept.items():
        assert recomputed[peer][0] <= 0.4 * peak, (peer, recomputed[peer][0], peak)
