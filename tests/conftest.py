import os
import signal
import subprocess

import pytest

from spantrain_p2p.launch import zygote
from spantrain_p2p.launch import PeerProcess


@pytest.fixture
def peers(tmp_path):
    """Starts spantrain-peer processes; every one of them (and its p2pd) is killed at teardown."""
    started: list[PeerProcess] = []

    def start(name: str, *args: str) -> PeerProcess:
        p = PeerProcess(name, list(args), str(tmp_path)).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


@pytest.fixture(autouse=True, scope="session")
def no_process_left_behind():
    """At the end of the session, no child of the test process (nor of its zygote) may still run."""
    yield
    z = zygote.existing()  # peers forked by the test process's zygote are its children, not ours
    left = _children(z.pid) if z is not None and z.pid is not None else []
    if z is not None:
        z.close()
    left += _children(os.getpid())
    for c in left:
        try:
            os.kill(c, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"tests left processes behind: {left}"
