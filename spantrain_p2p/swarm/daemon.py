"""Starting hivemind's p2pd so that it never outlives its peer.

hivemind starts p2pd with ``asyncio.subprocess.create_subprocess_exec``; a peer killed with
SIGKILL would leave the daemon running. On Linux we ask the kernel to SIGKILL the daemon when
its parent dies (PR_SET_PDEATHSIG), by adding a ``preexec_fn`` to that call, which also puts the
daemon in a process group of its own (a terminal's Ctrl-C is for the peer, which stops it).
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys

from ..osproc import die_with_parent


def _die_with_parent() -> None:  # runs in the forked child, before exec
    die_with_parent(signal.SIGKILL)
    # a process group of its own: Ctrl-C in a terminal signals the whole foreground group, and a
    # daemon that died with its peer would break the peer's control connection mid-shutdown (a
    # hivemind traceback and seconds of timeouts); the peer stops it, or the kernel when the peer dies
    os.setpgid(0, 0)


def tie_daemons_to_this_process() -> None:
    """Idempotent: every subprocess started via asyncio from now on dies with this process."""
    if not sys.platform.startswith("linux"):
        return
    create = asyncio.subprocess.create_subprocess_exec
    if getattr(create, "_spantrain_tied", False):
        return

    async def create_tied(*args, **kwargs):
        kwargs.setdefault("preexec_fn", _die_with_parent)
        return await create(*args, **kwargs)

    create_tied._spantrain_tied = True  # type: ignore[attr-defined]
    asyncio.subprocess.create_subprocess_exec = create_tied
