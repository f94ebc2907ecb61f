"""Memory levers (``pipeline.memory``): activation recomputation is exact, and what a stage keeps of
its forwards is measured as autograd keeps it."""
import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from spantrain_p2p.job import spec
from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.pipeline import memory
from spantrain_p2p.plan import levers, types

from spantrain_p2p.job.inprocess import run_pipeline
from tests._helpers import run_swarm_json

LLAMA = JobSpec(model="hf:llama-tiny", seq_len=64, micro_batch_size=4, num_micro_batches=4, steps=6, lr=1e-3)


def test_the_job_and_the_executor_know_the_same_recompute_modes():
    assert memory.RECOMPUTE == types.RECOMPUTE and spec.RECOMPUTE == levers.MODES == ("auto", *types.RECOMPUTE)
    with pytest.raises(ValueError, match="recompute"):
        types.Stage(("a",), (0, 1), recompute="half")
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
        assert sum(stash.values()) == want, mode
        assert meter.kept(want) == want
        y.sum().backward()
        meter.freed(want)
    assert meter.held == 0 and meter.peak == meter.largest == 4 * 16 * 4 + 4 * 32 * 4


def test_a_stage_measures_its_stash_on_the_first_forward_of_each_input_shape_and_counts_it_after():
    """The saved-tensor hooks (a Python call for every tensor autograd saves) run on a stage's first
    forward of an input shape; its later micro-batches of that shape are counted the same, without
    them, and a new shape is measured again: the same bytes held, step peak and gradients as
    measuring every forward."""
    from spantrain_p2p.pipeline.executor import StageExecutor, _Mb

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2)]
    ex = StageExecutor(layers, False, False, 4, None, None, None)
    calls = []
    saving = ex.meter.saving
    ex.meter.saving = lambda into: (calls.append(1), saving(into))[1]
    held = []
    for rows in (4, 4, 4, 8, 8):
        st = _Mb(inp=torch.randn(rows, 16, requires_grad=True))
        ex._forward(0, 0, st)
        held.append(st.held)
    assert len(calls) == 2  # one measured forward for each shape
    per_row = held[0] // 4
    assert held == [4 * per_row] * 3 + [8 * per_row] * 2 and per_row == (16 + 32 + 16 + 32 + 16) * 4
    # (per row: the input, each ReLU's output, the first layer's output (the second's input), the last output)
    assert ex.meter.held == sum(held)


async def test_a_spot_checks_recomputation_leaves_nothing_of_its_micro_batch_behind():
    """A replica's spot check runs a micro-batch's F and B alone (B keeps the graph for a W that never
    comes); what the meter saved for it is freed with it. The meter's hook once kept each saved tensor
    as itself, a saved output a cycle through its own grad_fn that the collector cannot break: on an
    H100 every check of a last stage leaked that micro-batch's activations (28 GB by step 11)."""
    import gc

    from spantrain_p2p.data import generated as data
    from spantrain_p2p.pipeline.executor import StageExecutor

    handle = spec.ModelHandle(LLAMA)
    n = handle.num_layers
    batch = lambda s, m: data.batch(0, s, m, LLAMA.micro_batch_size, LLAMA.seq_len)  # noqa: E731
    ex = StageExecutor(handle.build(n // 2, n), False, True, 2, batch=batch, recv=None, send=None)
    x = torch.randn(handle.boundary_shapes()[n // 2])

    def graphs() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)

    async def check(step: int) -> None:
        await ex.recompute(step, 0, x, None)
        # (the compute thread lets go of a call's arguments when it takes the next one)
        await ex.on_compute_thread(lambda: None)

    await check(0)
    before = graphs()
    for step in range(1, 4):
        await check(step)
    ex.close()
    assert graphs() == before


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


# ---- the planner's choice ------------------------------------------------------------------------
def _snapshot(n: int, memory: float):
    from spantrain_p2p.plan.types import Link, Network, PeerInfo, Snapshot

    peers = tuple(PeerInfo(f"p{i}", 1e12, memory) for i in range(n))
    return Snapshot(peers, Network({(a.id, b.id): Link(0.0, 1e12) for a in peers for b in peers if a.id != b.id}))


def _profile(layers: int = 4):
    from spantrain_p2p.plan.types import LayerProfile, ModelProfile

    # per sample: 1 MB handed on, 16 MB kept for the backward (a transformer block keeps ~17 activations)
    return ModelProfile(tuple(LayerProfile(1e12, 1e12, 1e12, 1e6, 1e6, 16e6) for _ in range(layers)))


def test_recomputation_keeps_each_layers_input_as_the_stage_holds_it_and_the_search_prices_it_alike():
    """Under autocast a block's input is the fp32 residual stream while the wire carries bf16: a stage
    that recomputes keeps the measured input of each layer (the first stage also its token ids), its
    own input as it came off the wire and its output as held (GPT-2's stage 0 on an H100 counted 1.21x
    the prediction that took every kept activation at the wire's 2 bytes). Unmeasured inputs keep the
    wire sizes, as before. The planner's fast search (``dp``) prices every cut as the layout does."""
    from dataclasses import replace

    from spantrain_p2p.plan.layout import recomputed_kept, recomputed_stash
    from spantrain_p2p.plan.types import LayerProfile, ModelProfile

    wire = [10.0, 20.0, 30.0, 40.0, 0.0]
    base = [LayerProfile(1, 1, 1, 1, activation_bytes_out=a, stash_bytes=5) for a in wire]
    unmeasured = ModelProfile(tuple(base))
    assert recomputed_stash(unmeasured, 0, 3, 2) == (2 * (10 + 20 + 30), 10)
    assert recomputed_stash(unmeasured, 2, 5, 1)[0] == 20 + 30 + 40 + 0  # input off the wire, outputs
    measured = ModelProfile(tuple(replace(x, input_bytes=v) for x, v in zip(base, (8, 20, 40, 60, 80))))
    assert recomputed_stash(measured, 0, 3, 1)[0] == 8 + 20 + 40 + 60  # ids, inputs as held, output as held
    assert recomputed_stash(measured, 2, 5, 1)[0] == 20 + 60 + 80 + 0  # its input as the wire carried it
    for prof in (unmeasured, measured):  # dp's form of the same sum, every cut at once
        kept = recomputed_kept(prof)
        for i in range(5):
            for j in range(i + 1, 6):
                assert kept[i, j] == recomputed_stash(prof, i, j, 1)[0], (i, j)


def _two_stages(schedule: str = "1f1b", recompute: str = "none"):
    from spantrain_p2p.plan.types import Plan, Stage

    return Plan((Stage(("p0",), (0, 2), (1.0,), recompute), Stage(("p1",), (2, 4), (1.0,), recompute)),
                schedule, 1, 8)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_stage_that_cannot_hold_its_activations_recomputes_and_is_priced_for_it(schedule):
    """Peers of 60 MB: two layers' state (~16 MB) and the stash of the micro-batches 1F1B holds at
    once (2 x 32 MB on the first stage) do not fit; with full recomputation (3 MB a micro-batch, one
    layer's 16 MB once) they do. ``levers.fit`` turns it on where it is short, the cost model prices
    the forward again in each backward pass (once in 1F1B's fused BW, twice in ZB-H1's B and W), and
    a peer with room enough keeps its stage as it is."""
    from spantrain_p2p.plan.cost import estimate
    from spantrain_p2p.plan.layout import LinkTable

    prof, tight, roomy = _profile(), _snapshot(2, 60e6), _snapshot(2, 1e12)
    plan = _two_stages(schedule)
    assert estimate(plan, tight, prof).bottleneck.startswith("memory:")
    fitted = levers.fit(plan, "auto", tight, prof, LinkTable(tight))
    assert fitted.stages[0].recompute == "full"
    e = estimate(fitted, tight, prof)
    assert math.isfinite(e.step_s)
    assert levers.fit(plan, "auto", roomy, prof, LinkTable(roomy)) is plan  # fits: unchanged, bit for bit
    assert levers.fit(plan, "none", tight, prof, LinkTable(tight)) is plan
    # priced: every stage recomputing, with memory to spare, against none: F + B + W of 3 s per layer and
    # micro-batch become 4 s (1F1B: 72 s against 54 s) or 5 s (ZB-H1: 82 s against 50 s, its bubble grown too)
    slow = estimate(_two_stages(schedule, "full"), roomy, prof).step_s
    fast = estimate(plan, roomy, prof).step_s
    assert slow / fast == pytest.approx({"1f1b": 72 / 54, "zb-h1": 82 / 50}[schedule], rel=1e-3)


def test_the_planner_finds_a_plan_with_recomputation_where_none_fits_without():
    from spantrain_p2p.plan.planner import plan
    from spantrain_p2p.plan.search import PlannerOptions

    prof, tight = _profile(8), _snapshot(4, 60e6)
    opts = dict(global_batch=8, micro_batch_sizes=(1,), schedules=("1f1b",))
    with pytest.raises(ValueError, match="no feasible plan"):
        plan(tight, prof, PlannerOptions(**opts, recompute="none"))
    best = plan(tight, prof, PlannerOptions(**opts)).plan
    assert math.isfinite(best.step_s) and any(st.recompute == "full" for st in best.stages)
    roomy = plan(_snapshot(4, 1e12), prof, PlannerOptions(**opts)).plan
    assert all(st.recompute == "none" for st in roomy.stages)


@pytest.mark.heavy
def test_peers_too_small_for_the_activations_train_with_the_planners_recomputation(tmp_path):
    """peers/tight-memory.toml: 2 peers of 12 MB; the tiny Llama at 8 x 128 tokens needs ~18 MB a
    peer as it is (so ``--recompute none`` finds no plan, ``test_the_planner_finds...``). The planner
    turns recomputation on, the map says so, every peer recomputes, holds less than its device's
    memory as measured, and within 10 % of what the planner predicted for it."""
    import json
    run = tmp_path / "run"
    summary = run_swarm_json("--scenario", "peers/tight-memory.toml", "--model", "hf:llama-tiny", "--seq-len", "128",
                             "--micro-batch-size", "8", "--steps", "6", "--seed", "1", "--run-dir", str(run))
    assert summary["steps"] == 6 and summary["lost_steps"] == 0
    stages = summary["plans"][-1]["stages"]
    assert any(st["recompute"] == "full" for st in stages), stages  # (a stage that fits as it is may stay so)
    lever = {p: st["recompute"] for st in stages for p in st["peers"]}
    device_bytes = 0.0112 * 2**30
    for path in sorted((run / "reports").glob("*.json")):
        report = json.loads(path.read_text())
        mem = report["memory"]
        assert mem["recompute"] == lever[report["name"]]
        assert mem["measured"]["peak"] < device_bytes, (path.name, mem)
        assert 0.9 <= mem["measured_over_predicted"] <= 1.1, (path.name, mem)


# ---- 8-bit optimizer state -------------------------------------------------------------------------
def _whole_model(job: JobSpec):
    """The job's model in one piece, and its optimizer."""
    from spantrain_p2p.job.optim import make_optimizer
    from spantrain_p2p.job.spec import ModelHandle

    handle = ModelHandle(job)
    layers = handle.build(0, handle.num_layers)
    return layers, make_optimizer(job, [p for layer in layers for p in layer.parameters()])


def _train_step(job: JobSpec, layers, opt, step: int) -> float:
    """One step on micro-batch 0 of ``step`` (the generated corpus): its loss."""
    from spantrain_p2p.data import generated as data

    x, y = data.batch(job.seed, step, 0, job.micro_batch_size, job.seq_len)
    for layer in layers[:-1]:
        x = layer(x)
    loss = layers[-1](x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


@pytest.mark.heavy
def test_8bit_adam_keeps_a_quarter_of_the_state_trains_like_adam_and_survives_a_snapshot():
    """torchao's Adam8bit on the built-in model: its state measured as the tensors hold it (codes and
    block scales) is under 30 % of Adam's; 30 steps land within 2 % of Adam's loss; and a layer state
    captured (dequantized, as snapshots and checkpoints keep it) and applied to a fresh optimizer is
    quantized again: the steps after it stay within 1e-3 of those without the round trip (quantizing
    the dequantized values again need not give the same codes)."""
    from spantrain_p2p.job.reference import reference_run
    from spantrain_p2p.models import state as layer_state
    from spantrain_p2p.train.memory_use import held_state

    job = JobSpec(model_args={"dim": 128, "depth": 2, "heads": 4}, seq_len=32, micro_batch_size=4,
                  num_micro_batches=2, steps=30, lr=3e-3)
    job8 = replace(job, optimizer="adam8bit")
    adam, _ = reference_run(job, 30)
    low, _ = reference_run(job8, 30)
    assert abs(sum(low[-5:]) / sum(adam[-5:]) - 1) < 0.02, (adam[-5:], low[-5:])

    def build():
        return _whole_model(job8)

    def step(layers, opt, s):
        return _train_step(job8, layers, opt, s)

    layers, opt = build()
    for s in range(3):
        step(layers, opt, s)
    params = [p for layer in layers for p in layer.parameters()]
    kept = held_state(params, opt)
    assert kept["optimizer"] < 0.3 * 2 * kept["weights"]  # Adam's: 2 fp32 moments a parameter
    saved = [layer_state.capture(layer, opt) for layer in layers]
    after = [step(layers, opt, s) for s in (3, 4)]
    layers2, opt2 = build()
    for layer, st in zip(layers2, saved):
        layer_state.apply(layer, opt2, st)
    assert type(next(iter(opt2.state.values()))["exp_avg"]).__name__ in ("OptimState8bit", "Tensor")
    assert any(type(s["exp_avg"]).__name__ == "OptimState8bit" for s in opt2.state.values())
    again = [step(layers2, opt2, s) for s in (3, 4)]
    assert again[0] == after[0] and abs(again[1] / after[1] - 1) < 1e-3, (again, after)  # quantized anew: close, not exact


# ---- optimizer state on the host ---------------------------------------------------------------------
def test_an_offloaded_optimizer_steps_on_the_host_equals_adam_and_resumes_from_a_snapshot():
    """``--offload-optimizer``: the losses equal Adam's on the device to the last bit (the same
    arithmetic on copies); the state lives beside the host masters, not in the device's count; each
    step moves weights and gradients to the host and weights back; a layer state captured through it
    (snapshots, checkpoints) and applied to a fresh offloaded optimizer resumes exactly."""
    from spantrain_p2p.job.offload import HostOffloaded
    from spantrain_p2p.job.reference import reference_run
    from spantrain_p2p.models import state as layer_state
    from spantrain_p2p.train.memory_use import held_state

    job = JobSpec(model_args={"dim": 64, "depth": 2, "heads": 2}, seq_len=16, micro_batch_size=2,
                  num_micro_batches=2, steps=8, lr=3e-3)
    off = replace(job, offload_optimizer=True)
    assert reference_run(off, 8)[0] == reference_run(job, 8)[0]

    def build():
        return _whole_model(off)

    def step(layers, opt, s):
        return _train_step(off, layers, opt, s)

    layers, opt = build()
    assert isinstance(opt, HostOffloaded)
    for s in range(3):
        step(layers, opt, s)
    params = [p for layer in layers for p in layer.parameters()]
    weight_bytes = sum(p.numel() * 4 for p in params)
    assert opt.copied_bytes == 3 * weight_bytes  # weights and gradients down, weights up
    assert all(m.device.type == "cpu" and m is not p for p, m in opt.master.items())
    assert all(v.data_ptr() not in {p.data_ptr() for p in params}
               for st in opt.inner.state.values() for v in st.values() if v.dim())
    held = held_state(params, opt)
    assert held["optimizer"] == 0 and held["host"] >= 3 * weight_bytes  # masters and 2 Adam moments
    saved = [layer_state.capture(layer, opt) for layer in layers]
    assert any(n.endswith(":exp_avg") for n, _ in saved[1])
    after = [step(layers, opt, s) for s in (3, 4)]
    layers2, opt2 = build()
    for layer, st in zip(layers2, saved):
        layer_state.apply(layer, opt2, st)
    assert [step(layers2, opt2, s) for s in (3, 4)] == after


def test_offloading_is_priced_by_its_copies_and_host_step():
    """Two stages of 2 layers of 1 MB of weights: offloaded Adam adds, after the stage's last backward,
    3 MB of copies at the peer's host rate and the host step; it is the step's tail, named as such."""
    from dataclasses import replace as rep

    from spantrain_p2p.plan.cost import estimate

    prof, snap = _profile(), _snapshot(2, 1e12)
    plan = _two_stages()
    base = estimate(plan, snap, prof).step_s
    off = rep(prof, optimizer_bytes_per_param_byte=0.0, host_copy_bytes_per_param_byte=3.0,
              host_step_s_per_param_byte=1e-6)
    slow = rep(snap, peers=tuple(rep(p, host_bytes_per_s=1e3) for p in snap.peers))  # 3 MB at 1 kB/s: 6,000 s
    e = estimate(plan, slow, off)
    assert e.step_s == pytest.approx(base + 2e6 * (3.0 / 1e3 + 1e-6), rel=1e-6)
    assert e.bottleneck == "offload:stage 0"  # (stage 0 runs the pipeline's last backward)
    # a peer that measured its host's step (its profile's ``host_step_s_per_param_byte``) is priced at
    # its own rate, not the optimizer's: p0's host, 2 ms a byte (the peers' other rates are as slow)
    timed = rep(slow, peers=(rep(slow.peers[0], host_step_s_per_param_byte=2e-3), slow.peers[1]))
    assert estimate(plan, timed, off).step_s == pytest.approx(base + 2e6 * (3.0 / 1e3 + 2e-3), rel=1e-6)


def test_the_planner_charges_each_peers_copies_at_the_rate_it_published():
    """A profile's ``host_bytes_per_s`` (measured where the job offloads) is the peer's rate in the
    planner's snapshot; a profile without it (a job that does not offload, an older peer) gets the
    default."""
    from spantrain_p2p.plan.types import HOST_BYTES_PER_S
    from spantrain_p2p.train.planning import snapshot

    base = {"effective_tflops": 1.0, "memory_bytes": 8 << 30}
    snap = snapshot({"a": {"profile": {**base, "host_bytes_per_s": 2e9}}, "b": {"profile": base}}, {}, ["a", "b"])
    assert (snap.peer("a").host_bytes_per_s, snap.peer("b").host_bytes_per_s) == (2e9, HOST_BYTES_PER_S)


@pytest.mark.heavy
def test_peers_of_an_offloading_job_time_their_hosts_optimizer_step_and_publish_it(tmp_path):
    """``--offload-optimizer``: each peer times the optimizer's step on its host CPU and publishes it
    with its profile (``host_step_s_per_param_byte``), which the planner prices the offloaded step at
    (``test_offloading_is_priced_by_its_copies_and_host_step``); on a CPU device the host is the
    device, so it is the device's own step tail. And the rate of the offload's copies
    (``host_bytes_per_s``), which the planner charges them at."""
    import json

    from tests._helpers import run_swarm_json

    summary = run_swarm_json("--scenario", "peers/lan-4.toml", "--steps", "3", "--offload-optimizer",
                             "--run-dir", str(tmp_path))
    assert summary["steps"] == 3 and summary["lost_steps"] == 0
    measured = sorted((tmp_path / "measurements").glob("*.json"))
    assert len(measured) == 4
    for path in measured:
        prof = json.loads(path.read_text())["profile"]
        assert 0 < prof["host_step_s_per_param_byte"] == prof["step_s_per_param_byte"], (path.name, prof)
        assert prof["host_bytes_per_s"] > 0, (path.name, prof)  # measured (its rate is checked alone: test_profiler)


@pytest.mark.parametrize("mode", ["none", "full"])
async def test_a_recomputing_stage_still_answers_the_verifiers_recomputation(mode):
    """The executor's ``recompute`` (verified computation, ``train.verifier``) is a method whatever the
    stage's lever (an attribute of the same name once shadowed it: every check failed with a
    TypeError), and under full recomputation it sends what the stage sends. What the check keeps is
    not counted as the stage's stash (a check beside a step once doubled a replica's measured peak)."""
    from spantrain_p2p.data import generated as data
    from spantrain_p2p.job.spec import ModelHandle
    from spantrain_p2p.pipeline.executor import StageExecutor

    job = JobSpec(model_args={"dim": 32, "depth": 2, "heads": 2}, seq_len=16, micro_batch_size=2)

    async def nothing(*args):
        raise AssertionError("no message expected")

    batch = lambda s, m: data.batch(job.seed, s, m, job.micro_batch_size, job.seq_len)  # noqa: E731
    ex = StageExecutor(ModelHandle(job).build(0, 2), True, False, 1, batch, nothing, nothing, recompute=mode)
    out = await ex.recompute(0, 0, None, None)
    x, _ = batch(0, 0)
    layers = ModelHandle(job).build(0, 2)
    want = layers[1](layers[0](x))
    assert torch.equal(out["send/act"], want.detach()) and ex.meter.held == 0 and ex.meter.peak == 0
    ex.close()


def test_a_proxys_bytes_are_not_set_against_the_workloads_prediction():
    """A workload run's peers hold a small proxy of the model the planner predicted for (Llama-7B's
    8.6 GB against the proxy's 2.4 MB gave 0.0003): the report keeps both and gives no ratio."""
    from spantrain_p2p.train import memory_use

    state = {"weights": 4, "grads": 4, "optimizer": 8, "state": 16}
    predicted = {"state": 16.0, "stash": 4.0, "peak": 20.0}
    assert memory_use.report(state, 4, predicted, "none")["measured_over_predicted"] == 1.0
    proxied = memory_use.report(state, 4, predicted, "none", proxy=True)
    assert proxied["proxy"] is True and "measured_over_predicted" not in proxied and proxied["predicted"] == predicted
