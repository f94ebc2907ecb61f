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


def _mapped(pid: int, name: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any(name in line for line in f)


def test_a_requested_import_is_done_before_the_next_fork_and_only_of_what_it_may_import(zyg, tmp_path):
    """An ``hf:`` job's launcher has the zygote import transformers once (``processes.preloads``),
    instead of each of the job's peers importing it (2.2 s of CPU each)."""
    assert "not a module the zygote imports" in zyg.preload(["os"])
    assert not _mapped(zyg.pid, "regex/_regex")  # (a library of transformers' that the zygote's own imports lack)
    assert zyg.preload(list(zygote.IMPORTABLE)) is None
    assert _mapped(zyg.pid, "regex/_regex")
    assert zyg.preload(list(zygote.IMPORTABLE)) is None  # already: not asked again
    p = zyg.spawn(["--no-such-flag"], str(tmp_path / "after.log"))
    assert p.wait(30) == 2

    from spantrain_p2p.launch.processes import preloads

    assert preloads(["--swarm", "s", "--model", "hf:gpt2-tiny"]) == ["transformers.modeling_utils"]
    assert preloads(["--model=hf:./dir"]) == ["transformers.modeling_utils"]
    assert preloads(["--model", "transformer"]) == preloads(["--join", "/ip4/1.2.3.4/tcp/1"]) == []


def test_children_get_sigterm_when_the_zygote_goes(tmp_path):
    z = zygote.Zygote()
    ready = tmp_path / "c.ready.json"
    p = z.spawn(["--ready-file", str(ready), "--swarm", f"zyg3-{os.getpid()}"], str(tmp_path / "c.log"))
    wait_until(ready.exists, 60)
    z.close()  # what happens when the launcher exits: EOF on the zygote's stdin
    wait_until(lambda: _gone(p.pid), 20)
