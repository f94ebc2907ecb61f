"""From the swarm's measurements to a stage map: the glue between the live swarm and the planner.

Pure functions: the trainer reads profiles and probes from the DHT, these turn them into the
planner's snapshot, run the planner (or a baseline) for the job, and turn the plan into the stage
map the peers follow.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from typing import Mapping, Optional

from ..pipeline.schedule import AUTO, SCHEDULE_NAMES, resolve_schedule
from ..plan import types as pt
from ..plan.stagemap import StageMap
from ..job.spec import BUILTIN, JobSpec, ModelHandle, is_hf
from .decide import choose_buddy
from ..models.precision import wire_dtype_bytes


def snapshot(profiles: Mapping[str, dict], links: Mapping[str, dict], peer_ids: list[str],
             memory_caps: Optional[Mapping[str, int]] = None) -> pt.Snapshot:
    """Snapshot of ``peer_ids`` in real time units: a peer's FLOP/s is what it measured on itself
    (its virtual device's real speed when emulating); links are the measured ones (unknown if none);
    its memory is its profile's, or less where it ran out under a plan (``memory_caps``)."""
    ids, caps = [p for p in peer_ids if p in profiles], memory_caps or {}
    devices = [{"peer": p, "tflops": profiles[p]["profile"]["effective_tflops"],
                "memory_gb": min(profiles[p]["profile"]["memory_bytes"], caps.get(p, math.inf)) / 2**30,
                "step_s_per_param_byte": profiles[p]["profile"].get("step_s_per_param_byte", 0.0),
                "host_step_s_per_param_byte": profiles[p]["profile"].get("host_step_s_per_param_byte", 0.0),
                "host_bytes_per_s": profiles[p]["profile"].get("host_bytes_per_s", 0.0)}
               for p in ids]
    rows = []
    for src in ids:
        for dst, m in (links.get(src) or {}).items():
            if dst in ids and dst != src:
                rows.append({"src": src, "dst": dst, "rtt_ms": m.get("rtt_ms"), "mbps": m.get("mbps"),
                             "status": m.get("status", "unknown"), "via": m.get("via", "")})
    return pt.Snapshot.from_measurements({"devices": devices, "links": charge_relays(rows)})


RELAY_SHARE = 0.5  # of a relay's uplink a relayed pair gets: the relay sends its own bytes on it too


def charge_relays(rows: list[dict]) -> list[dict]:
    """Link rows with the relayed pairs priced for their path (and ``via`` dropped): a relayed pair's
    bytes cross the relay's downlink and then its uplink, which carries the relay's own sends as well,
    so the pair gets ``RELAY_SHARE`` of the slowest of its own measured bandwidth and its two legs'
    (src to relay, relay to dst). The planner then keeps heavy traffic off relayed pairs unless nothing
    else is as fast."""
    mbps = {(r["src"], r["dst"]): r["mbps"] for r in rows if isinstance(r.get("mbps"), (int, float)) and r["mbps"] > 0}
    out = []
    for r in rows:
        r = dict(r)
        via = r.pop("via", "")
        if via and (r["src"], r["dst"]) in mbps:
            legs = [mbps.get((r["src"], via)), mbps.get((via, r["dst"]))]
            r["mbps"] = min([r["mbps"], *[x for x in legs if x]]) * RELAY_SHARE
        out.append(r)
    return out


def model_profile(job: JobSpec) -> Optional[pt.ModelProfile]:
    """The job's model as the planner sees it: its workload's, if it has one (``models.workload``);
    None for a user model (no FLOP model of it yet). Counting a transformers model builds it on the
    meta device (a second for GPT-2), so the answer is kept per job: the trainer asks first, off the
    event loop, and the planner and the status pages find it ready. What a layer keeps for its
    backward is measured on ``STASH_DEVICE`` (``measure_stash_on``)."""
    key = json.dumps(job.to_dict(), sort_keys=True)
    prof = _model_profile(key, STASH_DEVICE)
    _LAST[0] = (key, STASH_DEVICE, prof)
    return prof


_LAST: list = [None]  # (job, stash device, profile) of the last ``model_profile`` answered


def known_model_profile(job: JobSpec) -> Optional[pt.ModelProfile]:
    """The job's profile where this process has it already, else None: never computed here (for a
    page, which must not hold the event loop while a transformers model is built)."""
    last = _LAST[0]
    if last is None or last[1] != STASH_DEVICE or last[0] != json.dumps(job.to_dict(), sort_keys=True):
        return None
    return last[2]


# where this process measures what layers keep (``measured_stash``): the device its layers train on,
# set by the trainer. Autocast and attention keep other tensors on a GPU than on the CPU: GPT-2 in
# bf16 kept 1.39x on an H100 what the CPU's measurement predicted (scripts/gpu_check.py, 2026-11-26)
STASH_DEVICE = "cpu"


def measure_stash_on(device) -> None:
    """Measure layers' stashes on ``device`` (a ``torch.device`` or its name) from now on."""
    global STASH_DEVICE
    STASH_DEVICE = str(device)


@functools.lru_cache(maxsize=4)
def _model_profile(job_json: str, stash_device: str = "cpu") -> Optional[pt.ModelProfile]:
    job = JobSpec.from_dict(json.loads(job_json))
    prof = _model_profile_of(job, stash_device)
    if prof is None:
        return None
    if job.offload_optimizer:  # the optimizer's state in host memory: none of it on the device, copies each step
        return replace(prof, optimizer_bytes_per_param_byte=0.0, host_copy_bytes_per_param_byte=3.0,
                       host_step_s_per_param_byte=HOST_STEP_S_PER_PARAM_BYTE.get(job.optimizer, 0.0))
    return replace(prof, optimizer_bytes_per_param_byte=OPTIMIZER_STATE[job.optimizer])


# optimizer state per byte of fp32 weights: Adam two fp32 moments; 8-bit Adam two 1-byte codes and a fp32
# scale per 256 values each (tensors under 4,096 values stay fp32: not counted); SGD without momentum none
OPTIMIZER_STATE = {"adam": 2.0, "adam8bit": 2 * (1 + 4 / 256) / 4, "sgd": 0.0}
# an optimizer's step on a host CPU core, seconds per byte of fp32 weights. Adam: torch's fused kernel,
# what an offloaded optimizer steps with (``job.optim.adam_kernel``), on one core of this box 0.14 ns a
# byte in tensors of 1-4 M values and 0.36 in the built-in model's small ones, where ``foreach`` took
# 0.46 and 1.08 (``scripts/optimizer_step.py [--model-args '{"dim": 1024, "depth": 4}']``, 2026-12-01
# 10:41 UTC). 8-bit Adam (torchao's compiled step): 7.4-7.9 ns a byte at dims 256-1024, 23 in the
# built-in model's small tensors (``--adam8bit``, 10:42-10:43; it was priced at 3.5, a guess of 5x
# foreach's rate). SGD (torch's, no momentum, as ``--optimizer sgd``): 0.067-0.111 ns a byte in the large
# tensors and 0.15-0.26 in the small ones, against fused Adam's 0.17-0.30 and 0.33-0.54 in the same runs
# (three each, 2026-12-02 07:02-07:03 UTC): priced like Adam, about twice its large-tensor rate (it was a
# guess of 0.1)
HOST_STEP_S_PER_PARAM_BYTE = {"adam": 0.3e-9, "adam8bit": 8e-9, "sgd": 0.2e-9}


def _model_profile_of(job: JobSpec, stash_device: str = "cpu") -> Optional[pt.ModelProfile]:
    if job.workload:
        from ..models import workload

        return workload.profile(job)
    if is_hf(job.model):
        from ..models.hf_profile import hf_model_profile

        prof = hf_model_profile(ModelHandle(job).hf, job.seq_len, wire_dtype_bytes=wire_dtype_bytes(job.precision),
                                stash_dtype_bytes=wire_dtype_bytes(job.precision))  # fp32 keeps 4-byte activations
    elif job.model != BUILTIN:
        return None
    else:
        prof = pt.ModelProfile.from_model_config(ModelHandle(job)._config())
    return measured_stash(job, prof, stash_device)


MEASURE_STASH_MAX_BYTES = 512 << 20  # the layers built to measure what they keep: at most this many weight bytes


def measured_stash(job: JobSpec, prof: pt.ModelProfile, device: str = "cpu") -> pt.ModelProfile:
    """``prof`` with each layer's stash as measured (``pipeline.memory.saved_bytes``): the first
    layer, one block (every block of these models is alike) and the last, built on ``device`` and run
    on one and on two samples of the job's length in its precision (what grows with the samples is
    the per-sample stash; what does not is kept once per micro-batch: autocast's copies of the
    weights); a model whose three layers' weights pass ``MEASURE_STASH_MAX_BYTES`` keeps the
    formula's figures (its own counting, ``hf_profile``)."""
    import torch

    from ..models.precision import COMPUTE_DTYPES
    from ..pipeline.memory import layer_stashes

    n = prof.num_layers
    if n < 3 or sum(prof.layers[i].param_bytes for i in (0, 1, n - 1)) > MEASURE_STASH_MAX_BYTES:
        return prof
    handle = ModelHandle(job)
    first, block = (x.to(device) for x in handle.build(0, 2))
    (last,) = (x.to(device) for x in handle.build(n - 1, n))
    dtype = COMPUTE_DTYPES.get(job.precision)

    def stashes(samples: int) -> tuple[list[float], list[float]]:
        ids = torch.zeros((samples, job.seq_len), dtype=torch.long)
        inputs: list = []
        return [float(x) for x in layer_stashes([first, block, last], ids, ids, dtype, inputs)], inputs

    (one, in_one), (two, in_two) = stashes(1), stashes(2)
    per = [y - x for x, y in zip(one, two)]  # per sample; what does not grow with it is kept per micro-batch
    fixed = [max(0.0, x - p) for x, p in zip(one, per)]
    held_in = [float(y - x) for x, y in zip(in_one, in_two)]  # each layer's input as held, per sample
    pick = [0] + [1] * (n - 2) + [2]
    return replace(prof, layers=tuple(replace(layer, stash_bytes=per[i], stash_fixed_bytes=fixed[i], input_bytes=held_in[i])
                                      for layer, i in zip(prof.layers, pick)))


def make_plan(job: JobSpec, snap: pt.Snapshot, kind: str = "planner") -> pt.Plan:
    """The plan of ``kind`` for the job: micro-batch size and count stay the job's (the data of a
    step is addressed by micro-batch, so the loss curve does not depend on the plan)."""
    from ..plan import planner as pl

    prof, opts = _planner_inputs(job)
    try:
        plan = pl.plan(snap, prof, opts).plan if kind == "planner" else pl.baseline(kind, snap, prof, opts)
    except ValueError as e:
        raise NoPlan(f"{e}; {_memory_facts(prof, snap)}") from None
    if not math.isfinite(plan.step_s):
        raise NoPlan(f"the {kind} plan cannot run: {plan.bottleneck}; {_memory_facts(prof, snap)}")
    return plan


def _planner_inputs(job: JobSpec):
    from ..compress.adaptive import plannable
    from ..plan import planner as pl

    prof = model_profile(job)
    if prof is None:
        raise ValueError("the planner needs a FLOP model of the job's model")
    schedules = SCHEDULE_NAMES if job.schedule == AUTO else (job.schedule,)
    # adaptive: every codec the live policy may send on an activation hop (it goes no lossier than
    # the plan's choice, so the plan must be able to choose its lossiest)
    comp = plannable() if job.compression == "adaptive" else ("none",)
    return prof, pl.PlannerOptions(global_batch=job.samples_per_step, micro_batch_sizes=(job.micro_batch_size,),
                                   schedules=schedules, compressions=comp, recompute=job.recompute,
                                   shard=job.shard_optimizer if job.aggregate == "sum" else "none")


def make_islands(job: JobSpec, snap: pt.Snapshot):
    """The job's islands plan (``plan.islands.IslandsPlan``) on ``snap``, or None where fewer than
    two islands can form."""
    from ..plan import islands
    from ..plan import planner as pl
    from ..plan.layout import LinkTable
    from ..swarm.grouping import group

    prof, opts = _planner_inputs(job)
    grouping = group(snap, opts.grouping)
    _mode, h = islands.parse_sync(job.sync)
    split = job.island_split  # an island's step: its share of a data step's micro-batches
    inner = replace(opts, global_batch=job.samples_per_step // split)
    fixed = job.exchange_compression
    return islands.plan_islands(snap, prof, [g.peers for g in grouping.groups], LinkTable(snap, grouping.group_of()),
                                lambda region: pl.plan(region, prof, inner, regions=False).plan, fixed_steps=h,
                                codecs=islands.EXCHANGE_CODECS if fixed == "auto" else (fixed,), split=split)


def make_sync_plan(job: JobSpec, snap: pt.Snapshot, kind: str = "planner"):
    """(the plan to run: a ``Plan`` or an ``IslandsPlan``, why) for the job's ``--sync``: the global
    plan of ``kind``, islands, or (auto) the one predicted faster."""
    from ..plan import islands

    mode, _h = islands.parse_sync(job.sync)
    if mode == "global" or kind != "planner":
        return make_plan(job, snap, kind), ""
    try:
        glob = make_plan(job, snap, kind)
    except NoPlan:
        if mode == "auto":
            raise
        glob = None
    isl = make_islands(job, snap)
    try:
        choice, why = islands.choose(glob, isl, mode)
    except ValueError as e:
        raise NoPlan(str(e)) from None
    return (isl if choice == "islands" else glob), why


def islands_stage_map(ip, job: JobSpec, epoch: int, names: Mapping[str, str], term: int = 0, start_step: int = 0,
                      why: str = "") -> StageMap:
    """The stage map of an ``IslandsPlan``: every island's stages in turn, each island's schedule,
    codecs, steps per round and predicted step. Its ``predicted_step_s`` is the round's time per
    step of data (all islands' steps together), so samples/s read from it as from a global map's."""
    from ..plan.stagemap import Island

    maps = [to_stage_map(p, job, epoch, names, term, start_step) for p in ip.islands]
    isl = tuple(Island(m.num_stages, h, m.schedule, m.compression, m.predicted_step_s)
                for m, h in zip(maps, ip.steps_per_round))
    bottleneck = f"islands: round {ip.round_s:.3g}s, exchange {ip.exchange_s:.3g}s ({ip.hidden:.0%} hidden), {ip.codec}"
    return StageMap(epoch, job.job_id, tuple(st for m in maps for st in m.stages), start_step,
                    tuple(x for m in maps for x in m.names), schedule=maps[0].schedule, term=term,
                    predicted_step_s=float(ip.round_s / sum(ip.steps_per_round)), bottleneck=bottleneck[:200], islands=isl,
                    exchange_codec=ip.codec, sync_reason=why[:300])


class NoPlan(ValueError):
    """No plan can run the job on these peers (the message says why, with the figures)."""


def _memory_facts(prof: pt.ModelProfile, snap: pt.Snapshot) -> str:
    need = 4 * sum(x.param_bytes for x in prof.layers)  # weights, gradients, Adam's two moments
    mems = [p.memory_bytes for p in snap.peers]
    return (f"the model's weights, gradients and optimizer state take {need / 2**20:.1f} MiB before any "
            f"activations; the {len(mems)} peers have {sum(mems) / 2**20:.1f} MiB in all, "
            f"{max(mems, default=0) / 2**20:.1f} MiB at most on one")


def to_stage_map(plan: pt.Plan, job: JobSpec, epoch: int, names: Mapping[str, str], term: int = 0,
                 start_step: int = 0) -> StageMap:
    used = [p for s in plan.stages for p in s.peers]
    bottleneck = plan.bottleneck
    for p in used:  # "link:ID->ID" as people read it: "link:eu-1->us-2"
        if names.get(p):
            bottleneck = bottleneck.replace(p, names[p])
    return StageMap(epoch, job.job_id, plan.stages, start_step, tuple((p, names.get(p, "")) for p in used),
                    schedule=plan.schedule, term=term, predicted_step_s=float(plan.step_s),
                    bottleneck=bottleneck[:200], compression=tuple(plan.compression))


def buddy_copies(smap: StageMap, job: JobSpec, snap: pt.Snapshot) -> list[tuple[float, float]]:
    """Per stage whose layers go to a buddy (one peer, or sharded): (bytes of its layers' state,
    bytes/s of its slowest peer's link to its nearest other peer of the map, by RTT as the peers
    choose their buddies); what ``decide.copy_every`` weighs. Empty where the job has no model
    profile; a stage with no measured link from its peers is left out."""
    prof = model_profile(job)
    if prof is None:
        return []
    per = 1.0 + prof.optimizer_bytes_per_param_byte  # weights and optimizer state
    out = []
    for k, st in enumerate(smap.stages):
        bws = []
        for p in st.peers:  # the buddy each peer picks itself, on the measured RTTs
            buddy = choose_buddy(smap, k, p, lambda q, p=p: getattr(snap.network.link(p, q), "rtt_s", math.inf))
            link = snap.network.link(p, buddy) if buddy is not None else None  # None: a replica holds them
            if link is not None:
                bws.append(link.bandwidth)
        if bws:
            nbytes = per * sum(prof.layers[i].param_bytes for i in range(*st.layers) if i < len(prof.layers))
            out.append((nbytes, min(bws)))
    return out


def current_cost(smap: StageMap, job: JobSpec, snap: pt.Snapshot) -> float:
    """The cost model's step time of the stage map in force, on a (newer) snapshot (inf if it
    uses a peer the snapshot lacks)."""
    from ..plan.cost import estimate

    prof = model_profile(job)
    known = {p.id for p in snap.peers}
    if prof is None or any(p not in known for st in smap.stages for p in st.peers):
        return float("inf")
    stages = tuple(replace(st, shares=tuple(st.share_of().values())) for st in smap.stages)  # fractions
    # at the codecs the map was planned with (without them, a compressed plan's hops look raw)
    plan = pt.Plan(stages, smap.schedule or resolve_schedule(job.schedule), job.micro_batch_size,
                   job.num_micro_batches, compression=smap.compression)
    return float(estimate(plan, snap, prof).step_s)
