"""A peer's part in training: adopt the job, agree on the stage map, run its stage step by step.

There is no coordinator. The peer that starts the swarm publishes the job in the DHT; every peer
checks it can run it, measures its device and its links (published in the DHT) and says so
(state ``ready``). Every peer computes the region groups of the same measurement snapshot and
publishes their digest; the elected planner (``swarm.election``) plans once a quorum agrees and
publishes the signed stage map; every peer adopts the newest (term, epoch) it sees. Then each
stage runs its schedule: activations and gradients go peer to peer over the data plane.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import aiohttp
import torch

from ..compress import codecs
from ..compress.adaptive import AdaptivePolicy
from ..net import framing
from ..net.dataplane import RemoteError, Retry
from ..net.framing import FrameError, check_fields
from ..pipeline import schedule as sched
from ..pipeline.deadlines import Deadlines
from ..pipeline.executor import StageExecutor, StepFailed, stage_layer_flops
from ..pipeline.peerplan import peer_actions
from ..pipeline.messages import ACT, GRAD, GSUM, Expect, Inbox, decode_tensor, encode_tensor
from ..plan.stagemap import StageMap, placeholder_map
from ..swarm.records import BadRecord, open_payload, sign_payload
from ..swarm.election import Election
from . import data, planning
from . import state as layer_state
from .job import JobRefused, JobSpec, ModelHandle, check_compatible
from .optim import make_optimizer

log = logging.getLogger("spantrain.train")

RECORD_TTL_S = 600.0
REPLAN_GAIN = 0.15  # a new plan must be predicted this much faster...
REPLAN_HOLD_S = 10.0  # ...for this long (checked every REPLAN_CHECK_S) before stages move
REPLAN_CHECK_S = 5.0
BUCKET_BYTES = 4 << 20
# Adaptive compression leaves a link's tensors as they are only where their transfer is negligible
# next to the stage's compute for one micro-batch; elsewhere it takes the fastest codec that meets
# the fidelity floor. FusionLLM's rule (compress until the transfer hides behind compute) holds in
# a pipeline's steady state, but its fill and drain wait on every hop's transfer, and with about as
# many micro-batches as stages (volunteer swarms) fill and drain are most of the step.
NEGLIGIBLE_TRANSFER = 0.1
LOSS_ROWS = 8  # recent loss rows sent along with a buddy copy
# The planner tells the peers it publishes a stage map (a "mapnews" message: a hint to read the
# DHT, which stays the only source of maps); without news a peer reads the DHT this often, since
# every read costs CPU on every peer (the DHT's lookups), much of it on machines that train.
MAP_POLL_S = 2.0
MAP_NEWS_MIN_GAP_S = 0.2  # news closer together than this wakes no one (a spamming peer included)


def layer_buckets(layer_numels: list[list[int]], bucket_bytes: int = BUCKET_BYTES) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each layer's parameters, as (layer, [(index among all the layers' parameters, numel), ...])
    buckets of at most ``bucket_bytes`` (a bigger parameter alone): one message each, sent as
    soon as that layer's gradients are final, while the backward goes on below it."""
    out: list[tuple[int, list[tuple[int, int]]]] = []
    i = 0
    for layer, numels in enumerate(layer_numels):
        cur: list[tuple[int, int]] = []
        size = 0
        for n in numels:
            if cur and size + 4 * n > bucket_bytes:
                out.append((layer, cur))
                cur, size = [], 0
            cur.append((i, n))
            size += 4 * n
            i += 1
        if cur:
            out.append((layer, cur))
    return out


class GradientSum:
    """One step's all-reduce (sum) of a stage's weight gradients among its replicas, bucket by
    bucket: a layer's buckets go to the other replicas as soon as the executor says its gradients
    are final (``layer_done``, during the step's last backward op; ``run_step`` tells every layer
    by its end), so the transfers overlap the backward of the layers below; ``finish`` adds every
    replica's part up in peer-id order (every replica ends with bit-identical gradients) and sets
    them."""

    def __init__(self, worker: "Trainer", step: int, params: list[torch.nn.Parameter],
                 buckets: list[tuple[int, list[tuple[int, int]]]], others: list[str]):
        self.worker, self.step, self.params, self.buckets, self.others = worker, step, params, buckets, others
        self.local: list[Optional[torch.Tensor]] = [None] * len(buckets)
        self.by_layer: dict[int, list[int]] = {}
        for k, (layer, _) in enumerate(buckets):
            self.by_layer.setdefault(layer, []).append(k)
        self.sends: list[asyncio.Task] = []

    def _start(self, k: int, t: torch.Tensor) -> None:
        self.local[k] = t
        self.sends += [asyncio.create_task(self.worker._send_to(dst, GSUM, self.step, k, t)) for dst in self.others]

    def layer_done(self, layer: int) -> None:
        for k in self.by_layer.get(layer, ()):
            if self.local[k] is None:
                ps = [self.params[i] for i, _ in self.buckets[k][1]]
                self._start(k, torch.cat([p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                          for p in ps]))

    async def finish(self, loss: Optional[tuple[float, int]] = None) -> Optional[tuple[float, int]]:
        """Sums the step's gradients (and, on the last stage, ``loss``: this replica's (sum, count)
        of micro-batch losses rides along, and the whole step's is returned)."""
        me = self.worker.peer.peer_id
        try:
            if loss is not None:
                self.local.append(None)
                self._start(len(self.buckets), torch.tensor([float(loss[0]), float(loss[1])], dtype=torch.float32))
            summed = []
            for k, mine in enumerate(self.local):
                parts = {me: mine}
                for src in self.others:
                    parts[src] = await self.worker._await((f"{GSUM}/{src}", self.step, k), GSUM, src)
                total = torch.zeros_like(mine)
                for src in sorted(parts):
                    total += parts[src]
                summed.append(total)
            for (_, bucket), total in zip(self.buckets, summed):
                offset = 0
                for i, n in bucket:
                    self.params[i].grad = total[offset:offset + n].view_as(self.params[i]).clone()
                    offset += n
            await asyncio.gather(*self.sends)
        except BaseException as e:
            await self.cancel()
            for p in self.params:
                p.grad = None
            if isinstance(e, asyncio.CancelledError):
                raise
            raise StepFailed(f"step {self.step}: gradient averaging with {len(self.others)} replica(s) failed: {e}") from e
        if loss is not None:
            return float(summed[-1][0]), int(round(float(summed[-1][1])))
        return None

    async def cancel(self) -> None:
        for t in self.sends:
            t.cancel()
        await asyncio.gather(*self.sends, return_exceptions=True)


MAX_MAP_BYTES = 256 << 10


def _same_layout(a: StageMap, b: StageMap) -> bool:
    """Same stages on the same peers with the same layers, micro-batch shares (to 1 %) and schedule."""
    def key(m: StageMap):
        return m.schedule, [(tuple(sorted((p, round(v, 2)) for p, v in st.share_of().items())), tuple(st.layers))
                            for st in m.stages]
    return key(a) == key(b)


def job_key(swarm: str) -> str:
    return f"spantrain/{swarm}/job"


def stagemap_key(swarm: str) -> str:
    return f"spantrain/{swarm}/stagemap"


@dataclass(frozen=True)
class TrainOptions:
    job: Optional[JobSpec] = None  # set on the peer that defines the swarm's job
    allowed_models: tuple[str, ...] = ()  # user models this peer agrees to import (its --model)
    dump_grads_dir: Optional[str] = None  # save this stage's gradients of step dump_step here
    dump_step: int = 0
    checkpoint_dir: Optional[str] = None  # where this peer writes its stage's checkpoints
    measure: bool = True  # profile the device and probe links before saying ready
    measure_only: bool = False  # stop after measuring (spantrain swarm --measure-only)
    profile_cache_dir: Optional[str] = None
    poll_s: float = 0.5


class Trainer:
    def __init__(self, peer, options: TrainOptions):
        self.peer = peer
        self.opts = options
        self.job: Optional[JobSpec] = None
        self.handle: Optional[ModelHandle] = None
        self.smap: Optional[StageMap] = None
        self.stage: Optional[int] = None
        self.step = 0  # the step being run (or next to run)
        self.steps_done = 0
        self.losses: dict[int, float] = {}  # step -> mean loss of this peer's micro-batches (last stage)
        self.loss_sums: dict[int, tuple[float, int, int]] = {}  # step -> (sum of micro-batch losses, count, epoch)
        self.held_losses: dict[int, tuple[float, int, int]] = {}  # a buddy's recent loss_sums, reported for it
        self.step_times: list[tuple[int, float, float, int]] = []  # (step, start unix, end unix, epoch)
        self.compute_s: list[float] = []
        self.error: Optional[str] = None
        self.refused: Optional[str] = None
        self.crashed = False  # the trainer died of an unexpected error (the peer then leaves)
        self.inbox = Inbox(max_pending=64)
        self._expect: dict[str, Expect] = {}
        self._route: dict[str, list[str]] = {}  # kind -> destination peer of each micro-batch
        self._replicas: tuple[str, ...] = ()  # peers of this stage (data-parallel replicas), self included
        self.finished = asyncio.Event()
        self.wire_bytes: dict[int, dict[str, int]] = {}  # step -> destination peer -> bytes sent
        self.codecs_used: dict[str, str] = {}  # "kind->destination name" -> last codec
        # activation gradients feed every earlier layer's update: no top-k for them (its error
        # feedback suits weight gradients, not these); 6-bit blocks (0.97) at most, like activations
        self._policy = AdaptivePolicy(fidelity_floors={"act": 0.95, "grad": 0.95})
        from ..net.prober import PassiveEstimator

        self.passive = PassiveEstimator()  # bytes/s of real transfers, per destination
        self._probed: dict = {}  # destination -> the probe's measurement, before any passive update
        self._deadlines = Deadlines()  # receive deadlines from the recent waits, per message kind
        self.deadline_extensions = 0  # waits past their deadline whose sender still answered
        self._feedback = codecs.ErrorFeedback()
        self._mb_compute_s: Optional[float] = None  # smoothed compute time per micro-batch of this stage
        self.profile = None  # profile.profiler.DeviceProfile of this peer
        self.probes: dict[str, Any] = {}  # peer id -> net.prober.LinkMeasurement
        self.probe_seconds = 0.0
        self.probe_window: list[float] = []  # [unix start, unix end] of this peer's probing
        self.measured = asyncio.Event()
        self.election: Optional[Election] = None
        self.groups_digest: Optional[str] = None
        self.groups: list[list[str]] = []
        self.replans = 0
        self.store = layer_state.Store(keep_steps=3)  # own snapshots and a buddy's copies, by (layer, step)
        self.events: list[dict] = []  # recoveries, for the run summary
        self._train_task: Optional[asyncio.Task] = None
        self._buddy_push: Optional[asyncio.Task] = None
        self._meta_layers = None
        self._device_base = None  # device counters when training began
        self._last_gain_check = 0.0
        self._gain_since: Optional[float] = None
        self._map_news = asyncio.Event()
        self._map_news_at = 0.0
        self._gain_key: Optional[tuple] = None  # (measurements, gain, new step, current step) of the last check
        self._bad_logged: set = set()
        peer.before_serving(self._install)

    # ---- wiring -------------------------------------------------------------------------------------
    def _install(self, peer) -> None:
        for kind in (ACT, GRAD, GSUM):
            peer.dataplane.register(kind, self._on_tensor)
        peer.dataplane.register("ckpt", self._on_ckpt)
        peer.dataplane.register("fetch", self._on_fetch)
        peer.dataplane.register("mapnews", self._on_map_news)
        peer.dataplane.add_json_get("/inventory", self.inventory)
        peer.dataplane.add_json_get("/report", self.report)
        peer.dataplane.add_json_get("/measurements", self.measurements)
        peer.status_extras["train"] = self.status

    async def _on_tensor(self, header: dict, buffers) -> None:
        kind, epoch = header.get("kind"), header.get("epoch")
        if self.smap is None or (isinstance(epoch, int) and epoch > self.smap.epoch):
            raise Retry("this peer has no stage map for that epoch yet")
        if self.stage is None:
            raise FrameError("this peer has no stage in the current stage map")
        if not self._expect:
            raise Retry("this peer is still setting up its stage")
        expect = self._expect.get(kind) if isinstance(kind, str) else None
        if expect is None:
            raise FrameError(f"this peer's stage does not take {kind!r} messages")
        step, mb, t = decode_tensor(header, buffers, expect, (self.step, self.step + 1))
        self.inbox.put((f"{kind}/{header['src']}" if kind == GSUM else kind, step, mb), t)
        return None

    def inventory(self) -> dict:
        return {"inventory": {str(k): v for k, v in self.store.inventory().items()}, "step": self.step,
                "epoch": self.smap.epoch if self.smap else None}

    def _expected_layer_shapes(self, layer: int) -> dict:
        if self._meta_layers is None:
            self._meta_layers = self.handle.meta_layers()
        return layer_state.expected_shapes(self._meta_layers[layer])

    def _check_layer_header(self, header: dict) -> tuple[int, int]:
        check_fields(header, {"job": str, "layer": int, "step": int})
        if self.job is None or header["job"] != self.job.job_id:
            raise FrameError("layer state for another job")
        if not 0 <= header["layer"] < self.handle.num_layers or not 0 <= header["step"] <= self.job.steps:
            raise FrameError("layer or step out of range")
        return header["layer"], header["step"]

    async def _on_map_news(self, header: dict, buffers) -> None:
        """A planner published a stage map: wake whoever waits for one (they read the DHT)."""
        if self.job is not None and header.get("job") != self.job.job_id:
            return None
        now = time.monotonic()
        if now - self._map_news_at >= MAP_NEWS_MIN_GAP_S:
            self._map_news_at = now
            self._map_news.set()
        return None

    async def _map_news_or(self, timeout_s: float) -> None:
        """Until the next stage-map news, at most ``timeout_s``."""
        try:
            await asyncio.wait_for(self._map_news.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._map_news.clear()

    async def _announce_map(self, epoch: int) -> None:
        """Best effort: every other live peer gets the news at once (a lost one waits MAP_POLL_S)."""
        async def tell(r) -> None:
            try:
                await self.peer.client.send(r.data_url, "mapnews", {"job": self.job.job_id, "epoch": epoch},
                                            timeout=2.0, link=self.peer.link_to(r.peer_id))
            except Exception as e:
                log.debug("stage-map news to %s not delivered: %r", r.name or r.peer_id, e)

        self._map_news.set()  # this peer's own waiters
        await asyncio.gather(*(tell(r) for r in self.peer.live_members()
                               if r.peer_id != self.peer.peer_id and r.data_url))

    async def _on_ckpt(self, header: dict, buffers) -> None:
        """A buddy's copy of one of its layers after a step: held for recovery."""
        layer, step = self._check_layer_header(header)
        self.store.put(layer, step, layer_state.decode(header, buffers, self._expected_layer_shapes(layer)))
        self._hold_losses(header.get("losses"))
        return None

    def _hold_losses(self, rows) -> None:
        """Keeps a buddy's recent (step, loss sum, count, epoch) rows, so that if it dies before its
        report is read, its part of the loss curve is still reported (by this peer)."""
        if rows is None:
            return
        if not isinstance(rows, list) or len(rows) > LOSS_ROWS:
            raise FrameError("losses must be a short list of [step, sum, count, epoch]")
        for row in rows:
            if (not isinstance(row, list) or len(row) != 4 or not all(isinstance(x, int) for x in row[::2])
                    or not isinstance(row[1], (int, float)) or not isinstance(row[2], int)
                    or not math.isfinite(row[1]) or not 0 < row[2] <= self.job.num_micro_batches
                    or not 0 <= row[0] < self.job.steps or row[3] < 0):
                raise FrameError(f"bad loss row {str(row)[:80]}")
            self.held_losses[row[0]] = (float(row[1]), row[2], row[3])
        for st in sorted(self.held_losses)[:-LOSS_ROWS * 4]:
            del self.held_losses[st]

    async def _on_fetch(self, header: dict, buffers):
        """Another peer takes over a layer: send it the state held for (layer, step)."""
        layer, step = self._check_layer_header(header)
        st = self.store.get(layer, step)
        if st is None:
            raise FrameError(f"this peer holds no state of layer {layer} at step {step}")
        return layer_state.encode(st)

    # ---- what the outside sees -----------------------------------------------------------------------
    def status(self) -> dict:
        last = self.losses.get(max(self.losses)) if self.losses else None
        return {"job": self.job.job_id if self.job else None, "stage": self.stage,
                "num_stages": self.smap.num_stages if self.smap else None,
                "epoch": self.smap.epoch if self.smap else None, "step": self.step,
                "steps_done": self.steps_done, "steps_total": self.job.steps if self.job else None,
                "loss": last, "error": self.error or self.refused,
                "planner": (self.peer.name_of(self.election.leader.peer_id) if self.election and self.election.leader
                            else None),
                "term": self.election.leader.term if self.election and self.election.leader else None,
                "groups_digest": self.groups_digest, "groups": self.groups, "replans": self.replans,
                "recent_losses": [[st, a, n, e] for st, (a, n, e) in
                                  sorted(self.loss_sums.items())[-30:] + sorted(self.held_losses.items())[-30:]],
                "plan": self.smap.summary() if self.smap else None, "events": self.events[-20:],
                "links_mbps": {self.peer.name_of(d): round(v, 2) for d in self.passive.destinations()
                               if (v := self.passive.estimate_mbps(d)) is not None}}

    def report(self) -> dict:
        durations = [e - s for _, s, e, _ in self.step_times]
        return {"peer_id": self.peer.peer_id, "name": self.peer.config.name, "stage": self.stage,
                "layers": list(self.smap.stages[self.stage].layers) if self.smap and self.stage is not None else None,
                "plan": self.smap.summary() if self.smap else None, "job": self.job.to_dict() if self.job else None,
                "steps_done": self.steps_done, "losses": [[s, l] for s, l in sorted(self.losses.items())],
                "loss_sums": [[s, a, n, e] for s, (a, n, e) in sorted(self.loss_sums.items())],
                "step_times": [list(x) for x in self.step_times],
                "step_s_median": statistics.median(durations) if durations else None,
                "wire_bytes": [[s, {self.smap.name_of(d): b for d, b in per.items()}]
                               for s, per in sorted(self.wire_bytes.items())] if self.smap else [],
                "codecs": dict(self.codecs_used),
                "device_stats": self.peer.device.stats().to_dict() if self.peer.device else None,
                "train_device": self._train_device_stats(),
                "compute_s_median": statistics.median(self.compute_s) if self.compute_s else None,
                "deadlines": {k: {"typical_s": round(t, 4), "deadline_s": round(self._deadlines.deadline(k, self.job.recv_timeout_s), 3)}
                              for k in (ACT, GRAD, GSUM) if (t := self._deadlines.typical(k)) is not None} if self.job else {},
                "deadline_extensions": self.deadline_extensions,
                "error": self.error, "refused": self.refused}

    # ---- the life of a trainer ----------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run()
        except JobRefused as e:
            self.refused = str(e)
            log.error("refusing to take part: %s", e)
            await self.peer.set_state("failed")
        except StepFailed as e:
            self.error = str(e)
            log.error("training stopped: %s", e)
            await self.peer.set_state("failed")
        except Exception as e:  # a bug or a broken model: say so in /status, never a silent idle peer
            self.error, self.crashed = f"trainer failed: {e!r}", True
            log.exception("trainer failed")
            await self.peer.set_state("failed")
        finally:
            self.finished.set()

    async def _run(self) -> None:
        self.job = await self._obtain_job()
        self.handle = check_compatible(self.job, self.opts.allowed_models)
        self.peer.spawn(self._refresh_job(), "refresh-job")
        log.info("job %s: model %s (%d layers), %d steps of %d x %d samples, schedule %s", self.job.job_id,
                 self.job.model, self.handle.num_layers, self.job.steps, self.job.num_micro_batches,
                 self.job.micro_batch_size, self.job.schedule)
        if self.opts.measure:
            await self.peer.set_state("measuring")
            await self._measure()
            if self.opts.measure_only:
                await self.peer.set_state("done")
                return
        await self.peer.set_state("ready")
        self.election = Election(self.peer, lease_s=6.0,
                                 candidates=lambda: [r.peer_id for r in self._ready_peers()])
        self.peer.spawn(self.election.run(1.0), "election")
        self.peer.spawn(self._groups_loop(), "groups")
        self.peer.spawn(self._planner_loop(), "planner")
        self.peer.spawn(self._watch_epochs(), "watch-epochs")
        await self._epochs()

    async def _epochs(self) -> None:
        """Follows stage maps until the job is done: train on each, and when an epoch breaks
        (a peer died, a newer map came), go back to the newest map and redo from its start step."""
        while True:
            smap = await self._await_stage_map(after=self.smap.epoch if self.smap else 0)
            if smap.error:
                raise StepFailed(f"the planner stopped the run: {smap.error}")
            self.smap, self.stage = smap, smap.stage_of(self.peer.peer_id)
            self._expect = {}
            self.inbox.clear()
            self.step = smap.start_step
            if self.stage is None:
                log.info("not in stage map epoch %d: standing by as a spare", smap.epoch)
                await self.peer.set_state("ready", epoch=smap.epoch)
                continue
            self._train_task = asyncio.create_task(self._train())
            try:
                await self._train_task
                return
            except (StepFailed, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and not self._train_task.cancelled():
                    raise
                why = str(e) or f"stage map epoch {smap.epoch} superseded"
                log.warning("epoch %d abandoned at step %d: %s", smap.epoch, self.step, why)
                self.events.append({"kind": "abandoned", "epoch": smap.epoch, "step": self.step, "t": time.time(),
                                    "reason": why[:300]})
                await self.peer.set_state("recovering", failed_epoch=smap.epoch)
            finally:
                self._train_task = None

    async def _watch_epochs(self) -> None:
        """Aborts the running epoch as soon as a newer stage map is out: no waiting on a dead peer."""
        while True:
            await self._map_news_or(MAP_POLL_S)
            task, cur = self._train_task, self.smap
            if task is None or cur is None or task.done():
                continue
            try:
                newest = await self._read_stage_maps()
            except Exception:
                continue
            if newest is not None and (newest.term, newest.epoch) > (cur.term, cur.epoch) and self._train_task is task:
                task.cancel()

    # ---- measurement ---------------------------------------------------------------------------------
    def measurements(self) -> dict:
        """This peer's own measurements, for the operator (names as the peers call themselves)."""
        dev = self.peer.device
        return {"peer": self.peer.config.name or self.peer.peer_id,
                "profile": self.profile.to_dict() if self.profile else None,
                "tflops": self._tflops(), "scale": dev.scale if dev else 1.0,
                "memory_gb": round(self.profile.memory_bytes / 2**30, 3) if self.profile else None,
                "links": {self.peer.name_of(p): m.to_dict() for p, m in self.probes.items()},
                "probe_seconds": round(self.probe_seconds, 3), "probe_window": self.probe_window,
                "device_stats": dev.stats().to_dict() if dev else None,
                "fidelity": dev.fidelity() if dev else None, "complete": self.measured.is_set()}

    def _tflops(self) -> Optional[float]:
        """Measured speed in the scenario's units (a virtual device's real FLOP/s divided by its scale)."""
        if self.profile is None:
            return None
        scale = self.peer.device.scale if self.peer.device else 1.0
        return self.profile.effective_tflops / scale

    def _log_bad(self, sub, reason) -> None:
        if (str(sub)[:32], reason) not in self._bad_logged:
            self._bad_logged.add((str(sub)[:32], reason))
            log.warning("ignoring %s", reason)

    async def _measure(self) -> None:
        from ..profile.profiler import profile_layers
        from ..swarm import measure

        job = self.job
        # measure a settled swarm: peers still starting up (their daemons, DHT nodes) would steal the CPU
        while len(self.peer.live_members()) < job.peers:
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)
        layers = self.handle.build(0, self.handle.num_layers)
        inputs, targets = data.batch(job.seed, 0, 0, job.micro_batch_size, job.seq_len)

        async def profile(cache_dir):
            dev, report = self.peer.device, {}
            before = dev.stats() if dev is not None else None
            self.profile = await asyncio.to_thread(
                profile_layers, layers, (job.micro_batch_size, job.seq_len), device=dev, cache_dir=cache_dir,
                fingerprint=f"{job.fingerprint}-{job.micro_batch_size}x{job.seq_len}", inputs=inputs, targets=targets,
                report=report)
            if before is None:
                return [], 0.0
            after = dev.stats()
            budget_s = (after.flops - before.flops) / dev.flops_per_s
            return report.get("late_layers", []), (after.real_s - before.real_s) / budget_s if budget_s > 0 else 0.0

        late, load = await profile(self.opts.profile_cache_dir)
        # Layers whose every repetition was late measured the host's load (all peers profile at
        # once on shared cores), unless this host can never keep up with the device (its CPU time
        # is a multiple of the budget): say so (others do not probe yet), profile again once all
        # have profiled.
        async def publish(provisional: bool):
            await measure.publish(self.peer, measure.PROFILES, {"profile": self.profile.to_dict(), "job": job.job_id,
                                                                "tflops": self._tflops(), "provisional": provisional})

        again = bool(late) and load < 3.0
        await publish(again)
        if again:
            log.info("layer(s) %s never kept up with the device's budget (a busy host): profiling again once every "
                     "peer has profiled", late)
            await self._wait_published(measure.PROFILES, {r.peer_id for r in self.peer.live_members()}, 30.0)
            late, _ = await profile(None)
            await publish(False)
        log.info("device profile published: %.4g TFLOP/s, %.1f ms per micro-batch through the whole model%s",
                 self._tflops(), self.profile.total_s * 1e3, f" (layers {late} never kept up)" if late else "")
        self.peer.spawn(self._probe_loop(), "probe-links")
        await self.measured.wait()

    async def _probe_loop(self) -> None:
        """Probes every member not yet probed (newcomers included), one link at a time."""
        from ..net.prober import probe_link
        from ..swarm import measure

        # probe a quiet swarm: profiling (up to 10 s on a slow virtual device) loads the CPUs
        await self._wait_published(measure.PROFILES, {r.peer_id for r in self.peer.live_members()}, 30.0,
                                   final=lambda d: not d.get("provisional"))
        t_start = time.monotonic()
        self.probe_window = [time.time(), time.time()]
        pings = await self._ping_phase()
        await self._wait_probe_turn()
        while True:
            members = [r for r in self.peer.live_members() if r.peer_id != self.peer.peer_id]
            todo = [r for r in members if r.peer_id not in self.probes and r.data_url]
            for r in todo:
                m = await probe_link(self.peer.client, r.data_url, r.name or r.peer_id, self.peer.emulator,
                                     rtt_s=pings.pop(r.peer_id, None))
                self.probes[r.peer_id] = m
                if not m.ok:
                    log.warning("link to %s unknown: %s", self.peer.name_of(r.peer_id), m.error)
            if todo:
                self.probe_seconds = time.monotonic() - t_start
                self.probe_window[1] = time.time()
                await measure.publish(self.peer, measure.LINKS,
                                      {"links": {p: m.to_dict() for p, m in self.probes.items()}})
                log.info("probed %d link(s) in %.1fs", len(self.probes), self.probe_seconds)
            if len(members) + 1 >= self.job.peers and all(r.peer_id in self.probes for r in members):
                self.measured.set()
            await self._publish_passive()
            await asyncio.sleep(1.0)

    async def _publish_passive(self) -> None:
        """Links with real traffic: the passive estimate replaces the probe's bandwidth (weather).

        Only sizeable changes reach the DHT (see ``prober.link_update``)."""
        from ..net.prober import LinkMeasurement, link_update
        from ..swarm import measure

        now = time.monotonic()
        if now - getattr(self, "_passive_published", 0.0) < REPLAN_CHECK_S:
            return
        changed = False
        for dst in set(self.passive.destinations()) | set(self._probed):
            cur = self.probes.get(dst)
            if cur is None or not cur.ok:
                continue
            probed = self._probed.setdefault(dst, cur)
            bound = self.passive.lower_bound(dst)
            new = link_update(cur.mbps, probed.mbps, self.passive.estimate_mbps(dst), bound * 8 / 1e6 if bound else None)
            if new is not None:
                log.info("link to %s now %.1f Mbit/s (was %.1f, probed %.1f)", self.peer.name_of(dst),
                         new, cur.mbps, probed.mbps)
                self.probes[dst] = LinkMeasurement(cur.dst, "ok", cur.rtt_ms, new, "", cur.bulk_bytes, cur.seconds)
                changed = True
        if changed:
            self._passive_published = now
            await measure.publish(self.peer, measure.LINKS, {"links": {p: m.to_dict() for p, m in self.probes.items()}})

    # links whose round trip reads under this are pinged again in a quieter moment (see _ping_phase)
    SHORT_RTT_S = 0.010
    QUIET_SLOT_S = 0.5  # one turn of pinging short links again

    async def _ping_phase(self, max_wait_s: float = 20.0, at_once: int = 1) -> dict[str, float]:
        """Everybody pings everybody at once, in a quiet moment: after every peer has profiled its
        device and before anybody's bulk transfers. A ping that waits behind another prober's bulk
        transfer on a busy CPU reads a 5 ms link as 8 ms; pings alone barely load it. Returns the
        RTT per peer id (seconds), for ``probe_link(rtt_s=...)``.

        Then the short links (under ``SHORT_RTT_S``) are pinged again, by ``at_once`` peers at a
        time in time slots of ``QUIET_SLOT_S`` (peer-id order, from a start all peers derive from
        the same published records, so waiting costs no polling): seven peers pinging at once on
        two cores scatter each ping by several ms, which a 40 ms link shrugs off and a 1 ms one
        does not (it read 1.2-1.9 ms, 5 ms links up to 6.4)."""
        from ..net.prober import paired_rtt, ping_links
        from ..swarm import measure

        me = self.peer.peer_id
        members = self.peer.live_members()
        order = {r.peer_id for r in members}
        pings: dict[str, float] = {}
        own = self.peer.dataplane.url if self.peer.dataplane else None
        # rounds of one ping to each; each peer starts its rounds with the next one in peer-id
        # order (wrapping around), so that a peer is pinged by about one other at a time
        targets = sorted((r for r in members if r.peer_id != me and r.data_url),
                         key=lambda r: (r.peer_id < me, r.peer_id))
        names = {r.name or r.peer_id: r.peer_id for r in targets}

        async def ping(rs, **kw) -> None:
            found = await ping_links(self.peer.client, [(r.name or r.peer_id, r.data_url) for r in rs],
                                     self.peer.emulator, baseline_url=own, around_emulator=True, **kw)
            for name, samples in found.items():
                if len(samples) >= 6:
                    pings[names[name]] = paired_rtt(samples)
                log.debug("pings to %s, less the baseline's round trip: %s ms", name,
                          " ".join(f"{x * 1e3:.2f}" for x in sorted(samples)))

        if own and targets:
            await ping(targets, count=10, gap_s=0.01, min_s=0.5)
        short = [r for r in targets if r.peer_id in pings and pings[r.peer_id] < self.SHORT_RTT_S]
        await measure.publish(self.peer, measure.PINGS, {"peers": len(pings), "short": bool(short),
                                                         "finished": time.time()})
        await self._wait_published(measure.PINGS, order, max_wait_s)
        # the slots start a little after the last peer finished its pings; peers whose record
        # we cannot read (a newcomer, a malformed one) have no slot
        recs = await measure.read(self.peer, measure.PINGS, lambda d: (bool(d.get("short")), float(d.get("finished", 0))),
                                  self._log_bad)
        recs = {p: v for p, v in recs.items() if p in order and math.isfinite(v[1])}
        turn = sorted(p for p, (has, _) in recs.items() if has)
        if not turn:
            return pings
        t0 = max(f for _, f in recs.values()) + 0.3
        end = t0 + -(-len(turn) // at_once) * self.QUIET_SLOT_S

        async def sleep_until(t: float) -> None:
            # a clock far off (or a record from the future) must not stall us
            await asyncio.sleep(min(max(0.0, t - time.time()), max_wait_s))

        if short and me in turn:
            await sleep_until(t0 + (turn.index(me) // at_once) * self.QUIET_SLOT_S)
            await ping(short, count=12, gap_s=0.002, min_s=0.3, deadline_s=self.QUIET_SLOT_S * 0.9)
        await sleep_until(end)  # bulk probes load the CPU: not before the last slot is over
        return pings

    async def _wait_published(self, what: str, peers: set, max_wait_s: float, final=lambda d: True) -> None:
        """Until each of ``peers`` that is still measuring (or about to) has an entry under ``what``
        (one that ``final`` accepts), or ``max_wait_s``. A newcomer to a training swarm waits for
        nobody but other newcomers."""
        from ..swarm import measure

        deadline = time.monotonic() + max_wait_s
        while time.monotonic() < deadline:
            have = {p for p, ok in (await measure.read(self.peer, what, final, self._log_bad)).items() if ok}
            measuring = {r.peer_id for r in self.peer.live_members() if r.state in ("joining", "idle", "measuring")}
            if all(p in have for p in peers & measuring):
                return
            await asyncio.sleep(0.5)  # DHT reads cost CPU on every peer: not too often
        log.warning("went on without every peer's %s after %.0f s", what, max_wait_s)

    async def _wait_probe_turn(self, at_once: int = 3, max_wait_s: float = 60.0) -> None:
        """Peers probe in turns of ``at_once``, in peer-id order: many concurrent probes would share
        the CPU (and the loopback) and measure each other instead of the links."""
        from ..swarm import measure

        order = sorted(r.peer_id for r in self.peer.live_members())
        mine = order.index(self.peer.peer_id) if self.peer.peer_id in order else 0
        before = order[: mine - mine % at_once]
        deadline = time.monotonic() + max_wait_s
        while before and time.monotonic() < deadline:
            links = await measure.read(self.peer, measure.LINKS, lambda d: set(d["links"]), self._log_bad)
            if all(p in links and set(order) - {p} <= links[p] for p in before):
                return
            await asyncio.sleep(0.3)

    async def _obtain_job(self) -> JobSpec:
        dht = self.peer.dht
        if self.opts.job is not None:
            job = self.opts.job if self.opts.job.fingerprint else self.opts.job.finalized()
            await self._store(job_key(self.peer.config.swarm), "job", sign_payload(job.to_dict(), self.peer.identity))
            return job
        waited = 0.0
        while True:
            found = await dht.get(job_key(self.peer.config.swarm), latest=True)
            entry = found.value.get("job") if found is not None and isinstance(found.value, dict) else None
            if entry is not None:
                try:
                    _, payload = open_payload(entry.value)
                    return JobSpec.from_dict(payload)
                except (BadRecord, ValueError, TypeError) as e:
                    raise JobRefused(f"the swarm's job record is invalid: {e}") from None
            if waited == 0.0:
                log.info("waiting for the swarm's job to appear in the DHT")
            await asyncio.sleep(self.opts.poll_s)
            waited += self.opts.poll_s

    async def _store(self, key: str, subkey: str, value: dict) -> None:
        from hivemind.utils import get_dht_time

        await self.peer.dht.store(key, value, get_dht_time() + RECORD_TTL_S, subkey=subkey)

    async def _refresh_job(self) -> None:
        """Every peer keeps the job record alive, so it outlives the peer that published it."""
        from hivemind.utils import get_dht_time

        while True:
            await asyncio.sleep(RECORD_TTL_S / 4)
            found = await self.peer.dht.get(job_key(self.peer.config.swarm), latest=True)
            if found is not None and isinstance(found.value, dict) and "job" in found.value:
                await self.peer.dht.store(job_key(self.peer.config.swarm), found.value["job"].value,
                                          get_dht_time() + RECORD_TTL_S, subkey="job")

    async def _read_stage_maps(self) -> Optional[StageMap]:
        """The newest valid stage map of this job: highest (term, epoch), so a stale planner's
        publications (an older term) lose to its successor's."""
        found = await self.peer.dht.get(stagemap_key(self.peer.config.swarm), latest=True)
        if found is None or not isinstance(found.value, dict):
            return None
        best = None
        for sub, entry in found.value.items():
            try:
                signer, payload = open_payload(entry.value, MAX_MAP_BYTES)
                smap = StageMap.from_dict(payload, self.handle.num_layers)
            except (BadRecord, ValueError) as e:
                self._log_bad(sub, f"stage map {str(sub)[:16]}: {e}")
                continue
            if smap.job_id != self.job.job_id:
                continue
            if best is None or (smap.term, smap.epoch) > (best.term, best.epoch):
                best = smap
        return best

    async def _await_stage_map(self, after: int = 0) -> StageMap:
        announced = False
        while True:
            smap = await self._read_stage_maps()
            if smap is not None and smap.epoch > after:
                self._log_map(smap)
                return smap
            if not announced:
                log.info("waiting for the planner's stage map (%d of %d peers ready)",
                         len(self._ready_peers()), self.job.peers)
                announced = True
            await self._map_news_or(MAP_POLL_S)

    def _log_map(self, smap: StageMap) -> None:
        pred = f", predicted step {smap.predicted_step_s:.3f}s ({smap.bottleneck})" if smap.predicted_step_s else ""
        log.info("stage map epoch %d (term %d, %s%s): %s", smap.epoch, smap.term, smap.schedule or self.job.schedule,
                 pred, " | ".join(f"{'+'.join(smap.name_of(p) for p in st.peers)} [{st.layers[0]},{st.layers[1]})"
                                  for st in smap.stages))

    def _ready_peers(self) -> list:
        return [r for r in self.peer.live_members() if r.state in ("ready", "training", "recovering", "done")]

    # ---- groups, election, planning ----------------------------------------------------------------
    async def _measured_snapshot(self):
        """(peer ids, profiles, links) of the ready peers whose measurements are in the DHT."""
        from ..swarm import measure

        profiles = await measure.read(self.peer, measure.PROFILES, lambda d: d, self._log_bad)
        links = await measure.read(self.peer, measure.LINKS, lambda d: d["links"], self._log_bad)
        ids = sorted(r.peer_id for r in self._ready_peers() if r.peer_id in profiles and r.peer_id in links)
        return ids, profiles, links

    async def _groups_loop(self) -> None:
        """Every peer computes the grouping of the same snapshot and publishes its digest."""
        from ..swarm import grouping, measure

        published = None
        last_round, last_live = 0.0, None
        while True:
            # DHT reads cost every peer CPU: once a stage map is in force and the live peers are
            # the same, the measurements are read again only every REPLAN_CHECK_S
            live = sorted(r.peer_id for r in self._ready_peers())
            if self.smap is not None and live == last_live and time.monotonic() - last_round < REPLAN_CHECK_S:
                await asyncio.sleep(1.0)
                continue
            last_round, last_live = time.monotonic(), live
            try:
                ids, profiles, links = await self._measured_snapshot()
                if ids:
                    snap = planning.snapshot(profiles, links, ids)
                    g = grouping.group(snap)
                    self.groups_digest = g.digest()
                    self.groups = [sorted(self.peer.name_of(p) for p in grp.peers) for grp in g.groups]
                    if (self.groups_digest, ids) != published:
                        await measure.publish(self.peer, measure.GROUPS, {"digest": self.groups_digest, "peers": ids})
                        published = (self.groups_digest, ids)
            except Exception as e:
                log.warning("grouping round failed: %s", e)
            await asyncio.sleep(1.0)

    async def _quorum(self, ids: list[str], digest: str) -> bool:
        """More than half of the snapshot's peers published the same groups digest for it."""
        from ..swarm import measure

        votes = await measure.read(self.peer, measure.GROUPS, lambda d: (d["digest"], list(d["peers"])), self._log_bad)
        agree = sum(1 for p in ids if votes.get(p) == (digest, ids))
        return agree * 2 > len(ids)

    async def _planner_loop(self) -> None:
        """Runs on every peer; acts while this peer holds the planner lease: publishes the first
        stage map once enough peers are measured and agree on the groups, and a new epoch when a
        peer of the current map is gone."""
        while True:
            await asyncio.sleep(self.opts.poll_s)
            if self.election is None or not self.election.is_leader:
                continue
            try:
                current = await self._read_stage_maps()
                inherited = current is not None and current.term < self.election.leader.term
                if current is not None and not current.error and not inherited and not await self._epoch_broken(current):
                    if await self._worth_replanning(current):
                        await self._plan_and_publish(current, improve=True)
                    continue
                if current is not None and current.error:
                    continue
                if inherited:
                    log.info("taking over as planner from term %d: re-planning from the live swarm", current.term)
                await self._plan_and_publish(current)
            except Exception as e:
                log.warning("planning round failed: %r", e)

    async def _worth_replanning(self, current: StageMap) -> bool:
        """A newcomer or a lasting change of links: re-plan only when a new plan is predicted to
        be at least ``REPLAN_GAIN`` faster on the latest measurements, and still is after
        ``REPLAN_HOLD_S`` (hysteresis: a short blip never moves a stage)."""
        now = time.monotonic()
        if now - self._last_gain_check < REPLAN_CHECK_S or planning.model_profile(self.job) is None:
            return False
        self._last_gain_check = now
        if self.job.plan != "planner" or not self.opts.measure:
            return False
        ids, profiles, links = await self._measured_snapshot()
        if not ids:
            return False
        key = json.dumps([ids, [links.get(p) for p in ids], [profiles[p].get("profile") for p in ids],
                          current.epoch, current.term], sort_keys=True, default=str)
        if self._gain_key is not None and self._gain_key[0] == key:
            gain, new_s, cur = self._gain_key[1:]  # the same measurements: the same answer
        else:
            snap = planning.snapshot(profiles, links, ids)
            cur = planning.current_cost(current, self.job, snap)
            new = await asyncio.to_thread(planning.make_plan, self.job, snap, "planner")
            new_s = new.step_s
            gain = cur / new_s - 1 if new_s > 0 else 0.0
            self._gain_key = (key, gain, new_s, cur)
        if gain < REPLAN_GAIN:
            if self._gain_since is not None:
                log.info("re-plan gain gone (%.0f %%): no move", gain * 100)
            self._gain_since = None
            return False
        if self._gain_since is None:
            self._gain_since = now
            log.info("a new plan would be %.0f %% faster (%.3fs vs %.3fs per step): holding %.0fs before moving",
                     gain * 100, new_s, cur, REPLAN_HOLD_S)
            return False
        if now - self._gain_since < REPLAN_HOLD_S:
            return False
        self._gain_since = None
        log.info("re-planning: %.0f %% predicted gain has lasted %.0fs", gain * 100, REPLAN_HOLD_S)
        return True

    async def _epoch_broken(self, current: StageMap) -> bool:
        """A peer of the map is gone, or abandoned this epoch. A peer whose record merely expired
        (a heartbeat late on a busy machine) but that still answers at its address is not gone:
        re-planning around it would throw away the step in flight for nothing."""
        recs = {r.peer_id: r for r in self.peer.live_members()}
        for st in current.stages:
            for p in st.peers:
                r = recs.get(p)
                if r is not None:
                    if r.state == "recovering" and r.progress.get("failed_epoch") == current.epoch:
                        return True
                    continue
                url = self.peer.last_data_url(p)  # None once it left with a tombstone
                if url is None or not await self._answers_at(url):
                    return True
                log.info("%s: no fresh record, but it answers: its heartbeat is late, not a failure",
                         self.smap.name_of(p) if self.smap else p[:12])
        return False

    async def _resume_point(self, current: StageMap) -> tuple[Optional[int], str]:
        """(step to redo from, error): the latest step whose state of every layer survives."""
        invs = [*(await self._inventories()).values(), self.store.inventory()]
        # step 0 is every layer's initial state, which any peer rebuilds from the job's seed
        invs.append({i: [0] for i in range(self.handle.num_layers)})
        step, missing = layer_state.resume_step(invs, self.handle.num_layers)
        if missing:
            spans = [(a, b) for st in current.stages for a, b in [st.layers] if any(a <= m < b for m in missing)]
            return None, (f"layers {missing} (of stage range {spans}) have no surviving copy: no live replica and "
                          f"no checkpoint on any live peer; the run cannot continue without losing them")
        if step is None:
            return None, "the surviving copies of the layers share no common step"
        return step, ""

    async def _plan_and_publish(self, current: Optional[StageMap], improve: bool = False) -> None:
        """Plans from the live swarm and publishes the stage map as the next epoch. ``improve``: the
        current map still runs and a better one is expected; a plan that would only reload the
        same layers on the same peers is not published."""
        job = self.job
        measured = job.plan != "even" and self.opts.measure and planning.model_profile(job) is not None
        if measured:
            ids, profiles, links = await self._measured_snapshot()
            if current is None and len(ids) < job.peers:
                return
            if not ids or self.groups_digest is None or not await self._quorum(ids, self.groups_digest):
                return
        else:
            ids = sorted(r.peer_id for r in self._ready_peers())
            if current is None and len(ids) < job.peers:
                return
        names = {r.peer_id: r.name for r in self.peer.live_members()}
        epoch = (current.epoch if current else 0) + 1
        term = self.election.leader.term
        start, error = (await self._resume_point(current)) if current is not None else (0, "")
        plan = None
        if measured and not error:
            snap = planning.snapshot(profiles, links, ids)
            t0 = time.perf_counter()
            try:
                plan = await asyncio.to_thread(planning.make_plan, job, snap, job.plan)
            except planning.NoPlan as e:
                error = f"no plan can run this job on the {len(ids)} live peers: {e}"
        if error:
            base = current or placeholder_map(ids, self.handle.num_layers, job.job_id, epoch=epoch, names=names)
            smap = replace(base, epoch=epoch, term=term, error=error)
            await self._store(stagemap_key(self.peer.config.swarm), f"{smap.epoch:012d}",
                              sign_payload(smap.to_dict(), self.peer.identity, MAX_MAP_BYTES))
            log.error("run stopped: %s", error)
            self.peer.spawn(self._announce_map(smap.epoch), "map-news")
            return
        if plan is not None:
            smap = planning.to_stage_map(plan, job, epoch, names, term, start)
            if improve and current is not None and _same_layout(smap, current):
                log.info("re-plan gives the same stages, peers and schedule: nothing to move")
                return
            log.info("planned %d stages for %d peers in %.2fs: predicted %.3fs per step, bottleneck %s",
                     smap.num_stages, len(ids), time.perf_counter() - t0, plan.step_s, plan.bottleneck)
        else:
            smap = replace(placeholder_map(ids, self.handle.num_layers, job.job_id, epoch=epoch, names=names,
                                           start_step=start, num_stages=job.stages), term=term)
        await self._store(stagemap_key(self.peer.config.swarm), f"{smap.epoch:012d}",
                          sign_payload(smap.to_dict(), self.peer.identity, MAX_MAP_BYTES))
        self.replans += current is not None
        log.info("published stage map epoch %d (term %d)", smap.epoch, term)
        self.peer.spawn(self._announce_map(smap.epoch), "map-news")

    async def _train(self) -> None:
        job, smap, k = self.job, self.smap, self.stage
        me = self.peer.peer_id
        first, last = smap.stages[k].layers
        n, M = smap.num_stages, job.num_micro_batches
        shapes = self.handle.boundary_shapes()
        layers = self.handle.build(first, last)
        prev = smap.stages[k - 1] if k > 0 else None
        nxt = smap.stages[k + 1] if k < n - 1 else None
        self._route = {ACT: nxt.assign(M) if nxt else [], GRAD: prev.assign(M) if prev else []}
        self._replicas = smap.stages[k].peers
        expect = {}
        if prev:
            expect[ACT] = Expect(ACT, job.job_id, smap.epoch, frozenset(prev.peers), shapes[first], M)
        if nxt:
            expect[GRAD] = Expect(GRAD, job.job_id, smap.epoch, frozenset(nxt.peers), shapes[last], M)
        params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        if len(self._replicas) > 1:
            self._buckets = layer_buckets([[p.numel() for p in layer.parameters() if p.requires_grad] for layer in layers])
            sizes = [(sum(n for _, n in b),) for _, b in self._buckets] + ([(2,)] if nxt is None else [])
            expect[GSUM] = Expect(GSUM, job.job_id, smap.epoch, frozenset(self._replicas) - {me}, (),
                                  len(sizes), shapes_by_mb=tuple(sizes))
        layer_flops = None
        if self.peer.device is not None:
            ids, tgt = data.batch(job.seed, 0, 0, job.micro_batch_size, job.seq_len)
            sample = ids if k == 0 else torch.randn(shapes[first])
            layer_flops = await asyncio.to_thread(stage_layer_flops, layers, sample, tgt if k == n - 1 else None)
        executor = StageExecutor(layers, k == 0, k == n - 1, M,
                                 batch=lambda step, mb: data.batch(job.seed, step, mb, job.micro_batch_size, job.seq_len),
                                 recv=self._recv, send=self._send, device=self.peer.device,
                                 layer_flops=layer_flops)
        opt = make_optimizer(job, executor.params)
        await self._load_state(layers, opt, first, smap.start_step)
        assignments = [st.assign(M) for st in smap.stages]
        actions = peer_actions(assignments, smap.schedule or self._default_schedule()).get((k, me), [])  # this peer's micro-batches, in order
        self._expect = expect
        if self._device_base is None and self.peer.device is not None:
            self._device_base = self.peer.device.stats()
        await self.peer.set_state("training", epoch=smap.epoch)
        try:
            for step in range(smap.start_step, job.steps):
                self.step = step
                t0 = time.time()
                gsum = None
                if len(self._replicas) > 1:
                    gsum = GradientSum(self, step, params, self._buckets, [p for p in self._replicas if p != me])
                try:
                    result = await executor.run_step(step, actions, gsum.layer_done if gsum else None)
                except BaseException:
                    if gsum is not None:
                        await gsum.cancel()
                    raise
                t_pipe = time.time()
                loss_sum, loss_count = sum(result.losses), len(result.losses)
                if gsum is not None:
                    total = await gsum.finish((loss_sum, loss_count) if nxt is None else None)
                    if total is not None:
                        loss_sum, loss_count = total
                t_sum = time.time()
                if self.opts.dump_grads_dir and step == self.opts.dump_step:
                    self._dump_grads(layers, first, step)
                opt.step()
                opt.zero_grad(set_to_none=True)
                self.inbox.drop_before(step + 1)
                t1 = time.time()
                self.step_times.append((step, t0, t1, smap.epoch))
                self.compute_s.append(result.compute_s)
                if actions:
                    per_mb = result.compute_s / max(1, sum(a.op is sched.Op.F for a in actions))
                    self._mb_compute_s = per_mb if self._mb_compute_s is None else 0.7 * self._mb_compute_s + 0.3 * per_mb
                self.steps_done += 1
                if loss_count:
                    self.loss_sums[step] = (loss_sum, loss_count, smap.epoch)
                    self.losses[step] = loss_sum / loss_count
                self.step = step + 1
                self.peer.progress = {**self.peer.progress, "step": self.step}  # in the DHT with the next heartbeat
                self._snapshot(layers, opt, first, self.step)
                if loss_count or log.isEnabledFor(logging.DEBUG):
                    t2 = time.time()
                    parts = (f"{t2 - t0:.3f}s: pipeline {t_pipe - t0:.3f} (compute {result.compute_s:.3f}), gradient "
                             f"sum {t_sum - t_pipe:.3f}, optimizer {t1 - t_sum:.3f}, snapshot {t2 - t1:.3f}")
                    if loss_count:
                        log.info("step %d: loss %.4f (%s)", step, self.losses[step], parts)
                    else:
                        log.debug("step %d (%s)", step, parts)
                if job.checkpoint_every and self.step % job.checkpoint_every == 0 and self.opts.checkpoint_dir:
                    self._checkpoint(layers, opt, first, last)
        finally:
            executor.close()
        await self.peer.set_state("done")
        log.info("training done: %d steps", self.steps_done)

    def _snapshot(self, layers, opt, first: int, step: int) -> None:
        """Keeps the state after ``step`` completed steps, and sends a copy to the buddy peer."""
        states = [(first + i, layer_state.capture(layer, opt)) for i, layer in enumerate(layers)]
        for i, st in states:
            self.store.put(i, step, st)
        buddy = self._buddy()
        if buddy is not None and (self._buddy_push is None or self._buddy_push.done()):
            self._buddy_push = asyncio.create_task(self._push_to_buddy(buddy, states, step))

    def _rtt_ms(self, peer_id: str) -> float:
        """Probed RTT to a peer (nearest first when choosing a buddy or a source); unknown: last."""
        m = self.probes.get(peer_id)
        return m.rtt_ms if m is not None and m.rtt_ms else 1e9

    def _buddy(self) -> Optional[str]:
        """Where this peer's layers are copied after each step: nowhere if a replica of the stage
        holds them anyway, else the peer of the map nearest to this one (local first)."""
        me, smap = self.peer.peer_id, self.smap
        if len(smap.stages[self.stage].peers) > 1:
            return None
        others = [p for st in smap.stages for p in st.peers if p != me]
        if not others:
            return None
        return min(others, key=lambda p: (self._rtt_ms(p), p))

    async def _push_to_buddy(self, buddy: str, states, step: int) -> None:
        rows = [[s, a, n, e] for s, (a, n, e) in sorted(self.loss_sums.items())[-LOSS_ROWS:]]
        try:
            for i, (layer, st) in enumerate(states):
                header, bufs = layer_state.encode(st)
                header.update({"job": self.job.job_id, "layer": layer, "step": step})
                if i == 0 and rows:
                    header["losses"] = rows  # first, so the copy of a step never arrives without its loss
                url = self.peer.data_url_of(buddy)
                if url is None:
                    return
                await self.peer.client.send(url, "ckpt", header, bufs, timeout=self.job.recv_timeout_s,
                                            link=self.peer.link_to(buddy))
        except Exception as e:
            log.info("copy of step %d to buddy %s failed: %s", step, self.peer.name_of(buddy), e)

    async def _load_state(self, layers, opt, first: int, step: int) -> None:
        """Puts the layers in their state after ``step`` steps: fresh at step 0, else from this peer's
        own snapshot, a live replica or a buddy's copy (nearest first)."""
        invs = None
        for i, layer in enumerate(layers):
            idx = first + i
            st = self.store.get(idx, step)
            if st is None and step == 0:
                self.store.put(idx, 0, layer_state.capture(layer, opt))  # built from the job's seed: the initial state
                continue
            if st is None:
                if invs is None:
                    invs = await self._inventories()
                st = await self._fetch_layer(idx, step, invs)
                self.events.append({"kind": "fetched", "layer": idx, "step": step, "t": time.time()})
            layer_state.apply(layer, opt, st)
            self.store.put(idx, step, st)

    async def _inventories(self) -> dict[str, dict[int, list[int]]]:
        out = {}
        for r in self.peer.live_members():
            if r.peer_id == self.peer.peer_id or not r.data_url:
                continue
            try:
                got = await self.peer.client.status(r.data_url, timeout=3.0, path="/inventory")
                out[r.peer_id] = {int(k): [int(x) for x in v][:16] for k, v in list(got["inventory"].items())[:4096]}
            except Exception as e:  # an unreachable peer holds nothing we can use
                log.info("no inventory from %s: %s", self.peer.name_of(r.peer_id), e)
        return out

    async def _fetch_layer(self, layer: int, step: int, invs: dict) -> list:
        holders = [p for p, inv in invs.items() if step in inv.get(layer, [])]
        for src in sorted(holders, key=lambda p: (self._rtt_ms(p), p)):
            try:
                reply = await self.peer.client.send(
                    self.peer.data_url_of(src), "fetch", {"job": self.job.job_id, "layer": layer, "step": step},
                    timeout=self.job.recv_timeout_s, link=self.peer.link_to(src))
                st = layer_state.decode(*reply, self._expected_layer_shapes(layer))
                log.info("layer %d at step %d fetched from %s", layer, step, self.peer.name_of(src))
                return st
            except Exception as e:
                log.warning("fetching layer %d from %s failed: %s", layer, self.peer.name_of(src), e)
        raise StepFailed(f"no live peer could give layer {layer} at step {step}")

    def _train_device_stats(self) -> Optional[dict]:
        """FLOPs, padded ops and overruns of the virtual device since training began, and its speed."""
        dev = self.peer.device
        if dev is None:
            return None
        now, base = dev.stats(), self._device_base
        d = {"flops": now.flops, "padded_ops": now.padded_ops, "overruns": now.overruns}
        if base is not None:
            d = {k: v - getattr(base, k) for k, v in d.items()}
        d["flops_per_s"] = dev.flops_per_s
        return d

    def _default_schedule(self) -> str:
        return "gpipe" if self.job.schedule == "auto" else self.job.schedule

    def _checkpoint(self, layers, opt, first: int, last: int) -> None:
        os.makedirs(self.opts.checkpoint_dir, exist_ok=True)
        name = f"ckpt-{self.job.job_id}-layers{first}-{last}-step{self.step}.pt"
        path = os.path.join(self.opts.checkpoint_dir, name)
        torch.save({"job_id": self.job.job_id, "step": self.step, "layers": [first, last],
                    "model": [layer.state_dict() for layer in layers], "optimizer": opt.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        old = sorted((f for f in os.listdir(self.opts.checkpoint_dir)
                      if f.startswith(f"ckpt-{self.job.job_id}-layers{first}-{last}-")),
                     key=lambda f: int(f.rsplit("step", 1)[1].split(".")[0]))
        for f in old[:-2]:
            os.remove(os.path.join(self.opts.checkpoint_dir, f))

    def _dump_grads(self, layers, first: int, step: int) -> None:
        os.makedirs(self.opts.dump_grads_dir, exist_ok=True)
        grads = {f"{first + i}.{name}": p.grad.detach().clone() for i, layer in enumerate(layers)
                 for name, p in layer.named_parameters() if p.grad is not None}
        torch.save(grads, os.path.join(self.opts.dump_grads_dir, f"grads-step{step}-{self.peer.peer_id}.pt"))

    async def _recv(self, kind: str, step: int, mb: int) -> torch.Tensor:
        # activations of a micro-batch come from the peer its gradients go back to, and vice versa
        src = self._route[GRAD if kind == ACT else ACT][mb]
        return await self._await((kind, step, mb), kind, src)

    async def _await(self, key: tuple[str, int, int], kind: str, src: str) -> torch.Tensor:
        """The message ``key`` from ``src``. Past the adaptive deadline (a multiple of the recent
        waits for this kind), ask whether ``src`` still lives: one that does not answer fails the
        step at once; a slow but live one is waited for, up to the job's ``recv_timeout_s``."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        cap = t0 + self.job.recv_timeout_s
        while True:
            wait = self._deadlines.deadline(kind, max(0.0, cap - loop.time()))
            try:
                t = await self.inbox.get(key, max(0.05, wait))
            except TimeoutError:
                waited = loop.time() - t0
                if loop.time() >= cap:
                    raise StepFailed(f"no {kind} for step {key[1]} micro-batch {key[2]} from "
                                     f"{self.smap.name_of(src)} within {waited:.1f}s") from None
                if not await self._answers(src):
                    raise StepFailed(f"no {kind} for step {key[1]} micro-batch {key[2]} after {waited:.1f}s, and "
                                     f"{self.smap.name_of(src)} does not answer") from None
                log.info("waiting %.1fs for %s of step %d from %s (typically %.2fs): it answers, so waiting on",
                         waited, kind, key[1], self.smap.name_of(src), self._deadlines.typical(kind) or 0.0)
                self.deadline_extensions += 1
                continue
            self._deadlines.observe(kind, loop.time() - t0)
            return t

    async def _answers(self, peer_id: str) -> bool:
        """Whether a peer is alive: answering its /status quickly where it served last (a record
        that expired on a busy machine is not a death; a tombstone is)."""
        if peer_id == self.peer.peer_id:
            return True
        url = self.peer.last_data_url(peer_id)
        return url is not None and await self._answers_at(url)

    async def _answers_at(self, url: str) -> bool:
        try:
            await self.peer.client.status(url, timeout=2.0)
            return True
        except Exception:
            return False

    async def _send(self, kind: str, step: int, mb: int, t: torch.Tensor) -> None:
        await self._send_to(self._route[kind][mb], kind, step, mb, t)

    def _codec_for(self, kind: str, dst: str, raw_bytes: int) -> str:
        c = self.job.compression
        if kind == GSUM or c == "none":
            return "none"
        if c != "adaptive":
            return c
        probe = self.probes.get(dst)
        if self._policy.bandwidth(dst) is None and probe is not None and probe.ok:
            self._policy.set_link(dst, bytes_per_s=probe.mbps * 1e6 / 8, rtt_s=probe.rtt_ms / 1e3)
        if self._policy.bandwidth(dst) is None or self._mb_compute_s is None:
            return "none"  # nothing known of the link or the stage's compute yet
        return codecs.spec(*self._policy.decide(dst, raw_bytes, self._mb_compute_s * NEGLIGIBLE_TRANSFER, kind))

    async def _send_to(self, dst: str, kind: str, step: int, mb: int, t: torch.Tensor) -> None:
        codec = self._codec_for(kind, dst, t.numel() * 4)
        lossy_grad = kind == GRAD and codec.startswith("topk")
        header, bufs = encode_tensor(kind, self.job.job_id, self.smap.epoch, step, mb, self.peer.peer_id, t, codec,
                                     self._feedback if lossy_grad else None, (dst, mb))
        self.codecs_used[f"{kind}->{self.smap.name_of(dst)}"] = codec
        nbytes = sum(b.nbytes for b in bufs) + 256  # + header, about
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.job.recv_timeout_s
        while True:
            url = self.peer.data_url_of(dst)
            t0 = loop.time()  # this attempt's: refusals and waits before it say nothing of the link
            try:
                if url is None:
                    raise ConnectionError(f"no live address for {self.smap.name_of(dst)}")
                await self.peer.client.send(url, kind, header, bufs, timeout=max(1.0, deadline - loop.time()),
                                            link=self.peer.link_to(dst))
                per = self.wire_bytes.setdefault(step, {})
                per[dst] = per.get(dst, 0) + nbytes
                elapsed = loop.time() - t0
                probe = self.probes.get(dst)
                rtt = probe.rtt_ms / 1000 if probe is not None and probe.rtt_ms else 0.0
                # an epoch's first step meets peers still loading and setting up their stages: its
                # transfers' times say more about them than about the links
                if step > self.smap.start_step:
                    # a send waits for its reply: a whole round trip of it is not the bytes' time
                    self.passive.observe(dst, nbytes, elapsed, latency_s=rtt)
                    if kind != GSUM:
                        self._policy.observe(dst, nbytes, max(0.0, elapsed - rtt / 2))  # to delivery
                return
            except RemoteError as e:
                if e.status != 503 or loop.time() > deadline:
                    raise StepFailed(f"{self.smap.name_of(dst)} refused {kind} step {step} mb {mb}: {e}") from None
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                if loop.time() > deadline:
                    raise StepFailed(f"cannot send {kind} to {self.smap.name_of(dst)}: {e!r}") from None
            await asyncio.sleep(0.2)
