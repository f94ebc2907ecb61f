"""Starting hivemind's p2pd so that it never outlives its peer.

hivemind starts p2pd with ``asyncio.subprocess.create_subprocess_exec``; a peer killed with
SIGKILL would leave the daemon running. On Linux we ask the kernel to SIGKILL the daemon when
its parent dies (PR_SET_PDEATHSIG), by adding a ``preexec_fn`` to that call, which also puts the
daemon in a process group of its own (a terminal's Ctrl-C is for the peer, which stops it).

A daemon killed so (or a peer killed before it stopped its daemon) leaves its Unix socket file in
/tmp: hivemind removes the two files only when the peer stops the daemon itself, and about 60 piled
up there with each run of this project's test suite. ``sweep_stale_sockets`` removes the daemons'
that nothing listens on any more, at a peer's start.
"""
from __future__ import annotations

import asyncio
import glob
import os
import signal
import socket
import stat
import sys
import time

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


STALE_AFTER_S = 60.0  # a socket younger than this may be a daemon's between its bind and its listen


def daemon_socket_pattern() -> str:
    """Where hivemind puts a p2p daemon's Unix socket (``P2P._UNIX_SOCKET_PREFIX``). Its client's
    socket, beside it, is the peer's own: a probe of a live one would end in its handler's traceback,
    and none were left behind (0 after the suite's runs, 2026-12-02)."""
    from hivemind.p2p.p2p_daemon import P2P

    return f"{P2P._UNIX_SOCKET_PREFIX.removeprefix('/unix')}p2pd-*.sock"


def sweep_stale_sockets(pattern: str, older_than_s: float = STALE_AFTER_S) -> int:
    """Removes the Unix socket files matching ``pattern`` (a glob) that nothing listens on: a
    connection to each is refused. One that answers, one younger than ``older_than_s`` (its daemon
    may be starting), anything not a socket or not ours to remove stays. Returns how many went."""
    gone, now = 0, time.time()
    for path in sorted(glob.glob(pattern)):
        try:
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or now - st.st_mtime < older_than_s:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(path)
                    continue  # a live daemon listens on it
                except ConnectionRefusedError:
                    pass
            os.unlink(path)
            gone += 1
        except OSError:  # gone meanwhile, not ours, or a listener too busy to answer: left
            continue
    return gone
