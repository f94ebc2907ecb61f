import os
import signal
import subprocess

import pytest
import torch

from spantrain_p2p.launch import zygote
from spantrain_p2p.launch import PeerProcess

# The test process shares two cores with the other xdist worker and with the peers it starts (each
# peer computes on one thread). With torch's default of one thread per core, two workers computing
# at once (two reference runs of 400 steps) spin against each other: 145 s each instead of 7 s, which
# timed out two tests in CI. One thread is as fast alone (6.7 s against 7.1 s) and stays so side by side.
torch.set_num_threads(1)


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


def pytest_configure(config):
    """``SPANTRAIN_TEST_CPU=FILE``: each test's CPU, its peers' included, to FILE (``tests/_cpu_report.py``).
    In xdist's workers, ``SPANTRAIN_TEST_RUN_DIR``: the folder of this run the workers share (their
    base temps, ``pytest-N/popen-gwK``, are in it), for the heavy tests' slots and what they compute
    once for all (``tests/_reference_cache.py``)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and config.option.basetemp:
        os.environ["SPANTRAIN_TEST_RUN_DIR"] = os.path.dirname(os.path.abspath(config.option.basetemp))
    path = os.environ.get("SPANTRAIN_TEST_CPU")
    if path:
        from tests._cpu_report import CpuReport

        config.pluginmanager.register(CpuReport(os.path.abspath(path)), "spantrain-cpu-report")


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


# Tests marked `heavy` (tens of seconds alone: most start a swarm of peer processes, a LocalSwarm
# or a virtual internet; a few search plans) time their training by events, but three of them at
# once on this 2-core box put twelve peers and their daemons on two cores, and each one's
# timing-sensitive parts (link estimates, step deadlines, a joiner's measuring) then ran several
# times slower than alone: the failures CI saw came from there. At most HEAVY_SLOTS of them run at a
# time; the other worker takes the light tests meanwhile. The slot is taken before the test's timeout
# starts (this wrapper is outside pytest-timeout's), so waiting for one does not count against it.
HEAVY_SLOTS = max(1, int(os.environ.get("SPANTRAIN_TEST_HEAVY_SLOTS", "2")))


def _take_slot(folder: str):
    import fcntl
    import time

    os.makedirs(folder, exist_ok=True)
    while True:
        for i in range(HEAVY_SLOTS):
            f = open(os.path.join(folder, f"slot{i}"), "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if the worker dies
                return f
            except BlockingIOError:
                f.close()
        time.sleep(0.2)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in xdist's workers only
    if run is None or item.get_closest_marker("heavy") is None:
        yield
        return
    slot = _take_slot(os.path.join(os.environ["SPANTRAIN_TEST_RUN_DIR"], f"heavy-slots-{run}"))
    try:
        yield
    finally:
        slot.close()
