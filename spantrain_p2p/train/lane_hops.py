"""A stage's pipeline hops on lanes (``--lanes``): its activations and gradients written and read by
its compute thread, off the event loop (``net.lanes``; issue 31).

With lanes, a step runs whole on the compute thread (``pipeline.lane_step``) and calls ``recv`` and
``send`` here. The first send of an epoch to a peer asks it for a lane; a peer of this machine that
runs with ``--lanes`` too takes one, and the hop's tensors go on it. A hop that cannot have one (an
encrypted connection: it leaves the machine; an emulated link that shapes its bytes; a peer without
``--lanes``) goes through the event loops as before: the compute thread hands the send to the loop
and waits there for the tensor (``PipelineTransport.send`` and ``recv``, with their retries,
deadlines and liveness checks). A receiver learns which way a sender's tensors come from the sender:
its lane, or its first message on the data plane (``heard``).

What comes on a lane is checked as the data plane's messages are (``PipelineTransport.check_tensor``:
epoch, kind, shape, dtype, finite values, sender and micro-batch); anything wrong ends the step, and
the lanes with it. A step that fails or is cancelled shuts every lane of this peer down (``abort``):
a thread waiting on one wakes, and the peers at their other ends fail their steps too and follow
the re-plan. Lanes belong to an epoch: a new stage map closes them, and the next epoch's first sends
open new ones.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Callable, Optional

import torch

from ..net import lanes
from ..net.dataplane import LaneRefused, RemoteError, Retry
from ..net.framing import FrameError
from ..pipeline.executor import StepFailed
from ..pipeline.messages import ACT, GRAD, encode_tensor
from ..swarm.liveness import is_alive

log = logging.getLogger(__name__)

LANE_KIND = "lane"
_UNASKED = object()


def no_lanes(header: dict, buffers):
    """The lane handler of a peer without ``--lanes``."""
    raise LaneRefused("this peer runs without --lanes")


def unsuited(tr, executor, scaled: bool) -> Optional[str]:
    """Why a stage cannot run its steps on lanes (None: it can). What a lane step leaves out: codecs
    (and their error feedback), the defences' gate and the replicas' checks (they judge each boundary
    tensor on the event loop), fp16's loss scale, a GPU's copies to and from the host on side streams,
    the islands' exchange and the attack harness."""
    job = tr.job
    if job.compression != "none":
        return f"--compression {job.compression}"
    if tr.defence.gate is not None or tr.verifier.on:
        return "the defences (--aggregate robust) judge each boundary tensor"
    if scaled:
        return "fp16's loss scale"
    if executor.torch_device.type != "cpu":
        return f"its layers are on {executor.torch_device}"
    if tr.island is not None:
        return "islands"
    if tr.opts.byzantine:
        return "--byzantine"
    return None


class LaneHops:
    def __init__(self, transport, max_message_bytes: int):
        self.t, self.max_bytes = transport, max_message_bytes
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the peer's (``begin_epoch``)
        self.enabled = False  # this peer takes and opens lanes now (``--lanes``, and a stage they suit)
        self._cv = threading.Condition()
        self._in: dict[str, lanes.LaneIn] = {}  # sender -> its lane to us
        self._via_loop: set[str] = set()  # senders heard on the data plane this epoch
        self._out: dict[str, object] = {}  # destination -> its LaneOut, or None: through the loop
        self._ahead: dict[tuple[str, int, int], torch.Tensor] = {}  # read off a lane before their turn
        self._pending: list[concurrent.futures.Future] = []  # this step's sends through the loop
        self._waiting: set[concurrent.futures.Future] = set()  # what the thread waits for on the loop now
        self._aborted = False
        self._epoch: Optional[int] = None
        self._said_409: set[str] = set()
        self.messages = {"lane": 0, "loop": 0}  # tensors sent each way (the run's report)

    # ---- on the event loop ------------------------------------------------------------------------
    def accept(self, header: dict, buffers) -> Callable[[object], None]:
        """The data plane's ``register_lane`` handler: a lane from ``header["src"]`` for this epoch's
        ``header["kind"]`` tensors, or why not."""
        t, epoch, kind, src = self.t, header.get("epoch"), header.get("kind"), header["src"]
        if t.smap is None or (isinstance(epoch, int) and epoch > t.smap.epoch):
            raise Retry("this peer has no stage map for that epoch yet")
        if not isinstance(epoch, int) or epoch < t.smap.epoch:
            raise FrameError(f"epoch {epoch!r} is over: this peer runs stage map epoch {t.smap.epoch}")
        if not t._expect:
            raise Retry("this peer is still setting up its stage")
        if not self.enabled:
            raise LaneRefused("its stage runs through the event loop this epoch")
        if kind not in (ACT, GRAD) or kind not in t._expect:
            raise FrameError(f"this peer's stage takes no {kind!r} lane")
        if src not in t._route.get(GRAD if kind == ACT else ACT, []):
            raise FrameError(f"{src[:16]}… sends this stage no {kind}")

        def take(sock) -> None:
            lane = lanes.LaneIn(sock, src, self.max_bytes)
            with self._cv:
                old = self._in.get(src)
                if old is not None:  # (a sender opens one an epoch: a second is a new attempt)
                    old.shutdown()
                self._in[src] = lane
                self._cv.notify_all()
        return take

    def heard(self, src: str) -> None:
        """A tensor from ``src`` came on the data plane: its hop to us runs through the loops."""
        if src not in self._via_loop:
            with self._cv:
                self._via_loop.add(src)
                self._cv.notify_all()

    def begin_epoch(self, epoch: Optional[int]) -> None:
        """A new stage map: this epoch's lanes are opened anew (the step thread is not running)."""
        self.abort()
        self.close()
        self._epoch = epoch
        self.enabled = False  # (until the epoch's stage is set up, and suits them)
        self.loop = asyncio.get_running_loop()

    def abort(self) -> None:
        """A step failed or was cancelled (any thread): every lane is shut down, waking a thread
        that waits on one; the sends handed to the loop are cancelled."""
        with self._cv:
            self._aborted = True
            for lane in self._in.values():
                lane.shutdown()
            outs = [x for x in self._out.values() if isinstance(x, lanes.LaneOut)]
            pending, self._pending = self._pending, []
            waiting = list(self._waiting)
            self._cv.notify_all()
        for lane in outs:
            lane.close()
        for f in pending + waiting:
            f.cancel()

    def close(self) -> None:
        """After ``abort``, once no step runs: the lanes are forgotten and their sockets closed (the
        next step opens new ones)."""
        with self._cv:
            ins, self._in = self._in, {}
            outs, self._out = self._out, {}
            self._via_loop.clear()
            self._ahead.clear()
            self._aborted = False
        for lane in ins.values():
            lane.close()
        for lane in outs.values():
            if isinstance(lane, lanes.LaneOut):
                lane.close()

    # ---- on the compute thread ---------------------------------------------------------------------
    def recv(self, kind: str, step: int, mb: int) -> torch.Tensor:
        """Micro-batch ``mb``'s activation (ACT) or output gradient (GRAD) for ``step``: off its
        sender's lane, or through the loop. Past the adaptive deadline the sender is asked whether it
        lives (through the loop), as ``PipelineTransport.receive`` does."""
        t = self.t
        src = t._route[GRAD if kind == ACT else ACT][mb]
        key = (kind, step, mb)
        t0 = time.monotonic()
        cap = t0 + t.timeout_s()
        while True:
            if key in self._ahead:
                got = self._ahead.pop(key)
                t._deadlines.observe(kind, time.monotonic() - t0)
                return got
            wait = t._deadlines.deadline(kind, max(0.0, cap - time.monotonic()))
            until = time.monotonic() + max(0.05, wait)
            with self._cv:
                while src not in self._in and src not in self._via_loop and not self._aborted:
                    left = until - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if self._aborted:
                    raise StepFailed("the step was abandoned")
                lane = self._in.get(src)
                via_loop = lane is None and src in self._via_loop
            if via_loop:
                return self._wait_on_loop(t.recv(kind, step, mb))
            if lane is not None and lane.wait(until - time.monotonic()):
                self._take(lane, src, key)
                continue
            self._overdue(kind, key, src, t0, cap)

    def _take(self, lane: "lanes.LaneIn", src: str, key: tuple[str, int, int]) -> None:
        """The next message on ``src``'s lane, checked, kept for its turn."""
        try:
            kind, header, buffers = lane.read()
        except lanes.LaneClosed as e:
            raise StepFailed(str(e)) from None
        if header.setdefault("src", src) != src or header.get("kind") != kind:
            raise StepFailed(f"lane from {self.t.smap.name_of(src)} carried a message that is not its own")
        try:
            k, step, mb, tensor = self.t.check_tensor(header, buffers)
        except (FrameError, Retry) as e:
            raise StepFailed(f"lane from {self.t.smap.name_of(src)}: {e}") from None
        got = (k, step, mb)
        if got in self._ahead or len(self._ahead) >= self.t.inbox.max_pending:
            raise StepFailed(f"lane from {self.t.smap.name_of(src)} sent {k} of step {step} micro-batch {mb} again, "
                             f"or too far ahead")
        self._ahead[got] = tensor

    def _overdue(self, kind: str, key, src: str, t0: float, cap: float) -> None:
        waited = time.monotonic() - t0
        name = self.t.smap.name_of(src)
        if time.monotonic() >= cap:
            raise StepFailed(f"no {kind} for step {key[1]} micro-batch {key[2]} from {name} within {waited:.1f}s")
        if not self._wait_on_loop(is_alive(self.t.peer, src)):
            raise StepFailed(f"no {kind} for step {key[1]} micro-batch {key[2]} after {waited:.1f}s, and {name} "
                             f"does not answer")
        self.t.deadline_extensions += 1

    def send(self, kind: str, step: int, mb: int, tensor: torch.Tensor) -> None:
        """Micro-batch ``mb``'s activation (ACT) or input gradient (GRAD): on the hop's lane (the first
        send of the epoch asks for it), or handed to the loop; ``finish`` waits for both."""
        t = self.t
        dst = t._route[kind][mb]
        lane = self._out.get(dst, _UNASKED)
        if lane is _UNASKED:
            lane = self._out[dst] = self._wait_on_loop(self._open(dst, kind))
        if lane is None:
            self._pending.append(self._on_loop(t.send(kind, step, mb, tensor)))
            self.messages["loop"] += 1
            return
        header, bufs = encode_tensor(kind, t.job.job_id, t.smap.epoch, step, mb, t.peer.peer_id, tensor, "none")
        try:
            lane.write(lanes.request_chunks(kind, header, bufs))
        except lanes.LaneClosed as e:
            raise StepFailed(str(e)) from None
        nbytes = sum(b.nbytes for b in bufs) + 256  # (+ the header, about: as ``send_to`` counts)
        per = t.wire_bytes.setdefault(step, {})
        per[dst] = per.get(dst, 0) + nbytes
        t.wire_totals[(kind, dst, "none")] = t.wire_totals.get((kind, dst, "none"), 0) + nbytes
        t.codecs_used[f"{kind}->{t.smap.name_of(dst)}"] = "none"
        self.messages["lane"] += 1

    def finish(self) -> None:
        """The step's sends are done: its lanes took every byte, its sends through the loop were
        delivered (what failed raises StepFailed)."""
        timeout = self.t.timeout_s()
        try:
            for lane in list(self._out.values()):
                if isinstance(lane, lanes.LaneOut):
                    lane.flush(timeout)
        except lanes.LaneClosed as e:
            raise StepFailed(str(e)) from None
        pending, self._pending = self._pending, []
        for f in pending:
            try:
                f.result(timeout)
            except concurrent.futures.CancelledError:
                raise StepFailed("the step was abandoned") from None

    def _on_loop(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _wait_on_loop(self, coro):
        """``coro``'s result, run on the loop while this thread waits (``abort`` cancels it: the
        thread does not wait out its deadlines after the step is abandoned)."""
        f = self._on_loop(coro)
        with self._cv:
            if self._aborted:
                f.cancel()
            self._waiting.add(f)
        try:
            return f.result()
        except concurrent.futures.CancelledError:
            raise StepFailed("the step was abandoned") from None
        finally:
            with self._cv:
                self._waiting.discard(f)

    async def _open(self, dst: str, kind: str) -> Optional[lanes.LaneOut]:
        """A lane to ``dst`` for this epoch's ``kind`` tensors, or None: the hop goes through the loop."""
        t = self.t
        link = t.peer.link_to(dst)
        if link is not None and not link.transparent(t.charge(kind, 0)):
            return None  # an emulated link shapes this hop's bytes on the loop
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t.timeout_s()
        name = t.smap.name_of(dst)
        while True:
            url = t.peer.data_url_of(dst)
            try:
                if url is None:
                    raise ConnectionError(f"no live address for {name}")
                sock = await t.peer.client.open_lane(url, LANE_KIND, {"job": t.job.job_id, "epoch": t.smap.epoch,
                                                                      "kind": kind}, peer_id=dst)
                if sock is None:
                    return None
                log.info("a lane to %s for %s tensors (epoch %d)", name, kind, t.smap.epoch)
                return lanes.LaneOut(sock, dst, max_backlog_bytes=self.max_bytes)
            except RemoteError as e:
                if e.status == 409:
                    if dst not in self._said_409:
                        self._said_409.add(dst)
                        log.info("%s takes no lane from this peer (%s): its %s tensors go through the event loop",
                                 name, e.reason, kind)
                    return None
                if e.status != 503 or loop.time() > deadline:
                    raise StepFailed(f"{name} refused a lane for {kind}: {e}") from None
                await asyncio.sleep(0.05)
            except (OSError, asyncio.TimeoutError) as e:
                if loop.time() > deadline:
                    raise StepFailed(f"cannot open a lane to {name}: {e!r}") from None
                await asyncio.sleep(0.2)
