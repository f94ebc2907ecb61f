"""Operating-system process helpers shared by the launcher, the zygote and the p2p daemon start.

``die_with_parent(sig)`` asks the kernel to send ``sig`` to the calling process when its parent
dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so that no peer or p2pd outlives the process that
started it. It is meant to run in a freshly forked child (a ``preexec_fn``, or the zygote's fork).
"""
from __future__ import annotations

import ctypes
import os
import sys

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
