"""Operating-system process helpers shared by the launcher, the zygote and the p2p daemon start.

``die_with_parent(sig)`` asks the kernel to send ``sig`` to the calling process when its parent
dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so that no peer or p2pd outlives the process that
started it. It is meant to run in a freshly forked child (a ``preexec_fn``, or the zygote's fork).

``core_wait_s()``: the seconds the calling thread has spent runnable but waiting for a core (the
kernel's scheduler statistics): what a host whose cores are all busy takes from a compute thread.

``ask_slice(seconds)``: asks the kernel's scheduler (EEVDF, Linux >= 6.12) to run the calling thread
that long at a time once it has a core (its custom slice), rather than the default ~3 ms.

``name_thread(name)``: the calling thread's name where the OS shows threads (``top -H``, ``ps -L``,
perf, ``/proc/TID/comm``); Python 3.11 keeps a ``threading`` name to itself.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import threading
from typing import Optional

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(sig: int) -> None:
    """The kernel sends ``sig`` to this process when its parent dies (Linux only; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(sig))


def name_thread(name: str) -> None:
    """Names the calling thread for the OS (its first 15 bytes; Linux only, elsewhere nothing): a
    peer's compute thread shows as ``stage-compute`` beside its event loop (the process's main
    thread), not as one more ``python`` (``scripts/box_split.py`` tells them apart by it)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Moves the calling thread (a forked child: the whole process) into network namespace ``name``
    (``ip netns add NAME``, at /run/netns/NAME); OSError if it cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class _Schedstat:
    """This thread's /proc/thread-self/schedstat, open while the thread lives (read again with
    ``pread``: 0.4 us, where an open and a read cost ~10)."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # bound to the calling thread
        self.pid = os.getpid()  # (a forked child's thread is another: it opens its own)

    def __del__(self) -> None:  # (the thread's locals go when it ends)
        os.close(self.fd)


_local = threading.local()


def core_wait_s() -> Optional[float]:
    """Seconds the calling thread has waited, runnable, for a core since it started: Linux's
    per-thread ``run_delay`` (/proc/thread-self/schedstat, its second figure, in ns). Counted from
    when the thread is woken (handed work) or preempted to when it runs again. None where the kernel
    does not say (not Linux, or without scheduler statistics)."""
    stat = getattr(_local, "schedstat", False)
    if stat is False or (stat is not None and stat.pid != os.getpid()):
        try:
            stat = _Schedstat()
        except OSError:
            stat = None
        _local.schedstat = stat
    return None if stat is None else _run_delay_s(stat.fd)


def _run_delay_s(fd: int) -> Optional[float]:
    """The second figure of an open schedstat file (``run_delay``, ns), in seconds; None if unreadable."""
    try:
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class ThreadCoreWait:
    """``core_wait_s`` of another thread of this process (``tid``), read from any thread: its
    /proc/self/task/TID/schedstat, open until ``close``. ``read()``: None where the kernel does not
    say (or the thread has ended)."""

    def __init__(self, tid: int) -> None:
        try:
            self.fd: Optional[int] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = None

    def read(self) -> Optional[float]:
        return None if self.fd is None else _run_delay_s(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# sched_setattr(2): its number where this process's architecture has one we know
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_SCHED_ATTR = struct.Struct("IIQiIQQQII")  # size, policy, flags, nice, priority, runtime, deadline, period, util min/max
SCHED_OTHER = 0


def ask_slice(seconds: float) -> bool:
    """Asks for a custom slice of ``seconds`` (0.1-100 ms) for the calling thread, its policy
    (SCHED_OTHER) and nice value kept: whether the kernel took it. A thread that computes for tens
    of milliseconds between waits, on a host where more such threads than cores take turns (peers
    sharing a machine), is then switched out less often, and each switch costs it its caches: four
    processes computing the side-by-side's job on two cores spent 1,182-1,272 ms of CPU a step with
    20 ms slices against 1,298-1,435 with the default, the four peers of our side of it 1,244-1,301
    against 1,309-1,329 in their compute threads (issue 31). A thread that wakes briefly
    (an event loop) keeps the default short slice, so it still runs soon after it wakes. False,
    changing nothing, on a kernel without custom slices or another platform."""
    number = _SCHED_SETATTR.get(platform.machine()) if sys.platform.startswith("linux") else None
    if number is None or not 1e-4 <= seconds <= 0.1:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    tid = threading.get_native_id()
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return False
    ns = round(seconds * 1e9)
    attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(_SCHED_ATTR.size, SCHED_OTHER, 0, nice, 0, ns, 0, 0, 0, 0))
    if libc.syscall(number, tid, attr, 0) != 0:
        return False
    return custom_slice_s(tid) == ns / 1e9


def custom_slice_s(tid: Optional[int] = None) -> Optional[float]:
    """The slice (seconds) the kernel gives thread ``tid`` (default: the calling one), from
    /proc/self/task/TID/sched (``se.slice``); None where it does not say."""
    tid = threading.get_native_id() if tid is None else tid
    try:
        with open(f"/proc/self/task/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1]) / 1e9
    except (OSError, ValueError):
        pass
    return None
