"""Runs one stage's schedule for one step: F, B, W (or fused BW), sends and receives.

The schedule (``pipeline.schedule``) decides the order; this only follows the list, so GPipe,
1F1B and ZB-H1 share all the machinery. Compute runs on one worker thread so the peer's event
loop keeps serving the network (and sends overlap compute); sends are asynchronous and awaited at
the end of the step. A failed step leaves no gradient behind: the caller can redo it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from typing import Awaitable, Callable, Optional

import torch
from torch import nn

from ..osproc import ThreadCoreWait, ask_slice, name_thread
from . import lane_step
from . import schedule as sched
from . import split_backward
from .hostcopy import HostCopier
from .loss_scale import sanitized, scaled
from .memory import StashMeter, layer_call
from .messages import ACT, GRAD
from .step_state import StepFailed, StepResult, _Mb  # noqa: F401 (StepFailed: where callers import it)

COMPUTE_SLICE_S = 0.02  # the compute thread's scheduler slice (issue 31: 20 ms; 6 ms gained nothing)
COMPUTE_THREAD = "stage-compute"  # its name, for the OS too (top -H, perf: ``osproc.name_thread``)


def _compute_thread_init() -> None:
    name_thread(COMPUTE_THREAD)
    ask_slice(COMPUTE_SLICE_S)


Recv = Callable[[str, int, int], Awaitable[torch.Tensor]]
Send = Callable[[str, int, int, torch.Tensor], Awaitable[None]]
Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (step, mb) -> (inputs, targets)


LayerDone = Callable[[int], None]  # called with a layer's index once its step's weight gradients are final
Arrived = Callable[[str, int, int], bool]  # (kind, step, mb) -> whether that tensor is here, to be taken at once


class _Handed:
    """An op handed to the compute thread: its future, when it was handed and when the thread ended
    it (unix), and its seconds waiting for a core within its compute time (None: unknown)."""

    def __init__(self) -> None:
        self.future: Optional[concurrent.futures.Future] = None
        self.handed = time.time()
        self.ended = 0.0
        self.waited: Optional[float] = None
        self.wait_at_hand: Optional[float] = None  # the compute thread's ``core_wait_s`` when handed

    async def result(self):
        return await asyncio.wrap_future(self.future)

    async def settle(self) -> None:
        """Takes it back: not run if it had not begun, else waited for (what it raised dropped), so
        that nothing of it lands on the stage's state after a failed step has been cleared."""
        if not self.future.cancel():
            waited = asyncio.wrap_future(self.future)
            await asyncio.wait([waited])
            if waited.done() and not waited.cancelled():
                waited.exception()  # (retrieved: dropped)


class StageExecutor:
    def __init__(self, layers: list[nn.Module], is_first: bool, is_last: bool, num_microbatches: int,
                 batch: Batch, recv: Recv, send: Send, device=None,
                 layer_flops: Optional[list[dict[str, float]]] = None,
                 compute_dtype: Optional[torch.dtype] = None, recompute: str = "none",
                 arrived: Optional[Arrived] = None):
        """``device`` (a profile.virtual.VirtualDevice) pads each op to the FLOPs of one micro-batch
        through the stage, from ``layer_flops`` (per layer, F, B and W:
        ``profile.virtual.stage_layer_flops``), which also say when within the step's last weight-grad
        op each layer is done on the device (for ``run_step``'s ``on_layer_done``). ``compute_dtype`` (bfloat16 or float16): the forward
        runs under autocast to it, the weights stay float32 (so do their gradients and the
        optimizer), and activations and their gradients leave the stage in it. The stage computes
        where its layers are (``--device``): batches and received tensors are moved there, and
        what it sends is copied to host memory on a side stream (``hostcopy``). ``loss_scale`` (fp16, set before each step): the
        last stage scales its loss by it; a tensor that overflowed leaves as zeros and sets
        ``overflowed`` (``pipeline.loss_scale``: the step is then skipped everywhere). ``recompute``:
        none or full (``pipeline.memory``), what the stage keeps of its forwards. ``arrived(kind, step,
        mb)``: whether ``recv`` has that tensor already (``run_step`` then hands the op that needs it
        to the compute thread before the op ahead of it ends)."""
        self.layers = nn.ModuleList(layers)
        self.is_first, self.is_last = is_first, is_last
        self.num_microbatches = num_microbatches
        self.batch, self.recv, self.send, self.arrived = batch, recv, send, arrived
        self.params = [p for p in self.layers.parameters() if p.requires_grad]
        self._layer_params = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        # the compute thread runs COMPUTE_SLICE_S at a time once it has a core (``osproc.ask_slice``):
        # peers sharing a host's cores take turns less often, each turn refilling caches
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=COMPUTE_THREAD,
                                                           initializer=_compute_thread_init)
        self._thread_cpu_s = 0.0  # CPU seconds on the compute thread, not yet taken (take_thread_cpu)
        # when the compute thread ended its last op (unix) and its ``core_wait_s`` then (``_hand``),
        # and that figure read from the event loop (once the thread has run an op)
        self._last_end, self._last_wait = 0.0, None
        self._thread_wait: Optional[ThreadCoreWait] = None
        self.device = device
        self.layer_flops = layer_flops
        self.flops = {ph: sum(x.get(ph, 0.0) for x in layer_flops or ()) for ph in ("F", "B", "W")}
        self.compute_dtype = compute_dtype
        self.torch_device = next((p.device for p in self.params), torch.device("cpu"))
        self._device_type = self.torch_device.type
        self._copier = HostCopier(self.torch_device)
        self.loss_scale: Optional[float] = None
        self.overflowed = False  # this step sent a tensor that overflowed (fp16)
        self._call = layer_call(recompute)  # (not ``self.recompute``: that is the verifier's method below)
        # a split backward (B, then W) does not go through a layer's backward twice: in float32 the
        # linear layers leave their weight gradients' factors to W (``split_backward``, installed at
        # the first step that splits); under autocast B keeps the gradients where each weight enters
        # the layer's graph (torch.distributed.pipelining's own split: W cost 1.5x a fused
        # backward's share without it, measured on 3 blocks here); a layer recomputed in its
        # backward keeps the plain split (its graph is rebuilt during B)
        self._weight_groups = recompute == "none"
        self._deferral = split_backward.Deferral() if self._weight_groups and compute_dtype is None else None
        self._split_installed = False
        self.meter = StashMeter(self.params)
        self.hops = None  # train.lane_hops.LaneHops: the step runs on the compute thread, tensors on lanes
        self.state_bytes = 0  # weights, gradients and optimizer state: what a virtual device's memory holds besides activations

    def _check_memory(self) -> None:
        """On a virtual device with memory (``profile.virtual``), what the stage holds now (its state,
        ``state_bytes``, set by the trainer, and the activations kept) must fit, or the step fails as
        a real device's allocation would: with ``torch.OutOfMemoryError``."""
        limit = getattr(self.device, "memory_bytes", None)
        if limit is not None and self.state_bytes + self.meter.held > limit:
            raise torch.OutOfMemoryError(
                f"virtual device out of memory: the stage holds {self.state_bytes / 2**20:.2f} MiB of weights, "
                f"gradients and optimizer state and {self.meter.held / 2**20:.2f} MiB of activations, over the "
                f"device's {limit / 2**20:.2f} MiB")

    def _autocast(self):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self.compute_dtype)

    def _send(self, kind: str, step: int, mb: int, t: torch.Tensor) -> asyncio.Task:
        """Sends a tensor leaving the stage: in the compute dtype, where the job has one, copied to
        host memory while the device computes on (``hostcopy``), as zeros if it overflowed (fp16)."""
        t = t.detach() if self.compute_dtype is None else t.detach().to(self.compute_dtype)
        host, done = self._copier.start(t)

        async def send():
            out = await self._copier.wait(host, done)
            if self.loss_scale is not None:
                out, bad = sanitized(out)
                self.overflowed |= bad
            await self.send(kind, step, mb, out)
        return asyncio.create_task(send())

    def _here(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A tensor arriving at the stage (a batch, a received one), on the stage's device (to a
        CUDA device through pinned memory: a copy from pageable memory would wait for the kernels
        queued before it, and block the event loop that long)."""
        if t is None or t.device == self.torch_device:
            return t
        if self._device_type == "cuda" and t.device.type == "cpu":
            t = t.pin_memory()
        return t.to(self.torch_device, non_blocking=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread_wait is not None:
            self._thread_wait.close()

    def _done_fractions(self, phase: str) -> list[float]:
        """Per layer, the fraction of a backward op (``W`` or ``BW``) done once that layer is: the
        layers run last to first, each taking its share of the op's FLOPs."""
        n = len(self.layers)
        lf = self.layer_flops if self.layer_flops and len(self.layer_flops) == n else [{}] * n
        return sched.backward_done_fractions(
            [x.get("W", 0.0) + (x.get("B", 0.0) if phase == "BW" else 0.0) for x in lf])

    async def _compute(self, phase: str, fn, *args, on_layer_done: Optional[LayerDone] = None,
                       ready: Optional[float] = None):
        """``fn(*args, layer_done)``'s result, run on the compute thread (``_hand``)."""
        return await self._hand(phase, fn, *args, on_layer_done=on_layer_done, ready=ready).result()

    def _hand(self, phase: str, fn, *args, on_layer_done: Optional[LayerDone] = None,
              ready: Optional[float] = None) -> _Handed:
        """Hands ``fn(*args, layer_done)`` to the compute thread, padded on a virtual device: it runs
        once the thread is done with what it was handed before.
        ``layer_done(i)`` (for the backward ops) tells ``on_layer_done`` on the event loop, once
        the device has had the time to get that far (layer ``i``'s gradients are final then).
        ``ready``: when the op was queued on the virtual device (``VirtualDevice.op``)."""
        loop = asyncio.get_running_loop()

        def call():
            return self.run_op(loop, phase, fn, *args, on_layer_done=on_layer_done, ready=ready)

        handed = _Handed()

        def timed():
            # its wait for a core over the span ``run_step`` counts as its compute: from the end of
            # the op before it if it was handed before that ended (the thread went straight on),
            # else from when it was handed (its wait to wake counts). Before, the wait ran from the
            # thread's last reading, and took in its turn to hand the last result back: more than
            # the op's compute on a crowded core (0.483 s waited in 0.461 s, a suite run of 12-02)
            # (one reader of the thread's schedstat serves the loop's reading at handing and these)
            if self._thread_wait is None:
                self._thread_wait = ThreadCoreWait(threading.get_native_id())
            if handed.handed <= self._last_end:
                start = self._last_wait
            else:
                start = handed.wait_at_hand if handed.wait_at_hand is not None else self._thread_wait.read()
            try:
                return call()
            finally:
                handed.ended, end = time.time(), self._thread_wait.read()
                handed.waited = None if start is None or end is None else max(0.0, end - start)
                self._last_end, self._last_wait = handed.ended, end
        if self._thread_wait is not None:
            handed.wait_at_hand = self._thread_wait.read()
        handed.future = self._pool.submit(self._counted, timed)
        return handed

    def run_op(self, loop: asyncio.AbstractEventLoop, phase: str, fn, *args,
               on_layer_done: Optional[LayerDone] = None, ready: Optional[float] = None):
        """``fn(*args, layer_done)`` on the compute thread, padded on a virtual device;
        ``on_layer_done(i)`` is called on ``loop`` (see ``_hand``)."""
        fracs = self._done_fractions(phase) if on_layer_done is not None else None
        if self.device is None:
            done = None if fracs is None else (lambda i: loop.call_soon_threadsafe(on_layer_done, i))
            return fn(*args, done)
        flops = self.flops.get("B", 0.0) + self.flops.get("W", 0.0) if phase == "BW" else self.flops.get(phase, 0.0)
        with self.device.op("B" if phase == "BW" else phase, flops, ready) as op:
            if fracs is None:
                return fn(*args, None)
            # a layer done here is done on the device once its share of the op has passed: told
            # at the first layer's end after that (the layers below compute on meanwhile, as a host
            # queues a GPU's kernels ahead of it), or held for at the op's end; not after holding
            # the thread at each layer, which had every layer's CPU work wait for the one before it
            # on the device and lost a wake-up a layer on a busy host (cee-3region: the step's last
            # backward took 39 ms for its 30 ms budget)
            waiting: list[int] = []

            def tell_due() -> None:
                while waiting and op.due(fracs[waiting[0]]):
                    loop.call_soon_threadsafe(on_layer_done, waiting.pop(0))

            def done(i):
                waiting.append(i)
                tell_due()
            out = fn(*args, done)
            for i in waiting:
                op.reach(fracs[i])
                loop.call_soon_threadsafe(on_layer_done, i)
            return out

    def _counted(self, fn):
        """``fn()`` on the compute thread, its CPU seconds counted (``take_thread_cpu``)."""
        c0 = time.thread_time()
        try:
            return fn()
        finally:
            self._thread_cpu_s += time.thread_time() - c0

    async def on_compute_thread(self, fn):
        """Runs ``fn()`` on the compute thread: work as long as the optimizer step (seconds when it
        steps on the host, or when torchao compiles its 8-bit step the first time) must not hold the
        event loop, whose heartbeats would stop and have this peer taken for dead."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._counted, fn)

    def take_thread_cpu(self) -> float:
        """CPU seconds the compute thread spent since the last call (``train.cpu_use``)."""
        s, self._thread_cpu_s = self._thread_cpu_s, 0.0
        return s

    # ---- compute (worker thread) ---------------------------------------------------------------
    # Each layer's graph starts at its own input (a leaf cut from the previous layer's output), so
    # the backward ops can run layer by layer, last to first: the same arithmetic as one backward
    # through the stage, but a layer's weight gradients are final as soon as its turn is over.
    def _forward(self, step: int, mb: int, st: _Mb, done=None) -> Optional[float]:
        inputs, targets = self.batch(step, mb) if (self.is_first or self.is_last) else (None, None)
        inputs, targets = self._here(inputs), self._here(targets)
        x = inputs if self.is_first else st.inp
        st.ins, st.outs = [], []
        n = len(self.layers)
        loss = None
        meter = st.meter or self.meter
        key = (tuple(x.shape), x.dtype, targets is not None)
        known = meter.known(key)
        stash: dict[int, int] = {}
        with self._autocast(), (meter.saving(stash) if known is None else contextlib.nullcontext()):
            for i, layer in enumerate(self.layers):
                if i > 0 and x.is_floating_point():
                    x = x.detach().requires_grad_(True)
                st.ins.append(x)
                if self.is_last and i == n - 1:
                    loss = self._call(layer, x, targets)
                    # micro-batch gradients sum to the global-batch mean (times the loss scale)
                    x = scaled(loss / self.num_microbatches, self.loss_scale)
                else:
                    x = self._call(layer, x)
                st.outs.append(x)
        if known is None:
            for t in st.outs:  # the outputs are kept too (each the next layer's input: one storage)
                stash[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            known = sum(stash.values())
            meter.learn(key, known)
        st.held = meter.kept(known)
        if meter is self.meter:
            self._check_memory()
        st.out = x
        return None if loss is None else float(loss.detach())

    @staticmethod
    def _grad_at_output(st: _Mb) -> Optional[torch.Tensor]:
        """The received gradient, in the dtype of the output it belongs to (it crossed the wire in
        the compute dtype; autocast may have left the stage's last output in float32)."""
        g = st.grad_out
        if g is not None and g.dtype != st.outs[-1].dtype:
            g = g.to(st.outs[-1].dtype)
        return g

    def _needs_input_grad(self, st: _Mb, i: int) -> bool:
        return st.ins[i].requires_grad and (i > 0 or not self.is_first)

    def _backward_input(self, st: _Mb, done=None) -> None:
        """B: the gradient at every layer's output and at the stage's input, weights untouched."""
        g = self._grad_at_output(st)
        st.gouts = [None] * len(self.layers)
        st.groups = [None] * len(self.layers)
        for i in reversed(range(len(self.layers))):
            st.gouts[i] = g
            if not self._needs_input_grad(st, i):
                break
            if self._deferral is not None and self._layer_params[i] and st.outs[i].requires_grad:
                g, st.groups[i] = split_backward.input_backward(self._deferral, st.outs[i], st.ins[i],
                                                                 self._layer_params[i], g)
            elif self._weight_groups and self._layer_params[i] and st.outs[i].requires_grad:
                from torch.distributed.pipelining._backward import stage_backward_input  # (1.7 s to import: zb only)

                (g,), st.groups[i] = stage_backward_input([st.outs[i]], None if g is None else [g], [st.ins[i]],
                                                          iter(self._layer_params[i]))
            else:
                (g,) = torch.autograd.grad(st.outs[i], [st.ins[i]], g, retain_graph=True)
        if not self.is_first:
            st.grad_in = g

    def _backward_weight(self, st: _Mb, done=None) -> None:
        """W: the weight gradients, layer by layer from the last, from the gradients B left."""
        for i in reversed(range(len(self.layers))):
            held = st.groups[i] if st.groups is not None else None
            if held is not None and self._deferral is not None:
                split_backward.weight_backward(held)
            elif held is not None:
                from torch.distributed.pipelining._backward import stage_backward_weight

                stage_backward_weight(iter(self._layer_params[i]), held)
            elif self._layer_params[i] and st.outs[i].requires_grad:
                torch.autograd.backward(st.outs[i], st.gouts[i], inputs=self._layer_params[i])
            if done is not None:
                done(i)
        st.out = st.inp = st.ins = st.outs = st.gouts = st.groups = None
        self.meter.freed(st.held)

    def _backward_full(self, st: _Mb, done=None) -> None:
        """B and W at once, layer by layer from the last."""
        g = self._grad_at_output(st)
        for i in reversed(range(len(self.layers))):
            wants_in = self._needs_input_grad(st, i)
            inputs = self._layer_params[i] + ([st.ins[i]] if wants_in else [])
            if inputs and st.outs[i].requires_grad:
                torch.autograd.backward(st.outs[i], g, inputs=inputs)
            if done is not None:
                done(i)
            if not wants_in:
                break
            g = st.ins[i].grad
        if not self.is_first:
            st.grad_in = g
        st.out = st.inp = st.ins = st.outs = None
        self.meter.freed(st.held)
        if done is not None:  # layers below the first that needs no input gradient (none in practice)
            for j in range(i - 1, -1, -1):
                done(j)

    # ---- one step --------------------------------------------------------------------------------
    async def run_step(self, step: int, actions: list[sched.Action],
                       on_layer_done: Optional[LayerDone] = None,
                       on_losses: Optional[Callable[[list[float]], None]] = None) -> StepResult:
        """Runs this peer's ``actions`` for ``step``. ``on_layer_done(i)`` (on the event loop) says
        that layer ``i``'s weight gradients for the step are final: while the step's last
        backward op is still running, for the layers it has done (for all, at the end).
        ``on_losses(losses)`` (on the event loop) has the step's losses (``StepResult.losses``) as
        soon as its last forward is done, before the backward ops after it."""
        if self.hops is not None:  # --lanes: the whole step on the compute thread
            return await lane_step.run(self, step, actions, self.hops, on_layer_done, on_losses)
        mbs: dict[int, _Mb] = {}
        sends: list[asyncio.Task] = []
        result = StepResult()
        self.overflowed = False
        self.meter.reset()
        t_compute = 0.0
        t_waited: Optional[float] = 0.0  # of it, waiting for a core (None: unknown)
        last_bw = max((j for j, a in enumerate(actions) if a.op in (sched.Op.W, sched.Op.BW)), default=-1)
        last_f = max((j for j, a in enumerate(actions) if a.op is sched.Op.F), default=-1)
        if self._deferral is not None and not self._split_installed and any(a.op is sched.Op.W for a in actions):
            split_backward.install(list(self.layers), self._deferral)
            self._split_installed = True
        trace = result.timeline
        # when the step's next op is queued on a virtual device, as a host that does not wait for its
        # device would queue it: at once, or when its input arrives (``VirtualDevice.op``'s ``ready``)
        queue_time = self.device.clock if self.device is not None else (lambda: None)
        queued = queue_time()

        def traced(task: asyncio.Task, name: str, mb: int) -> asyncio.Task:
            start = time.time()
            task.add_done_callback(lambda _: trace.append((name, mb, start, time.time())))
            return task

        def hand(k: int, ready: Optional[float]) -> _Handed:
            """``actions[k]``, a compute op, to the compute thread."""
            a = actions[k]
            st = mbs.setdefault(a.mb, _Mb())
            if a.op is sched.Op.F:
                return self._hand("F", self._forward, step, a.mb, st, ready=ready)
            if a.op is sched.Op.B:
                return self._hand("B", self._backward_input, st, ready=ready)
            fn = self._backward_weight if a.op is sched.Op.W else self._backward_full
            return self._hand(a.op.name, fn, st, on_layer_done=on_layer_done if k == last_bw else None, ready=ready)

        async def take(k: int) -> None:
            """``actions[k]``, a RECV: its tensor, waited for."""
            nonlocal queued
            a, w0 = actions[k], time.time()
            st = mbs.setdefault(a.mb, _Mb())
            if a.op is sched.Op.RECV_F:
                st.inp = self._here(await self.recv(ACT, step, a.mb)).requires_grad_(True)
            else:
                st.grad_out = self._here(await self.recv(GRAD, step, a.mb))
            queued = queue_time()
            trace.append((a.op.name, a.mb, w0, time.time()))

        def next_op(j: int) -> tuple[Optional[int], list[int], bool]:
            """The compute op after ``actions[j]`` (None: none), the RECVs before it, and whether
            every tensor they wait for is here already (the sends between them go once ``j`` has
            ended: they send its outputs)."""
            recvs, here = [], True
            for k in range(j + 1, len(actions)):
                op = actions[k].op
                if op in sched.COMPUTE_OPS:
                    return k, recvs, here
                if op is sched.Op.RECV_F or op is sched.Op.RECV_B:
                    recvs.append(k)
                    here = here and self.arrived(ACT if op is sched.Op.RECV_F else GRAD, step, actions[k].mb)
            return None, recvs, here

        async def take_and_hand(recvs: list[int], k: int) -> _Handed:
            """The RECVs before ``actions[k]`` as their tensors come, then ``k`` to the compute thread:
            while the op ahead of it still computes, the thread goes on to ``k`` at once."""
            for r in recvs:
                await take(r)
                taken.add(r)
            h = hand(k, queued)
            handed.append(h)  # (settled with the rest if the step fails before its turn)
            return h

        handed: list[_Handed] = []
        early: Optional[asyncio.Task] = None
        try:
            # a compute op whose tensors are here is handed to the compute thread before the one
            # ahead of it ends, and one whose tensors come while it computes, as they come (``early``):
            # the thread goes on to it at once, not after a turn of the event loop (the ending op's
            # sends go meanwhile). Before, a tensor that came during the op ahead left the thread
            # idle for that turn and its wake-up: 0.57-0.67 ms between ops, about half the ops of a
            # middle stage of the side-by-side's 1F1B (2026-12-03)
            ahead: Optional[tuple[int, _Handed]] = None
            early_from = early_k = 0  # the first action ``early`` does, and its op
            taken: set[int] = set()  # the RECVs done ahead of their turn
            free = 0.0  # when the thread ended the step's last op
            for j, a in enumerate(actions):
                if early is not None and j >= early_from:  # (its RECVs and op: in the list's order)
                    ahead, early = (early_k, await early), None
                if j in taken:
                    continue
                st = mbs.setdefault(a.mb, _Mb())
                op = a.op
                if op is sched.Op.RECV_F or op is sched.Op.RECV_B:
                    await take(j)
                elif op is sched.Op.SEND_F or op is sched.Op.SEND_B:
                    if op is sched.Op.SEND_F:
                        task = self._send(ACT, step, a.mb, st.out)
                    else:
                        task, st.grad_in = self._send(GRAD, step, a.mb, st.grad_in), None
                    sends.append(traced(task, op.name, a.mb))
                    # the send's first turn (encoding, sealing, writing) before the next op is handed
                    # to the compute thread: after it, the send's task waited behind that op's hold
                    # of the GIL and the core, the next stage with it (an activation's way to the
                    # next peer: 1.09-1.18 ms at the median, 5.4-5.6 at the 90th percentile before,
                    # 0.88-0.94 and 2.7-4.4 after, on this 2-core box)
                    await asyncio.sleep(0)
                else:
                    if ahead is not None and ahead[0] == j:
                        h = ahead[1]
                    else:
                        h = hand(j, queued)
                        handed.append(h)
                    ahead = None
                    k, recvs, here = next_op(j) if self.arrived is not None else (None, [], False)
                    if k is not None and here:
                        ahead = (k, await take_and_hand(recvs, k))
                    elif k is not None:
                        early_from, early_k = recvs[0], k
                        early = asyncio.create_task(take_and_hand(recvs, k))
                    out = await h.result()
                    if op is sched.Op.F:
                        if out is not None:
                            result.losses.append(out)
                        if j == last_f and on_losses is not None:
                            on_losses(list(result.losses))
                    # its time from when the thread could have begun it (its wait to wake counts, as
                    # the op ahead of it does not)
                    began, free = max(h.handed, free), h.ended
                    t_compute += h.ended - began
                    t_waited = None if t_waited is None or h.waited is None else t_waited + h.waited
                    trace.append((op.name, a.mb, began, h.ended))
            if last_bw < 0 and on_layer_done is not None:  # no micro-batch of its own: nothing to wait for
                for i in reversed(range(len(self.layers))):
                    on_layer_done(i)
            await asyncio.gather(*sends)
        except BaseException as e:
            if early is not None:  # (what it handed is in ``handed``)
                early.cancel()
                await asyncio.gather(early, return_exceptions=True)
            # nothing handed to the compute thread may land on the state cleared below
            await asyncio.gather(*(h.settle() for h in handed), return_exceptions=True)
            for t in sends:
                t.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            self.zero_grad()
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
                raise
            raise StepFailed(f"step {step} failed: {e}") from e
        result.compute_s, result.core_wait_s = t_compute, t_waited
        result.stash_peak_bytes = self.meter.peak
        return result

    async def recompute(self, step: int, mb: int, x: Optional[torch.Tensor], grad_out: Optional[torch.Tensor]) -> dict:
        """Micro-batch ``mb`` of ``step`` again, on this stage's layers as they are, from a received
        activation ``x`` (the data on the first stage) and output gradient ``grad_out`` (none on the
        last): what would be sent, as ``_send`` sends it ({"send/act": ..., "send/grad": ...}). The
        weights' gradients are untouched (B alone); on a virtual device the ops take their time."""
        # counted apart: a spot check is not part of the step's stash (nor of its prediction)
        st = _Mb(inp=None if self.is_first else self._here(x).requires_grad_(True), meter=StashMeter(self.params))
        wire = (lambda t: t.detach()) if self.compute_dtype is None else (lambda t: t.detach().to(self.compute_dtype))
        await self._compute("F", self._forward, step, mb, st)
        out = {} if self.is_last else {"send/act": wire(st.out)}
        if not self.is_first:
            st.grad_out = self._here(grad_out)
            await self._compute("B", self._backward_input, st)
            out["send/grad"] = wire(st.grad_in)
        return out

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

