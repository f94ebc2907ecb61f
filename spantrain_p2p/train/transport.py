"""The pipeline transport: a stage's activations and gradients to and from its neighbours.

Sending: each message picks its codec (per link, ``--compression``; adaptive decides from the
link and the stage's compute), goes out with retries until the job's receive timeout, and its
bytes and time feed the passive bandwidth estimate. Receiving: the data plane's handler checks a
message against what the stage expects (kind, epoch, senders, shapes) and files it in the inbox;
a wait that runs past the adaptive deadline asks the sender whether it lives
(``swarm.liveness``) and fails the step at once if it does not."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

import aiohttp
import torch

from ..compress import codecs
from ..compress.adaptive import AdaptivePolicy
from ..net.connections import ARRIVED
from ..net.dataplane import RemoteError, Retry
from ..net.framing import FrameError
from ..pipeline.deadlines import Deadlines
from ..pipeline.executor import StepFailed
from ..pipeline.messages import ACT, AMP, GRAD, GSUM, REPLICA_KINDS, WGAT, Expect, Inbox, decode_tensor, encode_tensor
from ..plan.stagemap import StageMap
from ..swarm.liveness import is_alive
from ..models.workload import WORKLOAD_WIRE_BYTES

log = logging.getLogger("spantrain.train")

# Adaptive compression leaves a link's tensors as they are only where their transfer is negligible
# next to the stage's compute for one micro-batch; elsewhere it takes the fastest codec that meets
# the fidelity floor. FusionLLM's rule (compress until the transfer hides behind compute) holds in
# a pipeline's steady state, but its fill and drain wait on every hop's transfer, and with about as
# many micro-batches as stages (volunteer swarms) fill and drain are most of the step.
NEGLIGIBLE_TRANSFER = 0.1
STEPS_OF_PATIENCE = 3.0  # a message may take this many predicted steps before its step fails


def workload_codec_factor(t: torch.Tensor, bufs) -> float:
    """What a codec saves on the workload's activation, per byte the proxy's encoding sent: the
    workload's tensors are bf16 (``workload.WORKLOAD_WIRE_BYTES``), so a codec that halves the proxy's
    fp32 (fp16) saves nothing there, and int8 half; a message never costs more than the tensor raw."""
    raw = t.numel() * t.element_size()
    enc = sum(b.nbytes for b in bufs)
    if raw <= 0 or enc <= 0:
        return 1.0
    r = enc / raw
    return min(1.0, r * t.element_size() / WORKLOAD_WIRE_BYTES) / r


async def _take_turn(lock: asyncio.Lock) -> Callable[[], None]:
    """Waits for ``lock``; returns what gives it back, once, whoever calls it first (the message's
    last byte leaving, or the send ending without it)."""
    await lock.acquire()
    given_back = False

    def give_back() -> None:
        nonlocal given_back
        if not given_back:
            given_back = True
            lock.release()
    return give_back


def _no_turn() -> None:
    return None


class PipelineTransport:
    """Moves one stage's tensors. ``probes`` (peer id -> the prober's link measurement) choose
    codecs and tell round trips; real transfers feed ``passive`` (the bandwidth estimator);
    ``current_step`` is the step the trainer runs (messages for it and the next are taken)."""

    def __init__(self, peer, probes: dict, passive, current_step: Callable[[], int]):
        self.peer, self.probes, self.passive, self.current_step = peer, probes, passive, current_step
        self.job = None
        self.smap: Optional[StageMap] = None
        self.stage: Optional[int] = None
        self.inbox = Inbox(max_pending=64)
        # (kind, step, micro-batch) -> unix times its first byte came, its frame was whole and it was
        # filed in the inbox: an activation's or gradient's way in (``take_arrivals``; issue 31)
        self._arrivals: dict[tuple[str, int, int], tuple[float, float, float]] = {}
        self._expect: dict[str, Expect] = {}
        self._route: dict[str, list[str]] = {}  # kind -> destination peer of each micro-batch
        self.wire_bytes: dict[int, dict[str, int]] = {}  # step -> destination peer -> bytes sent
        self.codecs_used: dict[str, str] = {}  # "kind->destination name" -> last codec
        self.wire_totals: dict[tuple[str, str, str], int] = {}  # (kind, destination, codec) -> bytes sent
        self._streams: dict[str, asyncio.Lock] = {}  # destination -> its activations' and gradients' turn
        # activation gradients feed every earlier layer's update: no top-k for them (its error
        # feedback suits weight gradients, not these); 6-bit blocks (0.97) at most, like activations
        self._policy = AdaptivePolicy(fidelity_floors={"act": 0.95, "grad": 0.95})
        self._feedback = codecs.ErrorFeedback()
        self._deadlines = Deadlines()  # receive deadlines from the recent waits, per message kind
        self.deadline_extensions = 0  # waits past their deadline whose sender still answered
        self.mb_compute_s: Optional[float] = None  # smoothed compute time per micro-batch of this stage
        # --workload: emulated bytes per real byte (models.workload.Charges), and the model layer of
        # each gradient-sum bucket of this stage (its parts are charged as that layer's parameters)
        self.charges = None
        self.bucket_layers: list[int] = []
        # (kind, sender, step, micro-batch, tensor) -> None, a tensor to use instead, or raises
        # StepFailed: the defence's gate
        self.check: Optional[Callable[[str, str, int, int, torch.Tensor], Awaitable[Optional[torch.Tensor]]]] = None
        # (peer, header, buffers) of each message as it crossed the wire: the verifier's ledger
        self.sent_hook: Optional[Callable] = None
        self.received_hook: Optional[Callable] = None
        self.lanes = None  # train.lane_hops.LaneHops, with --lanes

    def start(self, job) -> None:
        self.job = job

    # ---- the stage's epoch ------------------------------------------------------------------------
    def begin_epoch(self, smap: StageMap, stage: Optional[int]) -> None:
        """A new stage map: nothing is expected until the stage is set up (``open``)."""
        self.smap, self.stage = smap, stage
        self._expect = {}
        self.inbox.clear()
        if self.lanes is not None:
            self.lanes.begin_epoch(smap.epoch)
        self._arrivals.clear()

    def route(self, route: dict[str, list[str]]) -> None:
        """Where each micro-batch's activation (ACT) and input gradient (GRAD) goes."""
        self._route = route

    def open(self, expect: dict[str, Expect]) -> None:
        """The stage is set up: take the messages it expects from now on."""
        self._expect = expect
        # room for a step and the next from every sender (fp16's collector hears every peer)
        senders = max((len(e.src) * e.num_microbatches for e in expect.values()), default=0)
        self.inbox.max_pending = max(64, 2 * senders + 16)

    def drop_before(self, step: int) -> None:
        self.inbox.drop_before(step)
        for key in [k for k in self._arrivals if k[1] < step]:
            del self._arrivals[key]

    def take_arrivals(self, step: int) -> list[list]:
        """``[kind, micro-batch, first byte, whole, filed]`` (unix) of each activation and gradient of
        ``step`` received so far, taken (a step's timeline keeps them)."""
        keys = [k for k in self._arrivals if k[1] == step]
        return [[k[0], k[2], *self._arrivals.pop(k)] for k in keys]

    def observe_compute(self, per_mb_s: float) -> None:
        """One step's compute time per micro-batch: adaptive compression weighs transfers against it."""
        self.mb_compute_s = per_mb_s if self.mb_compute_s is None else 0.7 * self.mb_compute_s + 0.3 * per_mb_s

    def timeout_s(self) -> float:
        """How long a live peer's message may take: the job's ``recv_timeout_s``, or a few of the
        stage map's predicted steps where a step takes longer than that (a slow world: a message
        of a step can be due a step's time after it began). A dead sender is found sooner: by
        asking it (``liveness``) once the adaptive deadline passes."""
        predicted = self.smap.predicted_step_s if self.smap is not None else 0.0
        return max(self.job.recv_timeout_s, STEPS_OF_PATIENCE * predicted)

    def deadline_report(self) -> dict:
        return {k: {"typical_s": round(t, 4), "deadline_s": round(self._deadlines.deadline(k, self.job.recv_timeout_s), 3)}
                for k in (ACT, GRAD, GSUM) if (t := self._deadlines.typical(k)) is not None}

    # ---- receiving --------------------------------------------------------------------------------
    def on_tensor(self, header: dict, buffers) -> None:
        """The data plane's handler of ACT, GRAD, GSUM and AMP messages: checked and filed where the
        frame comes in (``register(..., inline=True)``: it never waits)."""
        kind, step, mb, t = self.check_tensor(header, buffers)
        if self.lanes is not None and kind in (ACT, GRAD):
            self.lanes.heard(header["src"])  # (that sender's hop to us runs through the event loops)
        if self.received_hook is not None:
            self.received_hook(header["src"], header, buffers)
        self.inbox.put((f"{kind}/{header['src']}" if kind in REPLICA_KINDS else kind, step, mb), t)
        arrived = ARRIVED.get()
        if arrived is not None and arrived[0] is not None and kind in (ACT, GRAD):
            self._arrivals[(kind, step, mb)] = (arrived[0], arrived[1], time.time())
        return None

    def check_tensor(self, header: dict, buffers) -> tuple[str, int, int, torch.Tensor]:
        """A tensor message, checked against what this stage expects now (its epoch, its kind, its
        shape, its sender and micro-batch): (kind, step, micro-batch, tensor). ``Retry`` for one this
        peer cannot take yet, ``FrameError`` for one it never takes. ``header["src"]`` is the
        authenticated sender. (Reads the stage's state only: the compute thread checks what comes
        on a lane with it too.)"""
        kind, epoch = header.get("kind"), header.get("epoch")
        if self.smap is None or (isinstance(epoch, int) and epoch > self.smap.epoch):
            raise Retry("this peer has no stage map for that epoch yet")
        if not isinstance(epoch, int) or epoch < self.smap.epoch:
            # a late message of an abandoned epoch: its step is redone under the new map, where the
            # micro-batches, replicas and gradient parts differ (taken, it would be summed in)
            raise FrameError(f"epoch {epoch!r} is over: this peer runs stage map epoch {self.smap.epoch}")
        if self.stage is None:
            raise FrameError("this peer has no stage in the current stage map")
        if not self._expect:
            raise Retry("this peer is still setting up its stage")
        expect = self._expect.get(kind) if isinstance(kind, str) else None
        if expect is None:
            raise FrameError(f"this peer's stage does not take {kind!r} messages")
        step = self.current_step()
        step, mb, t = decode_tensor(header, buffers, expect, (step, step + 1))
        senders = self._route.get(GRAD if kind == ACT else ACT, []) if kind in (ACT, GRAD) else None
        if senders is not None and (mb >= len(senders) or header["src"] != senders[mb]):
            # ``src`` is the authenticated sender (the data plane checked it): a neighbour, but not
            # the one this micro-batch comes from
            raise FrameError(f"{kind} of micro-batch {mb} from {header['src'][:16]}…, which does not send it")
        return kind, step, mb, t

    async def recv(self, kind: str, step: int, mb: int) -> torch.Tensor:
        """A micro-batch's activation (ACT) or output gradient (GRAD), for the executor."""
        # activations of a micro-batch come from the peer its gradients go back to, and vice versa
        src = self._route[GRAD if kind == ACT else ACT][mb]
        t = await self.receive((kind, step, mb), kind, src)
        if self.check is not None:
            instead = await self.check(kind, src, step, mb, t)
            if instead is not None:
                t = instead
        return t

    def arrived(self, kind: str, step: int, mb: int) -> bool:
        """Whether ``recv(kind, step, mb)`` has its tensor here already, for the executor."""
        return self.inbox.arrived((kind, step, mb))

    async def receive(self, key: tuple[str, int, int], kind: str, src: str) -> torch.Tensor:
        """The message ``key`` from ``src``. Past the adaptive deadline (a multiple of the recent
        waits for this kind), ask whether ``src`` still lives: one that does not answer fails the
        step at once; a slow but live one is waited for, up to ``timeout_s``."""
        # time.monotonic, not the loop's clock: a peer of the Python API runs in its user's loop, and
        # uvloop's clock has milliseconds (the waits feed the adaptive deadlines)
        t0 = time.monotonic()
        cap = t0 + self.timeout_s()
        while True:
            wait = self._deadlines.deadline(kind, max(0.0, cap - time.monotonic()))
            try:
                t = await self.inbox.get(key, max(0.05, wait))
            except TimeoutError:
                waited = time.monotonic() - t0
                if time.monotonic() >= cap:
                    raise StepFailed(f"no {kind} for step {key[1]} micro-batch {key[2]} from "
                                     f"{self.smap.name_of(src)} within {waited:.1f}s") from None
                if not await is_alive(self.peer, src):
                    raise StepFailed(f"no {kind} for step {key[1]} micro-batch {key[2]} after {waited:.1f}s, and "
                                     f"{self.smap.name_of(src)} does not answer") from None
                log.info("waiting %.1fs for %s of step %d from %s (typically %.2fs): it answers, so waiting on",
                         waited, kind, key[1], self.smap.name_of(src), self._deadlines.typical(kind) or 0.0)
                self.deadline_extensions += 1
                continue
            self._deadlines.observe(kind, time.monotonic() - t0)
            return t

    # ---- sending ----------------------------------------------------------------------------------
    async def send(self, kind: str, step: int, mb: int, t: torch.Tensor) -> None:
        """A micro-batch's activation (ACT) or input gradient (GRAD), for the executor."""
        await self.send_to(self._route[kind][mb], kind, step, mb, t)

    def codec_for(self, kind: str, dst: str, raw_bytes: int) -> str:
        c = self.job.compression
        if kind in REPLICA_KINDS or c == "none":
            return "none"
        if c != "adaptive":
            return c
        probe = self.probes.get(dst)
        if self._policy.bandwidth(dst) is None and probe is not None and probe.ok:
            self._policy.set_link(dst, bytes_per_s=probe.mbps * 1e6 / 8, rtt_s=probe.rtt_ms / 1e3)
        if self._policy.bandwidth(dst) is None or self.mb_compute_s is None:
            return "none"  # nothing known of the link or the stage's compute yet
        return codecs.spec(*self._policy.decide(dst, raw_bytes, self.mb_compute_s * NEGLIGIBLE_TRANSFER, kind,
                                                cap=self.planned_codec(kind)))

    def planned_codec(self, kind: str) -> Optional[str]:
        """The codec the stage map priced this stage's ``kind`` hop at (activations go to the next
        stage, their gradients to the one before): adaptive compression goes no lossier, so the
        run keeps the step time the plan predicted (a lossier one would be another plan)."""
        if self.smap is None or self.stage is None:
            return None
        hop = self.stage if kind == ACT else self.stage - 1
        comp = self.smap.compression
        if not 0 <= hop < self.smap.num_stages - 1:
            return None
        return comp[hop] if hop < len(comp) else "none"

    def charge(self, kind: str, mb: int) -> float:
        """Emulated bytes per real byte of this message (1 without a workload)."""
        c = self.charges
        if c is None or kind == AMP:
            return 1.0
        if kind in (GSUM, WGAT):
            return c.params[self.bucket_layers[mb]] if mb < len(self.bucket_layers) else 1.0  # else: the loss
        return c.activation

    async def send_to(self, dst: str, kind: str, step: int, mb: int, t: torch.Tensor,
                      epoch: Optional[int] = None) -> None:
        """``t`` to ``dst``, labelled with ``epoch`` (default: the map in force now; a part computed
        under an older map must say so, or it would be taken as the new map's)."""
        charge = self.charge(kind, mb)
        codec = self.codec_for(kind, dst, int(t.numel() * t.element_size() * charge))
        lossy_grad = kind == GRAD and codec.startswith("topk")
        header, bufs = encode_tensor(kind, self.job.job_id, self.smap.epoch if epoch is None else epoch, step, mb,
                                     self.peer.peer_id, t, codec,
                                     self._feedback if lossy_grad else None, (dst, mb))
        if self.sent_hook is not None:
            self.sent_hook(dst, header, bufs)
        if kind != AMP:  # one flag a step: no codec to speak of
            self.codecs_used[f"{kind}->{self.smap.name_of(dst)}"] = codec
        if self.charges is not None and kind in (ACT, GRAD):
            charge = self.charges.activation * workload_codec_factor(t, bufs)
        nbytes = int(sum(b.nbytes for b in bufs) * charge) + 256  # in the workload's bytes, + the header, about
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s()
        # a micro-batch's tensors to one peer go as one stream, in order: the next leaves once the
        # last byte of the one before has (as on one connection; concurrent ones would share the
        # link and every one would arrive late, the first as late as the last)
        stream = self._streams.setdefault(dst, asyncio.Lock()) if kind in (ACT, GRAD) else None
        while True:
            url = self.peer.data_url_of(dst)
            turn = await _take_turn(stream) if stream is not None else _no_turn
            link = self.peer.link_to(dst)
            paced = link is not None and not link.transparent(charge)  # (as the client decides, now)
            # this attempt's, from its connection being ready: refusals, waits and a new connection's
            # handshake before it say nothing of the link (an epoch's first gradient parts to a
            # replica waited 25-38 ms for one, and read its 1 Gbit/s link at 37-64 Mbit/s:
            # cee-3region, 2026-12-01)
            began: list[float] = []
            held: list[float] = []  # on an emulated link, how long its bytes held it

            def start() -> None:
                began.append(time.monotonic())

            def sent(held_s: Optional[float] = None) -> None:
                if held_s is not None and not held:
                    held.append(held_s)
                turn()
            try:
                try:  # the turn is given back whatever happens (held, every later send to dst would wait forever)
                    if url is None:
                        raise ConnectionError(f"no live address for {self.smap.name_of(dst)}")
                    await self.peer.client.send(url, kind, header, bufs, timeout=max(1.0, deadline - loop.time()),
                                                link=link, charge=charge, on_sent=sent, on_start=start)
                finally:
                    turn()
                per = self.wire_bytes.setdefault(step, {})
                per[dst] = per.get(dst, 0) + nbytes
                self.wire_totals[(kind, dst, codec)] = self.wire_totals.get((kind, dst, codec), 0) + nbytes
                # an epoch's first step meets peers still loading and setting up their stages: its
                # transfers' times say more about them than about the links
                if step > self.smap.start_step and began:
                    t0 = began[0]
                    elapsed = time.monotonic() - t0
                    probe = self.probes.get(dst)
                    rtt = probe.rtt_ms / 1000 if probe is not None and probe.rtt_ms else 0.0
                    if paced and held:
                        # an emulated link: its bytes' time is theirs through it, as the link scheduled
                        # them (``on_sent``). The reply waits on the receiver's event loop too, which
                        # on a host's busy cores read 1 Gbit/s LAN links at 54-311 Mbit/s, and the
                        # grouping took their 40 ms WAN for the better link (test_planner_swarm merged
                        # the two regions, 2026-12-01). Timed from ``on_start`` instead, a loop held
                        # between the link's start (its exchange, dated back by the time the client took
                        # to get to the body) and the connection being ready shortened it: 0.3 ms read a
                        # 1 Gbit/s link at 1,231 Mbit/s (the suite's failures of 2026-12-02 14:47-15:17)
                        through = held[0]
                        self.passive.observe(dst, nbytes, through)
                        delivered = through + rtt / 2
                    else:
                        # a send waits for its reply: a whole round trip of it is not the bytes' time
                        self.passive.observe(dst, nbytes, elapsed, latency_s=rtt)
                        delivered = max(0.0, elapsed - rtt / 2)
                    if kind not in REPLICA_KINDS:
                        self._policy.observe(dst, nbytes, delivered)  # (its own estimate, for the codecs)
                return
            except RemoteError as e:
                if e.status != 503 or loop.time() > deadline:
                    raise StepFailed(f"{self.smap.name_of(dst)} refused {kind} step {step} mb {mb}: {e}") from None
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                if loop.time() > deadline:
                    raise StepFailed(f"cannot send {kind} to {self.smap.name_of(dst)}: {e!r}") from None
            await asyncio.sleep(0.2)
