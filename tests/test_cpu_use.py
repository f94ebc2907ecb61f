"""Where a peer's step and CPU go (``train.cpu_use``)."""
import os
import subprocess
import sys
import time

import pytest

from spantrain_p2p.train.cpu_use import CpuMeter, children_cpu_s, step_breakdown


def test_a_steps_wall_time_splits_as_its_timeline_says():
    """Compute 0.5 s (F, B, W), waits 0.3 s, the gradient sum 0.1 s, the optimizer 0.05 s of a 1 s step:
    the rest is 0.05 s; the sends (0.4 s, beside the compute) are counted apart. Medians over steps."""
    ops = [("RECV_F", 0, 0.0, 0.2), ("F", 0, 0.2, 0.4), ("SEND_F", 0, 0.4, 0.8), ("RECV_B", 0, 0.4, 0.5),
           ("B", 0, 0.5, 0.65), ("W", 0, 0.65, 0.8), ("SUM", -1, 0.85, 0.95), ("OPT", -1, 0.95, 1.0)]
    one = {"start": 10.0, "end": 11.0, "ops": [(op, mb, 10 + a, 10 + b) for op, mb, a, b in ops]}
    slow = {**one, "end": 13.0}
    got = step_breakdown([one, one, slow])
    assert got == {"compute_s": 0.5, "wait_s": 0.3, "gradient_sum_s": 0.1, "optimizer_s": 0.05,
                   "sends_in_flight_s": 0.4, "other_s": 0.05, "step_s": 1.0, "steps": 3}
    assert step_breakdown([]) is None
    # the compute's wait for a core, where every timeline says it (the median); not where one does not
    waits = [dict(one, core_wait_s=0.1), dict(one, core_wait_s=0.2), dict(slow, core_wait_s=0.4)]
    assert step_breakdown(waits)["compute_core_wait_s"] == 0.2
    assert "compute_core_wait_s" not in step_breakdown([*waits, dict(one, core_wait_s=None)])


def test_the_daemons_cpu_is_counted_and_the_training_threads_are_told_apart():
    """A child process that spins (as the p2p daemon works) is counted as the daemon's; this process's
    own work beyond what its training threads report is the background. By CPU counters, not wall time
    (a loaded host gives the test less CPU, not other figures)."""
    meter = CpuMeter()
    assert meter.figures() is None
    meter.start()
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.time() + 60
        while (children_cpu_s(os.getpid()) or 0.0) - meter.base[2] < 0.2 and time.time() < deadline:
            time.sleep(0.05)
        c0 = time.process_time()
        while time.process_time() - c0 < 0.3:  # this process's own work beside its training threads
            pass
        meter.add_thread(0.1)
        fig = meter.figures()
    finally:
        child.kill()
        child.wait(10)
    assert fig["daemon_cpu_s"] >= 0.2 and fig["process_cpu_s"] >= 0.3 and fig["training_threads_cpu_s"] == 0.1
    assert abs(fig["background_cpu_s"] - (fig["process_cpu_s"] - 0.1)) < 1e-2
    assert fig["background_share"] > 0 and fig["daemon_share"] > 0


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux scheduler statistics")
def test_a_forked_child_reads_its_own_threads_wait_for_a_core_not_its_parents():
    """``osproc.core_wait_s`` keeps its thread's file open; a forked child inherits the thread's
    locals, file included, and must open its own (the zygote forks every peer)."""
    from spantrain_p2p import osproc

    assert osproc.core_wait_s() is not None  # this thread's file, open
    parent = osproc._local.schedstat
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a line to the pipe, then out at once
        ok = False
        try:
            ok = osproc.core_wait_s() is not None and osproc._local.schedstat is not parent \
                and osproc._local.schedstat.pid == os.getpid()
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    assert osproc._local.schedstat is parent  # the parent's stays


def test_a_compute_thread_asks_for_a_long_slice_and_keeps_its_policy_and_nice_value():
    """``osproc.ask_slice``: where the kernel takes a custom slice (EEVDF, Linux >= 6.12; this
    project's machines), the thread's slice is what it asked and its nice value is unchanged; where
    it does not, nothing changes. Out of the kernel's bounds: not asked. The stage executor's
    compute thread asks for ``COMPUTE_SLICE_S``, and bears its name for the OS (``osproc.name_thread``:
    ``top -H`` and perf tell it from the event loop; a name longer than the kernel keeps is cut)."""
    import threading

    import torch

    from spantrain_p2p import osproc
    from spantrain_p2p.pipeline.executor import COMPUTE_SLICE_S, StageExecutor

    out = {}

    def ask():
        tid = threading.get_native_id()
        before, nice = osproc.custom_slice_s(), os.getpriority(os.PRIO_PROCESS, tid)
        out["ok"] = osproc.ask_slice(0.02)
        out["slice"], out["before"] = osproc.custom_slice_s(), before
        out["nice"] = (nice, os.getpriority(os.PRIO_PROCESS, tid))
        out["refused"] = (osproc.ask_slice(5.0), osproc.ask_slice(0.0), osproc.custom_slice_s())

    t = threading.Thread(target=ask)
    t.start()
    t.join()
    assert out["nice"][0] == out["nice"][1]
    assert out["slice"] == (0.02 if out["ok"] else out["before"])
    assert out["refused"] == (False, False, out["slice"])
    if sys.platform.startswith("linux") and tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 12):
        assert out["ok"], "this kernel has custom slices"
    ex = StageExecutor([torch.nn.Linear(2, 2)], True, True, 1, batch=None, recv=None, send=None)
    try:
        tid = ex._pool.submit(threading.get_native_id).result()
        assert osproc.custom_slice_s(tid) == (COMPUTE_SLICE_S if out["ok"] else out["before"])
        if sys.platform.startswith("linux"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                assert f.read().strip() == "stage-compute"
    finally:
        ex.close()
    if sys.platform.startswith("linux"):
        named = {}

        def name():
            osproc.name_thread("a-name-longer-than-fifteen-bytes")
            with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
                named["comm"] = f.read().strip()

        t = threading.Thread(target=name)
        t.start()
        t.join()
        assert named["comm"] == "a-name-longer-t"


def test_a_thread_that_ends_while_the_children_are_read_does_not_hide_them(monkeypatch):
    """A thread pool's thread ended between the listing of a test process's threads and the read of
    its children file: the whole read failed, and the CPU report lost the process's zygote (with
    every peer it had reaped) from one reading: -134 CPU-s for a unit test."""
    import os
    import subprocess

    from spantrain_p2p.train import cpu_use

    child = subprocess.Popen(["sleep", "30"])
    try:
        real = os.listdir
        calls = []

        def listdir(path):
            found = real(path)
            if path == f"/proc/{os.getpid()}/task":
                calls.append(path)
                if len(calls) == 1:
                    return ["999999999", *found]  # a thread that ended after the listing
            return found

        monkeypatch.setattr(cpu_use.os, "listdir", listdir)
        assert child.pid in cpu_use.children(os.getpid()) and len(calls) == 2
        calls.clear()
        assert child.pid in {k for kids in cpu_use.task_children(os.getpid(), ["999999999"]).values() for k in kids}
    finally:
        child.kill()
        child.wait()
