"""The suite's per-test CPU report counts the test process's descendants, running or reaped."""
import json
import os
import subprocess
import sys

from spantrain_p2p.train.cpu_use import process_cpu_s
from tests._cpu_report import CpuReport, tree_cpu_s

# a child that spends ~0.3 s of CPU itself, and has a grandchild spend as much before it exits
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
NESTED = BURN + f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN!r}], check=True)\n"


def test_the_cpu_of_reaped_children_and_grandchildren_counts():
    before = tree_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", NESTED], check=True)
    spent = tree_cpu_s(os.getpid()) - before
    assert spent >= 0.55, spent  # both burns (and two interpreters' start), not the waiting parent's nothing


def test_running_children_count_and_a_sibling_is_not_in_a_childs_tree():
    import time

    before = tree_cpu_s(os.getpid())
    wait = BURN + "import sys\nsys.stdin.read()\n"  # burns, then runs on until its stdin closes
    kids = [subprocess.Popen([sys.executable, "-c", wait], stdin=subprocess.PIPE) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while min(process_cpu_s(k.pid) for k in kids) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_s(os.getpid()) - before >= 0.55  # both burns, while the two still run
        own = process_cpu_s(kids[0].pid)
        assert abs(tree_cpu_s(kids[0].pid) - own) < 0.02  # its sibling's burn is not in its tree
    finally:
        for k in kids:
            k.communicate(b"")


def test_a_report_line_per_test_with_its_cpu_and_wall_time(tmp_path):
    import types

    path = tmp_path / "cpu.jsonl"
    rep = CpuReport(str(path))
    item = types.SimpleNamespace(nodeid="tests/x.py::test_y")
    rep.pytest_runtest_setup(item)
    subprocess.run([sys.executable, "-c", BURN], check=True)
    for when in ("setup", "call", "teardown"):
        rep.pytest_runtest_logreport(types.SimpleNamespace(nodeid=item.nodeid, when=when))
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["test"] == "tests/x.py::test_y" and row["cpu_s"] >= 0.25 and row["wall_s"] >= row["cpu_s"] * 0.5


def test_the_timeline_spreads_each_test_over_its_time(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import suite_cpu

    rows = [{"test": "a", "cpu_s": 20.0, "wall_s": 20.0, "end_unix": 1020.0},  # 1000-1020: one core
            {"test": "b", "cpu_s": 1.0, "wall_s": 4.0, "end_unix": 1014.0},  # 1010-1014: a short one
            {"test": "old", "cpu_s": 5.0, "wall_s": 5.0, "end_unix": float("nan")}]  # an older report's line
    bins = suite_cpu.timeline(rows, 10.0)
    assert [b["t_s"] for b in bins] == [0.0, 10.0, 20.0]
    assert bins[0] == {"t_s": 0.0, "tests": 1.0, "long_tests": 1.0, "cores": 1.0}
    assert bins[1] == {"t_s": 10.0, "tests": 1.4, "long_tests": 1.0, "cores": 1.1}
    assert bins[2]["tests"] == 0.0 and suite_cpu.timeline([], 10.0) == []
