"""A peer's stage for one epoch of the stage map: its layers, routes, the messages it takes, its
executor and optimizer, its layers' state at the map's start step, and its actions in schedule
order (``setup_stage``, called by the trainer when it adopts a map)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..job.optim import make_optimizer
from ..models import workload
from ..models.precision import COMPUTE_DTYPES, WIRE_DTYPES
from ..pipeline import schedule as sched
from ..pipeline.assignment import peer_actions
from ..pipeline.executor import StageExecutor
from ..pipeline.loss_scale import LossScale
from ..pipeline.memory import layer_stashes
from ..pipeline.messages import ACT, AMP, GRAD, GSUM, WGAT, Expect
from ..profile.virtual import stage_layer_flops
from ..robust.gate import SHARED
from . import memory_use, overflow, report as run_report, shard
from .gradsum import layer_buckets
from .lane_hops import unsuited

log = logging.getLogger("spantrain.train")


@dataclass
class Stage:
    """What one epoch's stage runs with."""

    layers: list
    first: int
    last: int
    executor: StageExecutor
    opt: torch.optim.Optimizer
    actions: list
    params: list
    buckets: list
    replicas: tuple[str, ...]
    is_last: bool
    scale: Optional[LossScale] = None  # fp16's loss scale (the same on every peer)
    weights: Optional[dict] = None  # replica -> its micro-batches of a step (the robust sum's weights)
    k: int = 0  # the stage's index in the (island's) map
    assignments: Optional[list] = None  # per stage, the peer of each micro-batch
    shapes: Optional[list] = None  # the model's boundary shapes (ModelHandle.boundary_shapes)
    wire: str = "float32"  # the dtype activations and their gradients cross in
    sharding: Optional[shard.Sharding] = None  # its optimizer state sharded across the replicas (ZeRO-1)


async def setup_stage(tr) -> Stage:
    """Builds this epoch's stage: its layers, routes, the messages it takes, the executor and
    optimizer, its layers' state at the map's start step, and its actions in schedule order."""
    job, smap, k = tr.job, tr.smap, tr.stage
    me = tr.peer.peer_id
    first, last = smap.stages[k].layers
    n, M = smap.num_stages, tr._micro_batches()
    shapes = tr.handle.boundary_shapes()
    layers = await asyncio.to_thread(  # off the loop, as the profile's model (measuring.run)
        lambda: [layer.to(tr.torch_device) for layer in tr.handle.build(first, last)])
    prev = smap.stages[k - 1] if k > 0 else None
    nxt = smap.stages[k + 1] if k < n - 1 else None
    tr.transport.route({ACT: nxt.assign(M) if nxt else [], GRAD: prev.assign(M) if prev else []})
    replicas = smap.stages[k].peers
    expect = {}
    wire = WIRE_DTYPES[job.precision]  # activations and their gradients cross in the compute dtype
    if prev:
        expect[ACT] = Expect(ACT, job.job_id, smap.epoch, frozenset(prev.peers), shapes[first], M, dtype=wire)
    if nxt:
        expect[GRAD] = Expect(GRAD, job.job_id, smap.epoch, frozenset(nxt.peers), shapes[last], M, dtype=wire)
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    buckets = []
    sharding = shard.setup(smap, k, me, layers)
    if len(replicas) > 1:
        buckets = layer_buckets([[p.numel() for p in layer.parameters() if p.requires_grad] for layer in layers],
                                owners=sharding.param_owner if sharding else None)
        sizes = [(sum(n for _, n in b),) for _, b in buckets]
        if tr.defence.gate is not None and sizes:  # the gate's medians ride on the last bucket
            sizes[-1] = (sizes[-1][0] + SHARED,)
        sizes += [(2,)] if nxt is None else []
        tr.transport.bucket_layers = [first + layer for layer, _ in buckets]
        expect[GSUM] = Expect(GSUM, job.job_id, smap.epoch, frozenset(replicas) - {me}, (),
                              len(sizes), shapes_by_mb=tuple(sizes))
    tr.recompute = smap.stages[k].recompute  # (the coordinator marks every stage for --recompute full)
    sample = tgt = None  # one micro-batch through the stage's layers: their FLOPs, what one keeps
    if tr.recompute == "full" or (tr.peer.device is not None and not job.workload):
        await tr.data_share.ensure(0, [0])
        ids, tgt = tr.data.batch(0, 0)
        sample = (ids if k == 0 else torch.randn(shapes[first], generator=torch.Generator().manual_seed(k))
                  ).to(tr.torch_device)  # (not the process's generator: local peers build layers with it)
        tgt = tgt.to(tr.torch_device) if k == n - 1 else None
    layer_flops = None
    if tr.peer.device is not None and job.workload:  # pad to the workload's FLOPs
        layer_flops = workload.layer_flops(job, first, last)
    elif tr.peer.device is not None:
        layer_flops = await asyncio.to_thread(stage_layer_flops, layers, sample, tgt)
    schedule = smap.schedule or sched.resolve_schedule(job.schedule)
    if tr.recompute == "full" and layer_flops is not None:  # a virtual device runs the forward again too
        layer_flops = memory_use.recomputed_flops(layer_flops, split=schedule == "zb-h1")
    tr.memory_state, tr.stash_peak_bytes, tr.recompute_transient = None, 0, 0
    tr.memory_predicted = await asyncio.to_thread(memory_use.predicted, job, smap, me)
    if tr.recompute == "full":  # what the layer being recomputed holds meanwhile, measured once
        tr.recompute_transient = max(await asyncio.to_thread(
            layer_stashes, layers, sample, tgt, COMPUTE_DTYPES.get(job.precision)))
    executor = StageExecutor(layers, k == 0, k == n - 1, M, batch=tr._batch, recv=tr.transport.recv,
                             send=tr.defence.sender(tr.transport.send, tr.opts.byzantine), device=tr.peer.device,
                             layer_flops=layer_flops, compute_dtype=COMPUTE_DTYPES.get(job.precision),
                             recompute=tr.recompute, arrived=tr.transport.arrived)
    if tr.transport.lanes is not None:
        why_not = unsuited(tr, executor, scaled=job.precision == "fp16")
        if why_not is None:
            executor.hops = tr.transport.lanes
        elif smap.epoch not in tr.lanes_refused:
            tr.lanes_refused.add(smap.epoch)
            log.info("--lanes: stage map epoch %d runs through the event loop: %s", smap.epoch, why_not)
    if sharding is not None:
        sharding.use(buckets)
        expect[WGAT] = sharding.expect(job.job_id, smap.epoch)
    opt = make_optimizer(job, sharding.owned_params(executor.params) if sharding else executor.params)
    # what a virtual device's memory holds besides activations: predicted until the first step measures it
    executor.state_bytes = int((tr.memory_predicted or {}).get("state")
                               or 4 * sum(p.numel() * p.element_size() for p in executor.params))
    # islands start from their outer state (``_train_rounds``): the layers are built fresh here
    run = await tr.recovery.load(layers, opt, first, smap.start_step if tr.island is None else 0,
                                   sharding.foreign if sharding else None)
    scale = None
    if job.precision == "fp16":
        expect[AMP] = overflow.expect(job.job_id, smap, me)
        scale = LossScale(job.loss_scale)
        if not scale.load(run) and smap.start_step > 0:
            log.warning("the layer states of step %d carry no loss scale: starting again from %g",
                        smap.start_step, job.loss_scale)
        tr.loss_scale = scale.scale
    assignments = [st.assign(M) for st in smap.stages]
    actions = peer_actions(assignments, schedule).get((k, me), [])  # this peer's micro-batches, in order
    tr.transport.open(expect)
    if tr.transport.lanes is not None:  # (it takes lanes from now on)
        tr.transport.lanes.enabled = executor.hops is not None
    tr.work = run_report.stage_work(job, first, last, actions)
    weights = {p: float(assignments[k].count(p)) for p in replicas} if job.aggregate == "robust" else None
    return Stage(layers, first, last, executor, opt, actions, params, buckets, replicas, nxt is None, scale,
                  weights, k, assignments, shapes, wire, sharding)
