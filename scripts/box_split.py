"""Where the whole machine's CPU goes while a side of the side-by-side trains (issue 31), by thread.

``pipelining_side_by_side.py`` prints each side's CPU a step from the processes' own clocks, and
``loop_cpu.py`` splits an event loop's by coroutine; neither sees the kernel's share, the machine's
idle time, or how much of the cores the compute threads got next to everything else. This samples
every core (``perf record -a``, 499 Hz, no call stacks) for ``--seconds`` once a side trains, and
sorts the samples by the thread they hit:

- ours (``spantrain swarm``, the side-by-side's job): ``compute`` (the peers' ``stage-compute``
  threads), ``event loop`` (a peer's main thread: the data plane, the schedule's hand-offs, the
  control plane), ``other peer threads`` (libuv's workers, the snapshot thread), ``p2p daemon``
  (p2pd), ``launcher`` (``spantrain swarm`` and its zygote);
- theirs (``torch.distributed.pipelining`` over gloo): ``compute`` (a rank's main thread) and
  ``gloo`` (its other threads);
- both: ``idle`` and ``rest of the machine`` (kernel threads, other processes).

Each class's share of the samples, and of it the kernel's (system calls, page faults, the TCP
path). The side's samples/s over its run comes with it (the same job on the same box: compare the
shares, not the rate, across hours)::

    .venv/bin/python scripts/box_split.py
    .venv/bin/python scripts/box_split.py --side ours --schedule zb-h1 --seconds 20

Needs ``perf`` (Debian's linux-perf) and the right to sample the whole machine (root, or
``kernel.perf_event_paranoid`` <= 0). Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pipelining_side_by_side as sbs  # noqa: E402

from spantrain_p2p.pipeline.executor import COMPUTE_THREAD  # noqa: E402
from spantrain_p2p.train.cpu_use import children  # noqa: E402

THEIRS = {"1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble"}
_SAMPLE = re.compile(r"^\s*(.*?)\s+(\d+)/(\d+)\s+[0-9a-f]+\s+\((.*)\)\s*$")


def _threads() -> dict[int, tuple[int, str]]:
    """Every thread on the machine now: tid -> (its process, its name)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    out[int(tid)] = (int(pid), f.read().strip())
        except OSError:
            continue  # (it ended meanwhile)
    return out


def _descendants(root: int) -> set[int]:
    """``root``'s child processes, theirs, and so on (``cpu_use.children``; one that ended: none)."""
    found, todo = set(), [root]
    while todo:
        try:
            kids = children(todo.pop()) - found
        except (OSError, ValueError):
            continue  # (it ended meanwhile)
        found |= kids
        todo.extend(kids)
    return found


def classify(side: str, mine: set[int], threads: dict[int, tuple[int, str]]) -> dict[int, str]:
    """tid -> class, for the threads (tid -> (pid, name)) of the side's processes ``mine``."""
    procs: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    for tid, (pid, name) in threads.items():
        if pid in mine:
            procs[pid].append((tid, name))
    out = {}
    for pid, ts in procs.items():
        names = {n for _, n in ts}
        for tid, name in ts:
            if side == "theirs":
                out[tid] = "compute" if tid == pid else "gloo"
            elif name == "p2pd":
                out[tid] = "p2p daemon"
            elif COMPUTE_THREAD not in names:
                out[tid] = "launcher"  # (spantrain swarm, its zygote)
            elif name == COMPUTE_THREAD:
                out[tid] = "compute"
            else:
                out[tid] = "event loop" if tid == pid else "other peer threads"
    return out


def split(perf_script: str, classes: dict[int, str]) -> dict[str, tuple[int, int]]:
    """class -> (samples, of them in the kernel) from ``perf script -F comm,pid,tid,ip,dso`` lines."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for line in perf_script.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        tid, dso = int(m.group(3)), m.group(4)
        c = "idle" if tid == 0 else classes.get(tid, "rest of the machine")
        out[c][0] += 1
        out[c][1] += dso.startswith("[kernel")
    return {c: (n, k) for c, (n, k) in out.items()}


def record(seconds: float, tmp: str) -> str:
    data = os.path.join(tmp, "perf.data")
    subprocess.run(["perf", "record", "-F", "499", "-a", "-q", "-o", data, "--", "sleep", str(seconds)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return subprocess.run(["perf", "script", "-i", data, "-F", "comm,pid,tid,ip,dso"], check=True,
                          capture_output=True, text=True).stdout


def run_ours(schedule: str, seconds: float, tmp: str) -> dict:
    """Starts our side, waits for its step 6 (the launcher's progress lines), samples, lets it end."""
    scenario = os.path.join(tmp, "unpadded-4.toml")
    with open(scenario, "w") as f:
        f.write(sbs.SCENARIO)
    steps = 30 + int(3 * seconds)  # ample for the window at this box's 0.4-0.8 s a step
    cmd = [sys.executable, "-m", "spantrain_p2p", *sbs.ours_argv(schedule, steps, scenario),
           "--run-dir", os.path.join(tmp, "run"), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    training = threading.Event()

    def follow():
        for line in proc.stderr:
            m = re.match(r"^step\s+(\d+)/", line)
            if m and int(m.group(1)) >= 6:
                training.set()
    threading.Thread(target=follow, daemon=True).start()

    def started():
        if not training.wait(300):
            raise RuntimeError("our side did not reach step 6 within 300 s")
    out, found = _sampled("ours", proc, started, seconds, tmp)
    return {"samples_per_s": json.loads(out.strip().splitlines()[-1])["samples_per_s"], "split": found}


def run_theirs(schedule: str, seconds: float, tmp: str) -> dict:
    """Starts torch's side in a process of its own, samples once its four ranks have run 5 s."""
    steps = 30 + int(3 * seconds)
    code = ("import sys, json; sys.path.insert(0, %r); import pipelining_side_by_side as sbs; "
            "print(json.dumps(sbs.run_theirs(%r, 1, %d, 5, %r)['samples_per_s']))"
            % (os.path.dirname(os.path.abspath(__file__)), THEIRS[schedule], steps, tmp))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def started():
        deadline = time.time() + 120
        while len(_descendants(proc.pid)) < 4:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("torch's side did not start its four ranks")
            time.sleep(0.2)
        time.sleep(5)
    out, found = _sampled("theirs", proc, started, seconds, tmp)
    return {"samples_per_s": json.loads(out.strip().splitlines()[-1]), "split": found}


def _sampled(side: str, proc: subprocess.Popen, started, seconds: float, tmp: str) -> tuple[str, dict]:
    """Once ``started()`` returns (it raises if the side never trains), sorts the side's threads,
    samples the machine for ``seconds`` and waits for the side to end: (its stdout, ``split``)."""
    try:
        started()
        # (torch's side: its root only waits for its ranks, and is left to the rest of the machine)
        mine = _descendants(proc.pid) | ({proc.pid} if side == "ours" else set())
        classes = classify(side, mine, _threads())
        lines = record(seconds, tmp)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # (failed: nothing of it is left running)
            for pid in _descendants(proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{side} side exited {proc.returncode}")
    return out, split(lines, classes)


ORDER = ("compute", "event loop", "other peer threads", "p2p daemon", "launcher", "gloo", "idle", "rest of the machine")


def show(side: str, r: dict) -> None:
    total = sum(n for n, _ in r["split"].values()) or 1
    print(f"{side}: {r['samples_per_s']:.1f} samples/s over its run; {total} samples on the machine's cores")
    for c in sorted(r["split"], key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
        n, k = r["split"][c]
        print(f"  {100 * n / total:5.1f} %  {c}  (kernel {100 * k / total:.1f} %)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=("ours", "theirs", "both"), default="both")
    p.add_argument("--schedule", choices=tuple(THEIRS), default="1f1b",
                   help="ours: this --schedule; theirs: Schedule1F1B or ScheduleInterleavedZeroBubble")
    p.add_argument("--seconds", type=float, default=10.0, help="sampled seconds of training a side")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory(prefix="box-split-") as tmp:  # (perf's data, the runs' folders)
        for side in (("ours", "theirs") if a.side == "both" else (a.side,)):
            r = (run_ours if side == "ours" else run_theirs)(a.schedule, a.seconds, tmp)
            out[side] = r
            show(side, r)
    if a.json:
        print(json.dumps({s: {"samples_per_s": r["samples_per_s"],
                              "split": {c: {"samples": n, "kernel": k} for c, (n, k) in r["split"].items()}}
                          for s, r in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
