"""Operating-system process helpers shared by the launcher, the zygote and the p2p daemon start.

``die_with_parent(sig)`` asks the kernel to send ``sig`` to the calling process when its parent
dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so that no peer or p2pd outlives the process that
started it. It is meant to run in a freshly forked child (a ``preexec_fn``, or the zygote's fork).

``core_wait_s()``: the seconds the calling thread has spent runnable but waiting for a core (the
kernel's scheduler statistics): what a host whose cores are all busy takes from a compute thread.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Optional

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """The kernel sends ``sig`` to this process when its parent dies (Linux only; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(sig))


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
    if stat is None:
        return None
    try:
        return int(os.pread(stat.fd, 128, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None
