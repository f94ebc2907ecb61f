"""Where a peer's CPU goes while it trains: its training threads (the stage's compute and optimizer
steps, measured on the thread that runs them) against the whole process (the event loop's transport,
(de)serialisation, heartbeats, DHT, status pages, probes) and its p2p daemon, a child process. A
swarm's peer spends CPU a single job does not; on a loaded host (or a volunteer's) that is taken from
compute. Measured from the process's own counters, not estimated: ``time.process_time`` for the
process, ``time.thread_time`` on the compute thread, ``/proc/<pid>/stat`` for the children (Linux;
elsewhere the daemon's share is left out).

And a step's wall time, split the way its timeline says (``step_breakdown``)."""
from __future__ import annotations

import os
import statistics
import time
from typing import Iterable, Optional

COMPUTE_OPS = ("F", "B", "W", "BW")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
TASKS_RESCAN_S = 10.0  # how often ``CpuMeter`` looks for children forked by threads other than the main one


def process_cpu_s(pid: int, reaped: bool = False) -> float:
    """CPU seconds (user + system) a process has used, from /proc (Linux); with ``reaped``, its
    children's too once it has waited for them (and theirs, that they had waited for). OSError or
    ValueError if it cannot be read (the process ended)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    end = 15 if reaped else 13  # utime, stime (fields 14 and 15), then cutime and cstime (16 and 17)
    if len(fields) < end:
        raise ValueError(f"/proc/{pid}/stat is short")
    return sum(int(x) for x in fields[11:end]) * _TICK_S


def task_children(pid: int, tasks: Optional[Iterable[str]] = None) -> dict[str, list[int]]:
    """The child processes each thread of ``pid`` forked (``tasks``: those threads, default all),
    from /proc; OSError or ValueError where it does not say (the process ended).

    A thread that ends while they are read (a thread pool's, every few seconds in a test process)
    hands its children to another thread of the process, maybe one read already: then every thread
    is read again. Before, the whole read failed, and the test CPU report lost a test process's
    zygote, with every peer it had reaped, from one reading (a unit test read -134 CPU-s, another
    test +86 in 20 s)."""
    names = None if tasks is None else list(tasks)
    for _ in range(3):
        found = {}
        try:
            for task in os.listdir(f"/proc/{pid}/task") if names is None else names:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    found[task] = [int(x) for x in f.read().split()]
            return found
        except OSError:
            if not os.path.exists(f"/proc/{pid}"):
                raise
            names = None  # a thread ended meanwhile: all of them again
    raise OSError(f"the threads of process {pid} kept ending while their children were read")


def children(pid: int) -> set[int]:
    """The child processes of ``pid``, whichever of its threads forked them (``task_children``, all
    threads); OSError or ValueError where /proc does not say."""
    return {kid for kids in task_children(pid).values() for kid in kids}


def _cpu_of(kids: Iterable[int]) -> float:
    total = 0.0
    for kid in set(kids):
        try:
            total += process_cpu_s(kid)
        except (OSError, ValueError):
            continue  # it ended meanwhile
    return total


def children_cpu_s(pid: Optional[int] = None) -> Optional[float]:
    """CPU seconds (user + system) of the live child processes of ``pid`` (this one by default): the
    p2p daemon. None where /proc does not say."""
    try:
        return _cpu_of(children(os.getpid() if pid is None else pid))
    except (OSError, ValueError):
        return None


class CpuMeter:
    """CPU seconds since training began: the process's, its training threads' (``add_thread``, from
    ``StageExecutor.take_thread_cpu``) and its children's."""

    def __init__(self) -> None:
        self.base: Optional[tuple[float, float, Optional[float]]] = None  # (wall, process, children)
        self.thread_s = 0.0
        # the other threads that forked children, read each time with the main one; every thread at
        # most every TASKS_RESCAN_S: one file a thread was a fifth of a status page's CPU
        self._tasks: list[str] = []
        self._scanned = -float("inf")

    def _children_cpu_s(self) -> Optional[float]:
        """``children_cpu_s`` of this process, from the threads known to fork (all, now and then)."""
        pid, now = os.getpid(), time.monotonic()
        try:
            if now - self._scanned >= TASKS_RESCAN_S:
                found = task_children(pid)
                self._tasks, self._scanned = [t for t, kids in found.items() if kids and t != str(pid)], now
            else:
                found = task_children(pid, [str(pid), *self._tasks])
            return _cpu_of(k for kids in found.values() for k in kids)
        except (OSError, ValueError):
            return None

    def start(self) -> None:
        if self.base is None:
            self.base = (time.time(), time.process_time(), self._children_cpu_s())

    def add_thread(self, seconds: float) -> None:
        if self.base is not None:
            self.thread_s += seconds

    def figures(self) -> Optional[dict]:
        """Seconds of wall time and of CPU since training began, and the shares of one core."""
        if self.base is None:
            return None
        wall = max(1e-9, time.time() - self.base[0])
        process = time.process_time() - self.base[1]
        kids = self._children_cpu_s()
        daemon = kids - self.base[2] if kids is not None and self.base[2] is not None else None
        background = max(0.0, process - self.thread_s)
        return {"wall_s": round(wall, 3), "process_cpu_s": round(process, 3), "training_threads_cpu_s":
                round(self.thread_s, 3), "background_cpu_s": round(background, 3),
                "daemon_cpu_s": None if daemon is None else round(daemon, 3),
                # shares of one core over the training time
                "training_share": round(self.thread_s / wall, 4), "background_share": round(background / wall, 4),
                "daemon_share": None if daemon is None else round(daemon / wall, 4)}


def step_breakdown(timelines: list[dict]) -> Optional[dict]:
    """Median seconds per step of this peer's recent steps (their timelines, ``Trainer.timelines``):
    compute (its F, B, W ops), waiting for tensors (RECV), the replicas' gradient sum, the optimizer,
    and the rest (the loop between ops: (de)serialising, its own sends' hand-over, the snapshot); and
    the seconds its sends were in flight, beside the rest (they overlap the compute). Where every
    timeline says it (``core_wait_s``, Linux), ``compute_core_wait_s``: the part of the compute that
    its thread spent runnable but waiting for a core, the host's other work on it (other peers, the
    event loop, the daemon): a step slow for want of CPU, not of tensors."""
    rows = []
    for tl in timelines:
        parts = {"compute_s": 0.0, "wait_s": 0.0, "gradient_sum_s": 0.0, "optimizer_s": 0.0, "sends_in_flight_s": 0.0}
        for op, _mb, a, b in tl.get("ops", []):
            d = max(0.0, b - a)
            key = ("compute_s" if op in COMPUTE_OPS else "wait_s" if op.startswith("RECV") else
                   "gradient_sum_s" if op == "SUM" else "optimizer_s" if op == "OPT" else
                   "sends_in_flight_s" if op.startswith("SEND") else None)
            if key is not None:
                parts[key] += d
        wall = max(0.0, tl["end"] - tl["start"])
        parts["other_s"] = max(0.0, wall - parts["compute_s"] - parts["wait_s"] - parts["gradient_sum_s"]
                               - parts["optimizer_s"])
        parts["step_s"] = wall
        waited = tl.get("core_wait_s")
        if isinstance(waited, (int, float)) and not isinstance(waited, bool):
            parts["compute_core_wait_s"] = max(0.0, float(waited))
        rows.append(parts)
    if not rows:
        return None
    keys = [k for k in rows[0] if all(k in r for r in rows)]
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in keys} | {"steps": len(rows)}
