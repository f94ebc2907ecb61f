"""Where a peer's event loop spends its CPU while it trains, by role: a diagnostic, off by default.

The run summary's ``cpu`` splits a peer's CPU into its compute threads and the rest (``cpu_use``).
The rest is mostly the event loop, and it carries the data plane, the schedule's hand-offs, the
replicas' gradient sum, the buddy copies and the control plane (DHT, membership, election, probes,
status pages) at once. With ``SPANTRAIN_LOOP_CPU=DIR`` in a peer's environment, its loop times each
turn of each task (``time.thread_time`` around one step of its coroutine) and each call of the data
plane's and the streams' protocol callbacks, from its first training step to its last, and writes
``DIR/<peer name>.loop_cpu.json``: the wall and loop-thread CPU seconds, and per coroutine (its
qualified name) or callback the CPU seconds and turns. ``role`` sorts them; what no task or
callback took (the loop's own polling, callbacks from other threads, timers) is "loop".
``scripts/loop_cpu.py`` runs a swarm with it and prints the table.

It costs about 1.5 us a turn (a few ms a second on a busy peer), so it stays off where speed is
measured. Measured from the thread's own CPU clock, unlike a sampling profiler, which on a host
with more runnable threads than cores counts the time a thread waited for a core as its own.
"""
from __future__ import annotations

import asyncio
import collections
import collections.abc
import json
import logging
import os
import time
from typing import Callable, Optional

ENV = "SPANTRAIN_LOOP_CPU"
log = logging.getLogger("spantrain.train")

# (prefix of a coroutine's or callback's qualified name, role); the first that matches
ROLES: tuple[tuple[str, str], ...] = (
    ("GradientSum.", "gradient sum"),
    ("Verifier.", "gradient sum"),
    ("Recovery.", "recovery"),
    ("Trainer.", "schedule"),
    ("StageExecutor.run_step", "schedule"),
    ("StageExecutor._send", "data plane"),
    ("PipelineTransport.", "data plane"),
    ("DataPlaneClient.", "data plane"),
    ("DataPlaneServer.", "data plane"),
    ("FramedConnection.", "data plane"),
    ("FirstBytes.", "data plane"),
    ("Handshaking.", "data plane"),
    ("SecureProtocol.", "data plane"),
    ("SecureReader.", "data plane"),
    ("Authenticator.", "data plane"),
    ("RequestHandler.", "status pages"),
    ("DHT", "control plane"),
    ("ControlClient.", "control plane"),
    ("ControlMeter.", "control plane"),
    ("P2P.", "control plane"),
    ("GuardedDHT.", "control plane"),
    ("Election.", "control plane"),
    ("Coordinator.", "control plane"),
    ("SwimLoop.", "control plane"),
    ("Peer.", "control plane"),
    ("Measuring.", "control plane"),
    ("RunRecords.", "control plane"),
    ("LoopLag.", "control plane"),
    ("find_values.", "control plane"),
    ("StreamReaderProtocol.", "streams (DHT daemon, pages, replies)"),
)


def role(name: str) -> str:
    """The role of the coroutine or callback named ``name`` (a qualified name), "other" if none."""
    for prefix, r in ROLES:
        if name.startswith(prefix):
            return r
    return "other"


def by_role(figures: dict) -> dict[str, float]:
    """Seconds of the loop's CPU per role from one peer's ``figures`` (what ``dump`` writes), the rest
    of the loop thread's CPU as "loop"."""
    out: collections.Counter = collections.Counter()
    for name, (cpu_s, _turns) in figures["coroutines"].items():
        out[role(name)] += cpu_s
    out["loop"] += max(0.0, figures["loop_cpu_s"] - sum(out.values()))
    return dict(out)


class _Meter:
    def __init__(self) -> None:
        self.cpu: collections.Counter = collections.Counter()
        self.turns: collections.Counter = collections.Counter()
        self.on = False
        self.depth = 0  # a callback inside another is the outer one's
        self.callbacks_timed = False
        self.t0 = (0.0, 0.0)  # (wall, loop thread CPU) when counting last began
        self.wall_s = self.loop_s = 0.0  # over the training so far


_M = _Meter()


class _Timed(collections.abc.Coroutine):
    """A coroutine whose turns are timed (a ``collections.abc.Coroutine``, so that a Task takes it)."""

    __slots__ = ("_c", "_name")

    def __init__(self, c, name: str):
        self._c, self._name = c, name

    def send(self, value):
        if not _M.on:
            return self._c.send(value)
        t = time.thread_time()
        try:
            return self._c.send(value)
        finally:
            _M.cpu[self._name] += time.thread_time() - t
            _M.turns[self._name] += 1

    def throw(self, *exc):
        if not _M.on:
            return self._c.throw(*exc)
        t = time.thread_time()
        try:
            return self._c.throw(*exc)
        finally:
            _M.cpu[self._name] += time.thread_time() - t
            _M.turns[self._name] += 1

    def close(self):
        return self._c.close()

    def __await__(self):
        return self._c.__await__()

    @property
    def cr_frame(self):  # (a Task's stack, for its repr and debugging)
        return getattr(self._c, "cr_frame", None)

    @property
    def cr_running(self):
        return getattr(self._c, "cr_running", False)


def _name_of(coro) -> str:
    """A coroutine's qualified name; a module-level function's with its module's last part ("find_values.call")."""
    name = getattr(coro, "__qualname__", type(coro).__name__)
    if "." not in name:
        frame = getattr(coro, "cr_frame", None)
        module = frame.f_globals.get("__name__", "") if frame is not None else ""
        name = f"{module.rpartition('.')[2]}.{name}" if module else name
    return name


def _task_factory(loop, coro, **kwargs):
    return asyncio.Task(_Timed(coro, _name_of(coro)), loop=loop, **kwargs)


def _timed_callback(f: Callable, name: str) -> Callable:
    def timed(self, *args, **kwargs):
        if not _M.on or _M.depth:
            return f(self, *args, **kwargs)
        _M.depth += 1
        t = time.thread_time()
        try:
            return f(self, *args, **kwargs)
        finally:
            _M.depth -= 1
            _M.cpu[name] += time.thread_time() - t
            _M.turns[name] += 1
    return timed


def _time_callbacks() -> None:
    if _M.callbacks_timed:
        return
    _M.callbacks_timed = True
    import asyncio.streams

    from ..net import connections, secure

    for cls, method in ((secure.SecureProtocol, "buffer_updated"), (secure.SecureProtocol, "get_buffer"),
                        (connections.FramedConnection, "buffer_updated"), (connections.FramedConnection, "get_buffer"),
                        (connections.FirstBytes, "buffer_updated"), (connections.Handshaking, "data_received"),
                        (asyncio.streams.StreamReaderProtocol, "data_received")):
        setattr(cls, method, _timed_callback(getattr(cls, method), f"{cls.__name__}.{method}"))


def wrap_loop_factory(factory: Optional[Callable]) -> Optional[Callable]:
    """``factory`` (an ``asyncio.Runner``'s ``loop_factory``, None for asyncio's), timing its loop's
    tasks, where ``SPANTRAIN_LOOP_CPU`` is set; else ``factory`` itself."""
    if not os.environ.get(ENV):
        return factory
    _time_callbacks()

    def make():
        loop = factory() if factory is not None else asyncio.new_event_loop()
        loop.set_task_factory(_task_factory)
        return loop
    return make


def begin() -> None:
    """Training begins (again, after a re-plan): counting goes on (where the loop is timed)."""
    if os.environ.get(ENV) and not _M.on:
        _M.t0 = (time.time(), time.thread_time())
        _M.on = True


def end(name: str) -> Optional[str]:
    """Training stopped: writes the figures of every training epoch so far to
    ``$SPANTRAIN_LOOP_CPU/<name>.loop_cpu.json``; its path."""
    if not _M.on:
        return None
    _M.on = False
    _M.wall_s += time.time() - _M.t0[0]
    _M.loop_s += time.thread_time() - _M.t0[1]
    folder = os.environ[ENV]
    figures = {"wall_s": round(_M.wall_s, 4), "loop_cpu_s": round(_M.loop_s, 6),
               "coroutines": {k: [round(v, 6), _M.turns[k]] for k, v in _M.cpu.most_common()}}
    path = os.path.join(folder, f"{name}.loop_cpu.json")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
    except OSError as e:  # a diagnostic: it never stops a peer (this runs as training ends, or fails)
        log.warning("could not write the loop's CPU figures to %s: %s", path, e)
        return None
    return path
