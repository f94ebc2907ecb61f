"""A peer's part in training: adopt the job, agree on the stage map, run its stage step by step.

There is no coordinator process. The peer that starts the swarm publishes the job in the DHT;
every peer checks it can run it, measures its device and links (``measuring``) and says so (state
``ready``). The elected planner (``coordinator``) publishes signed stage maps (``run_records``); every
peer adopts the newest one it sees and runs its stage: activations and gradients go peer to peer
(``transport``), replicas of a stage sum their gradients (``gradsum``), each step's state is kept
and copied for recovery (``recovery``); an epoch's stage is built by ``stage_setup``. This module
keeps the life cycle and the step loop; each component is a room of its own.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..pipeline import schedule as sched
from ..pipeline.executor import StepFailed
from ..pipeline.loss_scale import nonfinite, unscale_
from ..pipeline.messages import ACT, GRAD, REPLICA_KINDS
from ..robust.attacks import BOUNDARY
from ..plan.islands import data_steps
from ..plan.stagemap import StageMap
from ..swarm.membership import BadRecordLog, read_interval
from . import loop_cpu
from . import cpu_use, memory_use, report as run_report
from ..models.checkpoint import CheckpointDir, dump_grads, write_layers
from .coordinator import Coordinator
from ..data.share import MANIFEST, SHARD, DataShare
from ..job.dataset import open_data, with_data
from ..models.devices import is_out_of_memory, peak_flops, resolve_device
from .defence import Defence
from .verifier import ATTEST_KIND, FETCH_KIND, SUSPECT_KIND, Verifier
from .gradsum import GradientSum
from .histories import StepRows, Throughput
from ..job.spec import JobRefused, JobSpec, ModelHandle, check_compatible
from .measuring import Measuring
from .lane_hops import LANE_KIND, LaneHops, no_lanes
from ..islands.exchange import OUTER, OUTER_FETCH, OUTER_MEMBERS, OuterSync
from ..models.precision import COMPUTE_DTYPES
from . import overflow, planning
from ..models import workload
from .planning import model_profile
from .run_records import MAP_POLL_S, RunRecords, map_states, ready_peers
from .recovery import Recovery, recent_rows
from .stage_setup import Stage, setup_stage
from .transport import PipelineTransport

log = logging.getLogger("spantrain.train")
MAX_WHY = 200  # characters of why an epoch was abandoned, in this peer's record (the planner quotes it when it stops a run)
KEEP_TIMELINES = 4  # steps whose op-by-op timeline a peer keeps for /report (spantrain report draws one)



@dataclass(frozen=True)
class TrainOptions:
    job: Optional[JobSpec] = None  # set on the peer that defines the swarm's job
    allowed_models: tuple[str, ...] = ()  # user models this peer agrees to import (its --model)
    dump_grads_dir: Optional[str] = None  # save this stage's gradients of step dump_step here
    dump_step: int = 0
    checkpoint_dir: Optional[str] = None  # where this peer writes its stage's checkpoints
    resume_dir: Optional[str] = None  # a checkpoint directory this peer reads layer states from
    data: Optional[str] = None  # this peer's copy of the job's data set (default: the path the job names)
    tokenizer: Optional[str] = None  # likewise, its tokenizer
    data_cache: Optional[str] = None  # where it keeps tokenized shards (default: corpus.default_cache_dir())
    device: str = "auto"  # where this peer's layers run (models.devices.resolve_device)
    measure: bool = True  # profile the device and probe links before saying ready
    measure_only: bool = False  # stop after measuring (spantrain swarm --measure-only)
    lanes: bool = False  # steps on the compute thread, tensors on lanes where a hop can have one (train.lane_hops)
    profile_cache_dir: Optional[str] = None
    poll_s: float = 0.5
    byzantine: str = ""  # the attack harness: send forged contributions (robust.attacks); "" honest


class Trainer:
    def __init__(self, peer, options: TrainOptions):
        self.peer = peer
        self.opts = options
        self.job: Optional[JobSpec] = None
        self.handle: Optional[ModelHandle] = None
        self.smap: Optional[StageMap] = None  # the map this peer runs (its island's, where the map has islands)
        self.full_map: Optional[StageMap] = None  # the map as published
        self.island: Optional[int] = None
        self.stage: Optional[int] = None
        self.step = 0  # the step being run (or next to run)
        self.steps_done = 0
        self.losses: dict[int, float] = {}  # step -> mean loss of this peer's micro-batches (last stage)
        self.loss_sums = StepRows()  # step -> (sum of micro-batch losses, count, epoch)
        self.step_times: list[tuple[int, float, float, int]] = []  # (step, start unix, end unix, epoch)
        self.throughput = Throughput()  # the step times grouped for /status
        self.compute_s: list[float] = []
        self.stash_peak_bytes = 0  # the most activation bytes held at once in any step (``pipeline.memory``)
        self.memory_state: Optional[dict] = None  # weights, gradients, optimizer state as measured (``memory_use``)
        self.memory_predicted: Optional[dict] = None  # the planner's figures for this peer in the map in force
        self.recompute = "none"  # this peer's stage's lever in the map in force
        self.recompute_transient = 0  # with it: the most one layer keeps, held while it is recomputed
        self.events: list[dict] = []  # recoveries, for the run summary
        self.timelines: dict[int, dict] = {}  # the last KEEP_TIMELINES steps: what this peer did when
        self.epochs_adopted: set[int] = set()  # the stage-map epochs this peer followed
        self.error: Optional[str] = None
        self.refused: Optional[str] = None
        self.crashed = False  # the trainer died of an unexpected error (the peer then leaves)
        self.finished = asyncio.Event()
        self.device_base = None  # the (virtual) device's counters when training began
        self.cpu = cpu_use.CpuMeter()  # the process's CPU against its training threads' since training began
        self.torch_device = resolve_device(options.device)  # where the layers live
        planning.measure_stash_on(self.torch_device)  # the planner's memory figures are this device's
        self.work: Optional[dict] = None  # this peer's tokens and model FLOPs per step (report.stage_work)
        self.peak: Optional[tuple[float, str]] = None  # its device's peak FLOP/s, and where the figure comes from
        self.data = None  # dataset.RunData: the job's batches on this peer
        self.skipped: list[int] = []  # fp16: steps every peer skipped (their gradients overflowed)
        self.loss_scale: Optional[float] = None  # fp16: the scale the next step runs with
        self._train_task: Optional[asyncio.Task] = None
        log_bad = BadRecordLog("DHT entry", log)  # an invalid DHT entry is said once, whoever reads it
        self.measuring = Measuring(peer, log_bad, options.profile_cache_dir)
        self.measuring.torch_device = self.torch_device
        self.records = RunRecords(peer, log_bad, options.poll_s)
        self.transport = PipelineTransport(peer, self.measuring.probes, self.measuring.passive, lambda: self.step)
        self.recovery = Recovery(peer, self.measuring.rtt_ms, self.events.append)
        self.data_share = DataShare(peer)
        self.coordinator = Coordinator(peer, self.records, self.recovery, log_bad, options.measure, options.poll_s)
        self.outer = OuterSync(peer, self.events.append)  # islands: the exchange between them
        self.defence = Defence(peer, self.events.append)  # the replicas' verdicts on each other
        self.verifier = Verifier(peer, self.defence, self.transport)  # and their checks of each other's work
        self.transport.sent_hook, self.transport.received_hook = self.verifier.sent, self.verifier.received
        self.lanes_refused: set[int] = set()  # epochs whose stage could not run on lanes (said once)
        if options.lanes:
            self.transport.lanes = LaneHops(self.transport, peer.client.max_message_bytes)
        self.defence.on_suspect = self.verifier.name_suspect
        self.outer.attack = options.byzantine if options.byzantine not in BOUNDARY else ""
        self.outer.on_verdict = lambda r, report: self.defence.judge_islands(r, report, self._island_peers)
        # the step being run -> (the data step it trains on, its first micro-batch there): islands train
        # data steps not their own, and with --island-split a part of one
        self._data_of: dict[int, tuple[int, int]] = {}
        self.coordinator.outer = self.outer  # where a map with islands resumes from
        peer.before_serving(self._install)

    def _install(self, peer) -> None:
        for kind in (ACT, GRAD, *REPLICA_KINDS):
            peer.dataplane.register(kind, self.transport.on_tensor, inline=True)
        # (without --lanes too: a sender asking hears 409, and sends through the loop)
        peer.dataplane.register_lane(LANE_KIND, self.transport.lanes.accept if self.transport.lanes else no_lanes)
        peer.dataplane.register(ATTEST_KIND, self.verifier.on_attest)
        peer.dataplane.register(FETCH_KIND, self.verifier.on_fetch)
        peer.dataplane.register(SUSPECT_KIND, self.verifier.on_suspect)
        peer.dataplane.register("ckpt", self.recovery.on_ckpt)
        peer.dataplane.register("fetch", self.recovery.on_fetch)
        self.records.install(peer.dataplane)
        peer.dataplane.register(OUTER, self.outer.on_outer)
        peer.dataplane.register(OUTER_FETCH, self.outer.on_fetch)
        peer.dataplane.register(OUTER_MEMBERS, self.outer.on_members)
        peer.dataplane.register(MANIFEST, self.data_share.on_manifest)
        peer.dataplane.register(SHARD, self.data_share.on_shard)
        peer.dataplane.add_json_get("/inventory", self.inventory)
        peer.dataplane.add_json_get("/report", self.report)
        peer.dataplane.add_json_get("/measurements", self.measuring.view)
        peer.status_extras["train"] = self.status
        # a peer of the current stage map is a member, even before this peer's next look at the DHT
        peer.member_checks.append(lambda pid: self.full_map is not None and self.full_map.stage_of(pid) is not None)
        # with a job: a peer without a map yet, the planner and its standby read the members every poll
        peer.watch_checks.append(lambda: None if self.job is None else self.smap is None or self.coordinator.election.watches)

    def _island_peers(self, island: int) -> list[str]:
        """The peers of ``island`` in the map as published (the exchange judges by island)."""
        islands = self.full_map.island_peers() if self.full_map is not None else []
        return islands[island] if 0 <= island < len(islands) else []

    # ---- what the outside sees ----------------------------------------------------------------------
    def status(self, brief: bool = False) -> dict:
        return run_report.status(self, brief)

    def report(self) -> dict:
        return run_report.report(self)

    def inventory(self) -> dict:
        return {**self.recovery.page(), "step": self.step, "epoch": self.smap.epoch if self.smap else None,
                "outer": self.outer.inventory()}

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
        if self.opts.job is not None:
            job = self.opts.job
            if job.data and not job.data_fingerprint:  # the data set and tokenizer this job names, hashed
                job = await asyncio.to_thread(with_data, job, job.data, job.tokenizer, self.opts.data_cache)
                job = replace(job, fingerprint="")  # the vocabulary may have grown to the tokenizer's
            # off the loop: hashing a model builds it (seconds for a large one), and meanwhile the peer
            # must answer /status and the joiners' DHT pings
            self.job = job if job.fingerprint else await asyncio.to_thread(job.finalized)
            await self.records.publish_job(self.job)
            # the record says so at once: peers waiting for a job read the job key when one does
            await self.peer.set_state(self.peer.state, job=self.job.job_id)
        else:
            self.job = await self.records.await_job()
        self.handle = await asyncio.to_thread(check_compatible, self.job, self.opts.allowed_models)
        # the model's layer count, boundary shapes and planner profile, worked out once and off the loop
        await asyncio.to_thread(lambda: (self.handle.warm(), model_profile(self.job)))
        self.data = await asyncio.to_thread(open_data, self.job, self.opts.data, self.opts.tokenizer,
                                            self.opts.data_cache)
        self.data_share.start(self.data)
        self.records.start(self.job, self.handle.num_layers)
        self.transport.start(self.job)
        self.defence.start(self.job)
        self.verifier.start(self.job)
        self.transport.check = self.defence.check_boundary
        if self.job.workload:  # the emulated world trains the workload: its bytes on the links
            self.transport.charges = await asyncio.to_thread(workload.charges, self.job, self.handle)
            self.recovery.charges = self.outer.charges = self.transport.charges
        resume = None
        if self.opts.resume_dir:
            try:
                resume = CheckpointDir(self.opts.resume_dir, self.job.fingerprint, self.job.optimizer)
            except ValueError as e:
                raise JobRefused(str(e)) from None
        self.recovery.start(self.job, self.handle, resume)
        self.peer.spawn(self.records.refresh_job(), "refresh-job")
        log.info("job %s: model %s (%d layers), %d steps of %d x %d samples, schedule %s", self.job.job_id,
                 self.job.model, self.handle.num_layers, self.job.steps, self.job.num_micro_batches,
                 self.job.micro_batch_size, self.job.schedule)
        if self.opts.measure:
            await self.peer.set_state("measuring")
            await self.data_share.ensure(0, [0])  # the profile's sample
            await self.measuring.run(self.job, self.handle, self.data.batch)
            if self.opts.measure_only:
                await self.peer.set_state("done")
                return
        await self.peer.set_state("ready")
        self.coordinator.start(self.job, self.handle, has_map=lambda: self.smap is not None)
        self.peer.spawn(self._watch_epochs(), "watch-epochs")
        await self._epochs()

    async def _epochs(self) -> None:
        """Follows stage maps until the job is done: train on each, and when an epoch breaks
        (a peer died, a newer map came), go back to the newest map and redo from its start step."""
        while True:
            smap = await self.records.await_map(
                self.smap.head if self.smap else (0, 0),
                lambda: f"{len(ready_peers(self.peer))} of {self.job.peers} peers ready")
            if smap.error:
                raise StepFailed(f"the planner stopped the run: {smap.error}")
            self.full_map, self.island = smap, smap.island_of(self.peer.peer_id)
            self.peer.plan_peers = frozenset(smap.members())
            try:
                await self.peer.read_for_map(self.peer.plan_peers)  # their addresses, before the first send
            except Exception as e:  # the sends retry; the next read brings them
                log.warning("reading the members of stage map epoch %d failed: %s", smap.epoch, e)
            self.defence.adopt(smap)
            if self.island is not None:  # islands: this peer runs its island's pipeline
                smap = smap.island_map(self.island)
            self.smap, self.stage = smap, smap.stage_of(self.peer.peer_id)
            self.recovery.adopt(smap, islands=bool(self.full_map.islands))
            self.epochs_adopted.add(smap.epoch)
            self.transport.begin_epoch(smap, self.stage)
            self.verifier.begin_epoch(smap)
            self.step = smap.start_step
            if self.stage is None:
                log.info("not in stage map epoch %d: standing by as a spare", smap.epoch)
                await self.peer.set_state("ready", epoch=smap.epoch)
                if await self._spare_until_done(smap):
                    log.info("the job is done (stage map epoch %d ran it to the end without this peer)", smap.epoch)
                    await self.peer.set_state("done")
                    return
                continue
            self._train_task = asyncio.create_task(self._train())
            try:
                await self._train_task
            except (StepFailed, asyncio.CancelledError, RuntimeError) as e:
                # a failed step or setup, a device out of memory anywhere in the epoch (building, measuring:
                # another process on the GPU may take what this one had) and a cancelled epoch abandon the
                # epoch; this trainer being cancelled (its peer stops) does not, nor does any other error
                if isinstance(e, RuntimeError) and not isinstance(e, StepFailed) and not is_out_of_memory(e):
                    raise
                if isinstance(e, asyncio.CancelledError) and (
                        asyncio.current_task().cancelling() or not self._train_task.cancelled()):
                    raise
                why = str(e) or f"stage map epoch {smap.epoch} superseded"
                log.warning("epoch %d abandoned at step %d: %s", smap.epoch, self.step, why)
                self.events.append({"kind": "abandoned", "epoch": smap.epoch, "step": self.step, "t": time.time(),
                                    "reason": why[:300]})
                await self.peer.set_state("recovering", failed_epoch=smap.epoch, failed_why=why[:MAX_WHY].encode("utf-8", "replace").decode(),
                                          **memory_use.out_of_memory_progress(
                    e, self.memory_predicted, self.peer.progress))
                continue
            finally:
                self._train_task = None
            # the job's last step is done here, not yet on every peer of the map: a newer map (a re-plan
            # as the run ended) redoes it on them, and needs this peer (from its snapshots); left, the
            # others waited for its tensors for ever
            if await self._spare_until_done(smap):
                return
            log.info("a newer stage map came before every peer of epoch %d was done: taking part", smap.epoch)

    async def _spare_until_done(self, smap: StageMap) -> bool:
        """A spare waits for a newer map (False) or for the peers of ``smap`` to finish the job (True:
        every one of them that is still a member says it is done, or, none left, one left done:
        ``Peer.gone_done``), so that it does not wait forever.
        It follows their records (``Peer.followed``: read when a SWIM message says they changed);
        done, it reads those not yet done at once and then as often as a peer that does not watch
        reads the members (``membership.read_interval`` of them), a spare (its map just begun) every
        ``quiet_s``: a peer that watches no members read none, and a done peer waited for its map's
        peers, "training" in its view, for ever (a LocalSwarm of 4, every peer done: 3 runs in 9 at
        20:03-20:12 UTC, and CI's on 9f9d7af)."""
        done = self.peer.state == "done"
        self.peer.followed = frozenset(smap.members())
        read_at = None if done else time.monotonic()
        try:
            while True:
                try:
                    newest = await self.records.newest_map(self.records.quiet_s())
                except Exception as e:  # read again: not the error of a spare or of a trainer whose job is done
                    log.info("reading the stage maps failed: %s", e)
                    await self.records.news_or(MAP_POLL_S)
                    continue
                if newest is not None and newest.epoch > smap.epoch:
                    return False
                states = map_states(self.peer, smap)
                if (states or self.peer.gone_done & self.peer.followed) and all(v == "done" for v in states.values()):
                    return True
                waiting = [p for p, v in states.items() if v != "done" and p != self.peer.peer_id]
                cfg = self.peer.config
                gap = read_interval(len(waiting), cfg.poll_s, False, cfg.view_records_per_poll) if done \
                    else self.records.quiet_s()
                if waiting and (read_at is None or time.monotonic() - read_at >= gap):
                    read_at = time.monotonic()
                    try:
                        await self.peer.read_records(waiting)
                    except Exception as e:  # read again after the gap
                        log.info("reading the records of %d peer(s) of stage map epoch %d failed: %s",
                                 len(waiting), smap.epoch, e)
                    continue
                await self.records.news_or(MAP_POLL_S)
        finally:
            self.peer.followed = frozenset()

    async def _watch_epochs(self) -> None:
        """Aborts the running epoch as soon as a newer stage map is out: no waiting on a dead peer."""
        while True:
            await self.records.news_or(MAP_POLL_S)
            task, cur = self._train_task, self.smap
            if task is None or cur is None or task.done():
                continue
            try:
                newest = await self.records.newest_map(self.records.quiet_s())
            except Exception:
                continue
            if newest is not None and newest.head > cur.head and self._train_task is task:
                task.cancel()

    # ---- a stage's steps ----------------------------------------------------------------------------
    async def _train(self) -> None:
        st = await setup_stage(self)
        self.cpu.start()
        loop_cpu.begin()
        if self.device_base is None and self.peer.device is not None:
            self.device_base = self.peer.device.stats()
        if self.peak is None:  # for MFU: an emulated peer's is its virtual device's
            self.peak = (self.peer.device.flops_per_s, "virtual device") if self.peer.device is not None else \
                await asyncio.to_thread(peak_flops, self.torch_device, COMPUTE_DTYPES.get(self.job.precision, torch.float32))
        await self.peer.set_state("training", epoch=self.smap.epoch)
        try:
            if self.island is not None:
                await self._train_rounds(st)
            else:
                for step in range(self.smap.start_step, self.job.steps):
                    await self._run_step(st, step)
        finally:
            st.executor.close()
            loop_cpu.end(self.peer.config.name or self.peer.peer_id)
        await self.peer.set_state("done")
        log.info("training done: %d steps", self.steps_done)

    def _micro_batches(self) -> int:
        """Micro-batches in one of this peer's steps: the job's, or an island's share (``--island-split``)."""
        return self.job.num_micro_batches // (self.job.island_split if self.island is not None else 1)

    def _batch(self, step: int, mb: int):
        """The executor's data: the step's own, or with islands the (part of the) data step this local
        step trains on."""
        ds, first = self._data_of.get(step, (step, 0))
        return self.data.batch(ds, first + mb)

    async def _train_rounds(self, st: Stage) -> None:
        """Islands: this island's rounds, each its steps on its own data steps, then the exchange
        (``outer_sync``): the previous round's contributions merged, this round's sent."""
        full, k, job = self.full_map, self.island, self.job
        H = [x.steps_per_round for x in full.islands]
        layers = {st.first + i: [p for p in layer.parameters() if p.requires_grad] for i, layer in enumerate(st.layers)}
        v = self.smap.start_step  # the round to start at: 0, or where a re-plan resumes
        state = await self.outer.state_at(v, layers, await self.recovery.inventory_pages(),
                                          self.measuring.rtt_ms) if v > 0 else None
        self.outer.begin(job, full, k, layers, self.handle.num_layers, start_round=v, state=state)
        step = self.smap.start_step
        per = self._micro_batches()
        r, base = v, full.start_data_step
        while base < job.steps:
            _r, _b, dsteps = next(data_steps(H, k, job.steps, start_round=r, first_data_step=base))
            for ds in dsteps:
                for part in range(job.island_split):  # --island-split: a data step in parts
                    await self._run_step(st, step, ds, part * per)
                    step += 1
            nxt = min(base + sum(H), job.steps)
            fig = await self.outer.round_end(r, len(dsteps) * job.samples_per_step * job.seq_len, nxt,
                                             last=nxt >= job.steps)
            log.info("island %d round %d: %d steps, waited %.3fs for round %d's exchange", k, r, len(dsteps),
                     fig["wait_s"], r - 1)
            if "rejoin" in fig:  # left out and fallen behind: the rounds between are lost to this island
                r, base = fig["rejoin"]
                log.warning("island %d rejoins at round %d (data step %d)", k, r, base)
            else:
                r, base = r + 1, nxt

    async def _run_step(self, st: Stage, step: int, data_step: Optional[int] = None, first_mb: int = 0) -> None:
        """One step: the pipeline, the replicas' gradient sum, the optimizer, the snapshot. With
        islands, ``step`` counts this island's steps and ``data_step`` is the data it trains on from
        micro-batch ``first_mb`` (losses and step times are reported by data step: the order of the
        tokens seen; the parts of a split data step add up to its loss)."""
        job, smap, me = self.job, self.smap, self.peer.peer_id
        self.step = step
        ds = step if data_step is None else data_step
        self._data_of = {step: (ds, first_mb)}
        if self.stage == 0 or st.is_last:  # the stages that read data: their shards are here first
            await self.data_share.ensure(ds, [first_mb + a.mb for a in st.actions if a.op is sched.Op.F])
        t0 = time.time()
        gsum = None
        if len(st.replicas) > 1:
            gsum = GradientSum(self.transport, me, step, st.params, st.buckets, [p for p in st.replicas if p != me],
                               sanitize=st.scale is not None, weights=st.weights,
                               attack=self.outer.attack if self.island is None else "",  # islands: their exchange
                               previous=self.defence.previous, seen=self.defence.seen, gate=self.defence.gate,
                               owners=st.sharding.bucket_owner if st.sharding else None)
        st.executor.loss_scale = st.scale.scale if st.scale is not None else None
        checks = self.verifier.begin_checks(step, st) if gsum is not None else None  # beside the step
        try:
            result = await st.executor.run_step(step, st.actions, gsum.layer_done if gsum else None,
                                                gsum.losses_done if gsum and st.is_last else None)
        except BaseException:
            if gsum is not None:
                await gsum.cancel()
            await self.verifier.drop_checks(checks)
            raise
        t_pipe = time.time()
        loss_sum, loss_count = sum(result.losses), len(result.losses)
        if gsum is not None:
            try:
                total = await gsum.finish((loss_sum, loss_count) if st.is_last else None)
            except BaseException:
                await self.verifier.drop_checks(checks)
                raise
            if total is not None:
                loss_sum, loss_count = total
            self.defence.judge(step, gsum.reports, sorted(gsum.replayed), gsum.odd_inputs)
            await self.verifier.end_checks(step, st, checks)  # before the optimizer step: the weights are equal
        skip = False
        if st.scale is not None:  # fp16: every peer skips the step if any overflowed, or none does
            found = st.executor.overflowed or gsum is not None and gsum.overflowed or \
                nonfinite(p.grad for p in st.params)
            skip = await overflow.agree(self.transport, smap, me, step, found)
            if skip:
                self.skipped.append(step)
                log.info("step %d: gradients overflowed at loss scale %g: skipped on every peer", step, st.scale.scale)
            else:
                unscale_(st.params, st.scale.scale)
            st.scale.update(skip)
            self.loss_scale = st.scale.scale
        t_sum = time.time()
        if self.opts.dump_grads_dir and step == self.opts.dump_step:
            dump_grads(self.opts.dump_grads_dir, st.layers, st.first, step, me)
        if not skip:
            def update():  # on the thread (and so the stream) of the step: after the last snapshot's copies
                self.recovery.before_update()
                st.opt.step()

            await st.executor.on_compute_thread(update)
        if self.memory_state is None:  # the gradients and the optimizer's state are all there now
            self.memory_state = memory_use.held_state(st.params, st.opt)
            st.executor.state_bytes = self.memory_state["state"]
        st.opt.zero_grad(set_to_none=True)
        for p in st.params:  # (a sharded stage's optimizer holds its own layers' only)
            p.grad = None
        if st.sharding is not None and not skip:  # the owners' new weights to every replica
            await st.sharding.gather(self.transport, step, st.params)
        arrivals = self.transport.take_arrivals(step)
        self.transport.drop_before(step + 1)
        t1 = time.time()
        self.step_times.append((ds, t0, t1, smap.epoch))
        self.throughput.add(ds, t0, t1)
        ops = [list(x) for x in result.timeline]
        if gsum is not None or st.scale is not None:
            ops.append(["SUM", -1, t_pipe, t_sum])  # the replicas' gradient sum (and fp16's vote)
        ops.append(["OPT", -1, t_sum, t1])
        self.timelines[step] = {"step": step, "epoch": smap.epoch, "stage": self.stage, "start": t0, "end": t1,
                                "ops": ops, "core_wait_s": result.core_wait_s, "arrivals": arrivals}
        for old in [k for k in self.timelines if k <= step - KEEP_TIMELINES]:
            del self.timelines[old]
        self.compute_s.append(result.compute_s)
        self.cpu.add_thread(st.executor.take_thread_cpu())
        self.stash_peak_bytes = max(self.stash_peak_bytes, result.stash_peak_bytes)
        if st.actions:
            self.transport.observe_compute(result.compute_s / max(1, sum(a.op is sched.Op.F for a in st.actions)))
        self.steps_done += 1
        if loss_count:
            if first_mb and ds in self.loss_sums:  # a later part of a split data step
                before, n_before, _ep = self.loss_sums[ds]
                loss_sum, loss_count = loss_sum + before, loss_count + n_before
            self.loss_sums[ds] = (loss_sum, loss_count, smap.epoch)
            self.losses[ds] = loss_sum / loss_count
        self.step = step + 1
        self.peer.progress = {**self.peer.progress, "step": self.step}  # in the DHT with the next heartbeat
        states = None
        if self.island is None:  # (islands resume from their outer state: islands.exchange)
            states = self.recovery.snapshot(smap, self.stage, st.layers, st.opt, st.first, self.step,
                                            recent_rows(self.loss_sums, ds),
                                            st.scale.state() if st.scale is not None else (),
                                            st.sharding.foreign if st.sharding else None)
        run_report.log_step(log, step, ds, self.losses[ds] if loss_count else None, (t0, t_pipe, t_sum, t1),
                            result.compute_s)
        if states and job.checkpoint_every and self.step % job.checkpoint_every == 0 and self.opts.checkpoint_dir:
            self.recovery.settle()
            write_layers(self.opts.checkpoint_dir, job.fingerprint, job.optimizer, self.step, states, job.to_dict())
