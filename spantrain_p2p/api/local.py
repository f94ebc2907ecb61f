"""A small swarm in this process (a founder with the job and its joiners), for a script or a
notebook that trains on one machine: ``AsyncLocalSwarm`` in the caller's asyncio loop, and
``LocalSwarm``, the same without asyncio in the user's code (its loop runs in a thread of its own;
Ctrl-C stops the swarm and leaves no process or port behind)."""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import os
import signal
import tempfile
import threading
import time
import weakref
from typing import Any, Iterator, Optional

from ..job.options import PEER_OWN
from .job import Job
from .session import Session, StepResult, join, start

_names = itertools.count()


class AsyncLocalSwarm:
    """``peers`` peers in this process training ``job``: the first founds the swarm with the job (its
    ``peers`` set to them all), the others join it, with the job's options of every peer (``data``,
    ``device``, ``no_measure``, ...) unless ``joiner_options`` say otherwise; each peer a ``Session``."""

    def __init__(self, job: Job, peers: int = 2, *, swarm: Optional[str] = None, **joiner_options: Any):
        if peers < 1:
            raise ValueError("a swarm needs at least one peer")
        self.job = job.replace(peers=peers)
        self.size = peers
        self.swarm = swarm or f"local-{os.getpid()}-{next(_names)}"
        self.joiner_options = joiner_options
        self.sessions: list[Session] = []

    async def open(self) -> "AsyncLocalSwarm":
        try:
            founder = start(self.job, name="p0", swarm=self.swarm)
            self.sessions.append(founder)
            await founder.open()
            accept = (self.job.model,)  # a user model or model directory is run only where it is named
            # every peer's own options as the job gives them (``spantrain swarm`` passes them to every peer)
            own = {k: v for k, v in self.job.values.items() if k in PEER_OWN}
            for i in range(1, self.size):
                s = join(founder.address, accept=accept, name=f"p{i}", swarm=self.swarm,
                         **{**own, **self.joiner_options})
                self.sessions.append(s)
                await s.open()
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        """Every peer leaves and stops (joiners first)."""
        sessions, self.sessions = self.sessions, []
        for s in reversed(sessions):
            try:
                await s.close()
            except Exception:  # the others still stop
                pass

    async def __aenter__(self) -> "AsyncLocalSwarm":
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def founder(self) -> Session:
        return self.sessions[0]

    def steps(self):
        """The run's steps as they come (``Session.steps``)."""
        return self.founder.steps()

    async def wait(self) -> list[float]:
        return await self.founder.wait()

    async def state_dict(self) -> dict:
        return await self.founder.state_dict()

    async def export(self, out_dir: str) -> str:
        return await self.founder.export(out_dir)

    async def model(self):
        """The trained model as a transformers model (``AutoModelForCausalLM``), through ``export``."""
        import transformers

        with tempfile.TemporaryDirectory(prefix="spantrain-trained-") as d:
            await self.export(d)
            return await asyncio.to_thread(transformers.AutoModelForCausalLM.from_pretrained, d)


_sigint = {"waiting": False, "hit": False}  # the main thread's Ctrl-C while ``_wait`` waits


def _on_sigint(signum, frame) -> None:
    if _sigint["waiting"]:
        _sigint["hit"] = True  # ``_wait`` raises at its next look
    else:
        raise KeyboardInterrupt


def _wait(fut: concurrent.futures.Future, interruptible: bool, timeout: Optional[float] = None):
    """``fut``'s result, waited for in short sleeps. Ctrl-C (SIGINT, in the main thread) meanwhile only
    sets a flag: ``interruptible``, the wait then ends with ``KeyboardInterrupt`` (the work cancelled);
    else it is held back until the work is done. (A KeyboardInterrupt raised wherever the signal lands
    could land inside the future's own lock, which the loop's thread then waits for forever.)

    Only where SIGINT raises ``KeyboardInterrupt`` (Python's own handler) is it taken over: a process
    that ignores it (started in the background by a non-interactive shell) or handles it itself is
    left as it is. Taken over from ``SIG_IGN`` and given back after each wait, a SIGINT stopped the run
    within a wait and was dropped between two: the ctrl-c test's script, started by a suite run
    launched with ``&``, trained on after its one SIGINT (its stacks, 2026-12-01; ``strace`` of it
    started the same way: SIGINT set to ``SIG_IGN`` and back at every step's wait, 149 times in 29 s)."""
    main = threading.current_thread() is threading.main_thread()
    take = main and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    old = signal.signal(signal.SIGINT, _on_sigint) if take else None
    deadline = None if timeout is None else time.monotonic() + timeout
    _sigint["hit"], _sigint["waiting"] = False, take
    try:
        while not fut.done():
            if _sigint["hit"] and interruptible:
                fut.cancel()
                raise KeyboardInterrupt
            if deadline is not None and time.monotonic() > deadline:
                fut.cancel()
                raise TimeoutError("the swarm did not answer in time")
            time.sleep(0.02)
        _sigint["waiting"] = False  # from here a Ctrl-C raises where it lands; one that came before, here
        if _sigint["hit"] and interruptible:
            raise KeyboardInterrupt
        return fut.result()
    finally:
        _sigint["waiting"] = False
        if take:
            signal.signal(signal.SIGINT, old)


_open: "weakref.WeakSet[LocalSwarm]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # an interpreter that exits with a swarm open leaves nothing running
    for swarm in list(_open):
        swarm.close()


class LocalSwarm:
    """``AsyncLocalSwarm`` for code without asyncio (a script, a notebook cell)::

        with LocalSwarm(Job("hf:gpt2-tiny", steps=30), peers=2) as swarm:
            for r in swarm.steps():
                print(r.step, r.loss)
            swarm.export("trained")

    Its event loop runs in a thread of its own (so it works where a loop already runs, as in
    Jupyter). Ctrl-C (``KeyboardInterrupt``) while it waits stops the wait; leaving the ``with`` (or
    ``close()``) then stops every peer, their p2p daemons and ports, whatever happened."""

    def __init__(self, job: Job, peers: int = 2, **options: Any):
        self._swarm = AsyncLocalSwarm(job, peers, **options)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    def _call(self, coro):
        """Runs ``coro`` on the swarm's loop and waits for it; Ctrl-C stops the wait at once."""
        return _wait(asyncio.run_coroutine_threadsafe(coro, self._loop), interruptible=True)

    def open(self) -> "LocalSwarm":
        if self._loop is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="spantrain-swarm", daemon=True)
        self._thread.start()
        _open.add(self)
        try:
            self._call(self._swarm.open())
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stops every peer (Ctrl-C during it is held back until it is done: nothing is left half-stopped)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        _open.discard(self)
        try:
            _wait(asyncio.run_coroutine_threadsafe(self._swarm.close(), loop), interruptible=False, timeout=60)
        except Exception:  # (a peer that did not stop in time: the loop stops anyway)
            pass
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            loop.close()

    def __enter__(self) -> "LocalSwarm":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def sessions(self) -> list[Session]:
        return self._swarm.sessions

    def steps(self) -> Iterator[StepResult]:
        """The run's steps as they come, until the job is done (then its failure, if any, is raised)."""
        it = self._swarm.steps()
        try:
            while True:
                try:
                    yield self._call(it.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop is not None:
                asyncio.run_coroutine_threadsafe(it.aclose(), self._loop)

    def wait(self) -> list[float]:
        """Runs the job to its end; every step's loss."""
        return self._call(self._swarm.wait())

    def state_dict(self) -> dict:
        return self._call(self._swarm.state_dict())

    def export(self, out_dir: str) -> str:
        """Writes the trained transformers model to ``out_dir`` (``from_pretrained`` loads it)."""
        return self._call(self._swarm.export(out_dir))

    def model(self):
        """The trained model as a transformers model."""
        return self._call(self._swarm.model())
