"""Measuring a peer's device and links for the planner, and keeping the link figures current.

Once the swarm has settled, each peer profiles the job's layers on its device (F, B, W per layer)
and publishes the profile in the DHT; when every peer has profiled, all ping all at once, then the
short links again in quiet slots (``decide.ping_slots``), then each probes bandwidth in turns.
While training, the passive estimate of real transfers replaces a link's probed bandwidth when it
changed much (weather)."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Optional

from ..net.passive import FlapDamper, PassiveEstimator, link_update
from ..net.ping import paired_rtt, ping_links
from ..net.prober import probe_link
from ..profile import step_tail
from ..profile.profiler import profile_layers
from ..swarm import measure
from ..swarm.probe_plan import FULL_MESH_MAX_PEERS, ping_targets, probe_budget, probe_targets
from ..job.offload import copies_only
from ..job.optim import make_optimizer
from ..models import workload
from .decide import REPLAN_CHECK_S, ping_slots

log = logging.getLogger("spantrain.train")

# links whose round trip reads under this are pinged again in a quieter moment (see ping_phase)
SHORT_RTT_S = 0.010
QUIET_SLOT_S = 0.5  # one turn of pinging short links again
PING_AT_ONCE = 8  # members a joiner of a large swarm pings at a time (``ping_targets``: 24 of them)
MEASURING = ("joining", "idle", "measuring")  # the states of a peer that measures (or is about to)


PASSIVE_PER_PEER_S = 1.0
# a transfer smaller than this is not timed for the passive estimate: a replica's 264-byte loss, the
# first message on its link in an epoch, read a 1 Gbit/s link at 13-15 Mbit/s (its 0.16 ms were
# the send's own fixed cost) and was published as a drop (cee-3region, 2026-12-01); the smallest
# activations timed live, trace-drop's, are 32 KiB
PASSIVE_MIN_BYTES = 16 << 10
# no estimate of a link from fewer transfers than this: an epoch's first gradient part between two
# replicas, 5 ms for 1.6 ms of bytes, was published as a drop of their 1 Gbit/s link to 322 Mbit/s;
# four degrade runs' logged transfers, replayed, read 1 Gbit/s links at 310-346 Mbit/s four times
# from their first transfer (three between replicas, one from a stage to the next), never from two
# or more, and the cut links under half 1.2-2.0 s after the cut either way
PASSIVE_MIN_COUNT = 3


def step_tail_rate(job, layers: list, torch_device=None) -> float:
    """The optimizer's step and the snapshot's copies on this device, seconds per byte of the weights
    the planner prices (``profile.step_tail``): with ``--workload`` the proxy's weights are stepped,
    so its seconds are spread over the workload's bytes. Blocking."""
    tail = step_tail.measure(layers, lambda ps: make_optimizer(replace(job, offload_optimizer=False), ps),
                             torch_device=torch_device)
    if job.workload:
        from .planning import model_profile

        proxy = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
        planned = sum(x.param_bytes for x in model_profile(job).layers)
        tail *= proxy / planned if planned > 0 else 0.0
    return tail


class Measuring:
    """This peer's measurements: its device ``profile``, its ``probes`` (peer id -> link
    measurement), the ``passive`` estimator fed by real transfers; ``measured`` is set once every
    member's link is probed. ``log_bad(subkey, reason)`` says (once) that a DHT entry is invalid."""

    def __init__(self, peer, log_bad: Callable[[object, str], None], profile_cache_dir: Optional[str] = None):
        self.peer, self.log_bad, self.profile_cache_dir = peer, log_bad, profile_cache_dir
        self.torch_device = None  # where the layers run (--device; the trainer sets it): the profile runs there
        self.job = None
        self.profile = None  # profile.profiler.DeviceProfile of this peer
        self.probes: dict[str, Any] = {}  # peer id -> net.prober.LinkMeasurement
        self.probe_seconds = 0.0
        self.probe_window: list[float] = []  # [unix start, unix end] of this peer's probing
        self.measured = asyncio.Event()
        # bytes/s of real transfers, per destination; a message under PASSIVE_MIN_BYTES (a loss, a
        # flag) is all fixed cost and says nothing of a link's bandwidth, nor does a lone transfer
        self.passive = PassiveEstimator(min_bytes=PASSIVE_MIN_BYTES, min_count=PASSIVE_MIN_COUNT)
        self._probed: dict = {}  # destination -> the probe's measurement, before any passive update
        self._passive_published = 0.0
        self._damper = FlapDamper(REPLAN_CHECK_S)  # links whose passive figure goes down and up, held back

    def rtt_ms(self, peer_id: str) -> float:
        """Probed RTT to a peer (nearest first when choosing a buddy or a source); unknown: last."""
        m = self.probes.get(peer_id)
        return m.rtt_ms if m is not None and m.rtt_ms else 1e9

    def tflops(self) -> Optional[float]:
        """Measured speed in the scenario's units (a virtual device's real FLOP/s divided by its scale)."""
        if self.profile is None:
            return None
        scale = self.peer.device.scale if self.peer.device else 1.0
        return self.profile.effective_tflops / scale

    def view(self) -> dict:
        """This peer's own measurements, for the operator (names as the peers call themselves)."""
        dev = self.peer.device
        return {"peer": self.peer.config.name or self.peer.peer_id,
                "profile": self.profile.to_dict() if self.profile else None,
                "tflops": self.tflops(), "scale": dev.scale if dev else 1.0,
                "memory_gb": round(self.profile.memory_bytes / 2**30, 3) if self.profile else None,
                "links": {self.peer.name_of(p): m.to_dict() for p, m in self.probes.items()},
                "probe_seconds": round(self.probe_seconds, 3), "probe_window": self.probe_window,
                "device_stats": dev.stats().to_dict() if dev else None,
                "fidelity": dev.fidelity() if dev else None, "complete": self.measured.is_set()}

    # ---- the device -------------------------------------------------------------------------------
    async def run(self, job, handle, batch) -> None:
        """Profiles the device, starts probing the links, and returns once every member is probed.
        ``batch(step, micro_batch)``: the job's data, for the profile's sample."""
        self.job = job
        # measure a settled swarm: peers still starting up (their daemons, DHT nodes) would steal the CPU
        while len(self.peer.live_members()) < job.peers:
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)
        # off the loop: building a large model takes seconds, and the peer must go on answering meanwhile
        layers = await asyncio.to_thread(
            lambda: [layer.to(self.torch_device) for layer in handle.build(0, handle.num_layers)])
        inputs, targets = batch(0, 0)
        # --workload: the virtual device pads each op to the workload's FLOPs (it never reads the scenario)
        wl_flops = workload.layer_flops(job, 0, handle.num_layers) if job.workload and self.peer.device else None

        async def profile(cache_dir):
            dev, report = self.peer.device, {}
            before = dev.stats() if dev is not None else None
            self.profile = await asyncio.to_thread(
                profile_layers, layers, (job.micro_batch_size, job.seq_len), device=dev, cache_dir=cache_dir,
                fingerprint=f"{job.fingerprint}-{job.micro_batch_size}x{job.seq_len}" +
                (f"-{job.workload}x{job.workload_seq_len}" if job.workload else ""), inputs=inputs, targets=targets,
                report=report, torch_device=self.torch_device, layer_flops=wl_flops)
            tail = await asyncio.to_thread(step_tail_rate, job, layers, self.torch_device)
            host = copies = 0.0
            if job.offload_optimizer:  # its step runs on this host's CPU: timed there (the device's, on a CPU device)
                cpu = getattr(self.torch_device, "type", "cpu") == "cpu"
                host = tail if cpu else await asyncio.to_thread(step_tail_rate, job, layers, "cpu")
                # and its copies between the device and host memory, as the offload makes them
                copies = await asyncio.to_thread(step_tail.copy_rate, layers, copies_only, torch_device=self.torch_device)
            self.profile = replace(self.profile, step_s_per_param_byte=tail, host_step_s_per_param_byte=host,
                                   host_bytes_per_s=copies)
            if before is None:
                return [], 0.0
            after = dev.stats()
            budget_s = (after.flops - before.flops) / dev.flops_per_s
            return report.get("late_layers", []), (after.real_s - before.real_s) / budget_s if budget_s > 0 else 0.0

        late, load = await profile(self.profile_cache_dir)
        # Layers whose every repetition was late measured the host's load (all peers profile at
        # once on shared cores), unless this host can never keep up with the device (its CPU time
        # is a multiple of the budget): say so (others do not probe yet), profile again once all
        # have profiled.
        async def publish(provisional: bool):
            await measure.publish(self.peer, measure.PROFILES, {"profile": self.profile.to_dict(), "job": job.job_id,
                                                                "tflops": self.tflops(), "provisional": provisional})

        again = bool(late) and load < 3.0
        await publish(again)
        if again:
            log.info("layer(s) %s never kept up with the device's budget (a busy host): profiling again once every "
                     "peer has profiled", late)
            await self.wait_published(measure.PROFILES, {r.peer_id for r in self.peer.live_members()}, 30.0)
            late, _ = await profile(None)
            await publish(False)
        self.peer.mark("profiled")
        log.info("device profile published: %.4g TFLOP/s, %.1f ms per micro-batch through the whole model%s",
                 self.tflops(), self.profile.total_s * 1e3, f" (layers {late} never kept up)" if late else "")
        self.peer.spawn(self._probe_loop(), "probe-links")
        await self.measured.wait()

    # ---- the links --------------------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        """Probes the links to its members (``probe_plan.probe_targets``: every member up to 16, else
        its nearest and a few others; newcomers included), one link at a time."""
        # probe a quiet swarm: profiling (up to 10 s on a slow virtual device) loads the CPUs
        await self.wait_published(measure.PROFILES, {r.peer_id for r in self.peer.live_members()}, 30.0,
                                  final=lambda d: not d.get("provisional"))
        t_start = time.monotonic()
        self.probe_window = [time.time(), time.time()]
        pings = await self._ping_phase()
        self.peer.mark("pinged")
        rtts = dict(pings)  # what each target is picked by (``pings`` is handed to the probes)
        await self._wait_probe_turn()
        self.peer.mark("probe_turn")
        while True:
            others = [r for r in self.peer.live_members() if r.peer_id != self.peer.peer_id]
            targets = set(probe_targets(self.peer.peer_id, [r.peer_id for r in others], rtts))
            targeted = [r for r in others if r.peer_id in targets]
            todo = [r for r in targeted if r.peer_id not in self.probes and r.data_url]
            for r in todo:
                m = await probe_link(self.peer.client, r.data_url, r.name or r.peer_id, self.peer.emulator,
                                     rtt_s=pings.pop(r.peer_id, None))
                used = self.peer.paths.used.get(r.peer_id, {}) if self.peer.paths is not None else {}
                if used.get("path") == "relayed":  # the planner charges the relay
                    m = replace(m, via=used["via"])
                self.probes[r.peer_id] = m
                if not m.ok:
                    log.warning("link to %s unknown: %s", self.peer.name_of(r.peer_id), m.error)
            if todo:
                self.probe_seconds = time.monotonic() - t_start
                self.probe_window[1] = time.time()
                await self._publish_links()
                log.info("probed %d link(s) in %.1fs", len(self.probes), self.probe_seconds)
            if len(others) + 1 >= self.job.peers and all(r.peer_id in self.probes for r in targeted):
                self.peer.mark("probed")
                self.measured.set()
            await self._publish_passive()
            await asyncio.sleep(1.0)

    async def _publish_links(self) -> None:
        await measure.publish(self.peer, measure.LINKS, {"links": {p: m.to_dict() for p, m in self.probes.items()}})

    async def _publish_passive(self) -> None:
        """Links with real traffic: the passive estimate replaces the probe's bandwidth (weather).

        Only sizeable changes reach the DHT (see ``link_update``), at most every ``REPLAN_CHECK_S``,
        or ``PASSIVE_PER_PEER_S`` a member: each is a record told to the planner and the grouping's
        voters, who read the peer's links key (a 20-peer swarm on two busy cores republished every
        6-10 s a peer; at 1,000 peers, 1 a second swarm-wide at most); a link whose figure goes down
        and up again waits longer each time (``FlapDamper``)."""
        now = time.monotonic()
        if now - self._passive_published < max(REPLAN_CHECK_S, PASSIVE_PER_PEER_S * len(self.peer.member_ids())):
            return
        changed = False
        for dst in set(self.passive.destinations()) | set(self._probed):
            cur = self.probes.get(dst)
            if cur is None or not cur.ok:
                continue
            probed = self._probed.setdefault(dst, cur)
            bound = self.passive.lower_bound(dst)
            new = link_update(cur.mbps, probed.mbps, self.passive.estimate_mbps(dst), bound * 8 / 1e6 if bound else None)
            if new is not None and self._damper.allow(dst, cur.mbps, new, now):
                log.info("link to %s now %.1f Mbit/s (was %.1f, probed %.1f)", self.peer.name_of(dst),
                         new, cur.mbps, probed.mbps)
                self.probes[dst] = replace(cur, status="ok", mbps=new, error="")
                changed = True
        if changed:
            self._passive_published = now
            await self._publish_links()

    async def _ping_phase(self, max_wait_s: float = 20.0, at_once: int = 1) -> dict[str, float]:
        """Everybody pings everybody at once, in a quiet moment: after every peer has profiled its
        device and before anybody's bulk transfers. A ping that waits behind another prober's bulk
        transfer on a busy CPU reads a 5 ms link as 8 ms; pings alone barely load it. Returns the
        RTT per peer id (seconds), for ``probe_link(rtt_s=...)``.

        Then the short links (under ``SHORT_RTT_S``) are pinged again, by ``at_once`` peers at a
        time in time slots of ``QUIET_SLOT_S`` (``decide.ping_slots``: from a start all peers
        derive from the same published records, so waiting costs no polling): seven peers pinging
        at once on two cores scatter each ping by several ms, which a 40 ms link shrugs off and a
        1 ms one does not (it read 1.2-1.9 ms, 5 ms links up to 6.4)."""
        me = self.peer.peer_id
        members = self.peer.live_members()
        order = {r.peer_id for r in members}
        # slots for the peers that measure now: a joiner of a training swarm took a slot for every
        # member, idle turns of peers that pinged long ago (8 s of its 61 from launch to map at 16 peers)
        pinging = {r.peer_id for r in members if r.state in MEASURING} | {me}
        pings: dict[str, float] = {}
        own = self.peer.dataplane.url if self.peer.dataplane else None
        # rounds of one ping to each (every member up to 16, else a bounded sample: ``ping_targets``);
        # each peer starts its rounds with the next one in peer-id order (wrapping around), so that a
        # peer is pinged by about one other at a time
        chosen = set(ping_targets(me, [r.peer_id for r in members if r.data_url]))
        targets = sorted((r for r in members if r.peer_id in chosen), key=lambda r: (r.peer_id < me, r.peer_id))
        names = {r.name or r.peer_id: r.peer_id for r in targets}

        async def ping(rs, **kw) -> None:
            found = await ping_links(self.peer.client, [(r.name or r.peer_id, r.data_url) for r in rs],
                                     self.peer.emulator, baseline_url=own, around_emulator=True, **kw)
            for name, samples in found.items():
                if len(samples) >= 6:
                    pings[names[name]] = paired_rtt(samples)
                log.debug("pings to %s, less the baseline's round trip: %s ms", name,
                          " ".join(f"{x * 1e3:.2f}" for x in sorted(samples)))

        if own and targets:  # beyond the full mesh, a sample spread over the world: PING_AT_ONCE at a time
            await ping(targets, count=10, gap_s=0.01, min_s=0.5,
                       at_once=1 if len(members) <= FULL_MESH_MAX_PEERS else PING_AT_ONCE)
        short = [r for r in targets if r.peer_id in pings and pings[r.peer_id] < SHORT_RTT_S]
        await measure.publish(self.peer, measure.PINGS, {"peers": len(pings), "short": bool(short),
                                                         "finished": time.time()})
        await self.wait_published(measure.PINGS, order, max_wait_s)
        # peers whose record we cannot read (a newcomer, a malformed one) have no slot
        recs = await measure.read(self.peer, measure.PINGS, lambda d: (bool(d.get("short")), float(d.get("finished", 0))),
                                  self.log_bad, peer_ids=pinging)
        slots = ping_slots(recs, pinging, at_once, QUIET_SLOT_S)
        if slots is None:
            return pings

        async def sleep_until(t: float) -> None:
            # a clock far off (or a record from the future) must not stall us
            await asyncio.sleep(min(max(0.0, t - time.time()), max_wait_s))

        mine = slots.start_of(me)
        if short and mine is not None:
            await sleep_until(mine)
            await ping(short, count=12, gap_s=0.002, min_s=0.3, deadline_s=QUIET_SLOT_S * 0.9)
        await sleep_until(slots.end)  # bulk probes load the CPU: not before the last slot is over
        return pings

    async def wait_published(self, what: str, peers: set, max_wait_s: float, final=lambda d: True) -> None:
        """Until each of ``peers`` that is still measuring (or about to) has an entry under ``what``
        (one that ``final`` accepts), or ``max_wait_s``. A newcomer to a training swarm waits for
        nobody but other newcomers."""
        deadline = time.monotonic() + max_wait_s
        while time.monotonic() < deadline:
            measuring = {r.peer_id for r in self.peer.live_members() if r.state in MEASURING}
            wanted = peers & measuring
            have = {p for p, ok in (await measure.read(self.peer, what, final, self.log_bad, peer_ids=wanted)).items() if ok}
            if all(p in have for p in wanted):
                return
            await asyncio.sleep(0.5)  # DHT reads cost CPU on every peer: not too often
        log.warning("went on without every peer's %s after %.0f s", what, max_wait_s)

    async def _wait_probe_turn(self, at_once: int = 3, max_wait_s: float = 60.0) -> None:
        """Peers that measure now probe in turns of ``at_once``, in peer-id order: many concurrent
        probes would share the CPU (and the loopback) and measure each other instead of the links. A
        joiner of a training swarm waits for nobody but other newcomers (members that probed long
        ago, or could not probe all they meant to, are not ahead of it)."""
        members = self.peer.live_members()
        everyone = {r.peer_id for r in members}
        measuring = {r.peer_id for r in members if r.state in MEASURING}
        order = sorted(everyone | {self.peer.peer_id})
        mine = order.index(self.peer.peer_id)
        before = [p for p in order[: mine - mine % at_once] if p in measuring]
        # done: every other member probed, or beyond the full mesh as many links as a peer probes
        # (which ones depends on its own pings)
        done = (lambda p, got: everyone - {p} <= got) if len(everyone) <= FULL_MESH_MAX_PEERS else \
            (lambda p, got: len(got) >= probe_budget(len(everyone)))
        deadline = time.monotonic() + max_wait_s
        while before and time.monotonic() < deadline:
            links = await measure.read(self.peer, measure.LINKS, lambda d: set(d["links"]), self.log_bad, peer_ids=before)
            if all(p in links and done(p, links[p]) for p in before):
                return
            await asyncio.sleep(0.3)
