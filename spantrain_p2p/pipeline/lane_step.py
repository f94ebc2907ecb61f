"""One step of a stage run whole on its compute thread, its tensors on lanes (``--lanes``, issue 31).

The event loop's way (``StageExecutor.run_step``) hands each op to the compute thread and each
tensor to the data plane: per tensor an answer, a few wake-ups of the loop and hand-offs between
the two threads, about 1.4 ms of the loops' CPU for a 256 KiB activation on the side-by-side's
swarm (its four peers' loops took 230 ms of CPU a second, 2026-12-03). Here the compute thread
follows the schedule's list itself: it reads what an op needs from the sender's lane when its turn
comes, computes, and writes what the op made to the next peer's lane (``train.lane_hops``: over the
event loop where a hop has no lane). The ops are the executor's own (``run_op``: a virtual device
pads them as before), so the arithmetic is the same to the last bit.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Optional

from ..osproc import ThreadCoreWait
from . import schedule as sched
from . import split_backward
from .messages import ACT, GRAD
from .step_state import StepFailed, StepResult, _Mb


async def run(ex, step: int, actions: list, hops, on_layer_done: Optional[Callable[[int], None]] = None,
              on_losses: Optional[Callable[[list[float]], None]] = None):
    """``StageExecutor.run_step``'s result for ``step``, the step run on ``ex``'s compute thread with
    ``hops`` (``train.lane_hops.LaneHops``) for its tensors. A step that fails or is cancelled shuts
    the lanes down (waking the thread if it waits on one), waits for the thread, and leaves no
    gradient behind."""

    loop = asyncio.get_running_loop()
    result = StepResult()
    ex.overflowed = False
    ex.meter.reset()
    last_bw = max((j for j, a in enumerate(actions) if a.op in (sched.Op.W, sched.Op.BW)), default=-1)
    last_f = max((j for j, a in enumerate(actions) if a.op is sched.Op.F), default=-1)
    if ex._deferral is not None and not ex._split_installed and any(a.op is sched.Op.W for a in actions):
        split_backward.install(list(ex.layers), ex._deferral)
        ex._split_installed = True
    queue_time = ex.device.clock if ex.device is not None else (lambda: None)
    wire = (lambda t: t.detach()) if ex.compute_dtype is None else (lambda t: t.detach().to(ex.compute_dtype))

    def step_on_thread() -> None:
        if ex._thread_wait is None:
            ex._thread_wait = ThreadCoreWait(threading.get_native_id())
        wait0 = ex._thread_wait.read()
        mbs: dict[int, _Mb] = {}
        trace = result.timeline
        queued = queue_time()
        compute = 0.0
        for j, a in enumerate(actions):
            st = mbs.setdefault(a.mb, _Mb())
            op, t0 = a.op, time.time()
            if op is sched.Op.RECV_F:
                st.inp = ex._here(hops.recv(ACT, step, a.mb)).requires_grad_(True)
                queued = queue_time()
            elif op is sched.Op.RECV_B:
                st.grad_out = ex._here(hops.recv(GRAD, step, a.mb))
                queued = queue_time()
            elif op is sched.Op.SEND_F:
                hops.send(ACT, step, a.mb, wire(st.out))
            elif op is sched.Op.SEND_B:
                hops.send(GRAD, step, a.mb, wire(st.grad_in))
                st.grad_in = None
            else:
                if op is sched.Op.F:
                    phase, fn, args = "F", ex._forward, (step, a.mb, st)
                elif op is sched.Op.B:
                    phase, fn, args = "B", ex._backward_input, (st,)
                else:
                    phase, args = op.name, (st,)
                    fn = ex._backward_weight if op is sched.Op.W else ex._backward_full
                out = ex.run_op(loop, phase, fn, *args, on_layer_done=on_layer_done if j == last_bw else None,
                                ready=queued)
                compute += time.time() - t0
                if op is sched.Op.F:
                    if out is not None:
                        result.losses.append(out)
                    if j == last_f and on_losses is not None:
                        loop.call_soon_threadsafe(on_losses, list(result.losses))
            trace.append((op.name, a.mb, t0, time.time()))
        if last_bw < 0 and on_layer_done is not None:  # no micro-batch of its own: nothing to wait for
            for i in reversed(range(len(ex.layers))):
                loop.call_soon_threadsafe(on_layer_done, i)
        hops.finish()
        result.compute_s = compute
        wait1 = ex._thread_wait.read()
        result.core_wait_s = None if wait0 is None or wait1 is None else max(0.0, wait1 - wait0)

    done = ex._pool.submit(ex._counted, step_on_thread)
    try:
        await asyncio.wrap_future(done)
    except BaseException as e:
        hops.abort()  # (a thread waiting on a lane wakes)
        await asyncio.wait([asyncio.wrap_future(done)])
        ex.zero_grad()
        if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
            raise
        raise StepFailed(f"step {step} failed: {e}") from e
    result.stash_peak_bytes = ex.meter.peak
    return result
