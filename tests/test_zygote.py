"""The zygote forks peer processes that behave like ones started with Popen: exit codes, signals, logs."""
import json
import os
import signal
import subprocess
import time

import pytest

from spantrain_p2p.launch import zygote
from spantrain_p2p.launch import wait_until


@pytest.fixture
def zyg():
    z = zygote.Zygote()
    yield z
    z.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_forked_peer_reports_its_exit_code_and_writes_its_log(zyg, tmp_path):
    log = tmp_path / "bad.log"
    p = zyg.spawn(["--no-such-flag"], str(log))
    assert p.wait(30) == 2  # argparse's usage error, as from the command line
    assert "unrecognized arguments: --no-such-flag" in log.read_text()
    assert p.poll() == 2 and p.returncode == 2


def test_a_forked_peer_runs_in_its_own_session_and_answers_signals(zyg, tmp_path):
    ready = tmp_path / "a.ready.json"
    p = zyg.spawn(["--ready-file", str(ready), "--swarm", f"zyg-{os.getpid()}"], str(tmp_path / "a.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    wait_until(ready.exists, 60)
    info = json.loads(ready.read_text())
    assert info["pid"] == p.pid and os.getsid(p.pid) == p.pid  # killpg(pid) reaches it and its p2pd
    p.send_signal(signal.SIGINT)  # Ctrl-C: a clean leave
    assert p.wait(20) == 0
    assert "stopping: leaving the swarm" in (tmp_path / "a.log").read_text()

    q = zyg.spawn(["--swarm", f"zyg2-{os.getpid()}"], str(tmp_path / "b.log"))
    time.sleep(0.5)
    q.kill()
    assert q.wait(10) == -signal.SIGKILL


def test_children_get_sigterm_when_the_zygote_goes(tmp_path):
    z = zygote.Zygote()
    ready = tmp_path / "c.ready.json"
    p = z.spawn(["--ready-file", str(ready), "--swarm", f"zyg3-{os.getpid()}"], str(tmp_path / "c.log"))
    wait_until(ready.exists, 60)
    z.close()  # what happens when the launcher exits: EOF on the zygote's stdin
    wait_until(lambda: _gone(p.pid), 20)
