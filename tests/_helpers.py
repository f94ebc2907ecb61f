"""Helpers several test modules share."""
import contextlib
import io
import json
import signal
from typing import Optional


def run_swarm_json(*argv: str) -> dict:
    """``spantrain swarm ARGV --json`` run in this process; its run summary, as JSON gives it.

    In-process, the launcher forks the peers from this process's zygote, which the suite keeps
    warm: ~3.5 s less per launch than a fresh ``spantrain`` process (its zygote imports torch).
    The launcher's progress and errors go to stderr (pytest shows them on a failure)."""
    code, summary = run_swarm_exit(*argv)
    assert code == 0 and summary is not None, f"spantrain swarm exited {code} (its output: stderr above)"
    return summary


def run_swarm_exit(*argv: str) -> tuple[int, Optional[dict]]:
    """``spantrain swarm ARGV --json`` run in this process, as ``run_swarm_json``: the exit code the
    command would give and its run summary (None where it gave none), for runs meant to fail. What
    the command says on stderr, the test reads with ``capfd``."""
    from spantrain_p2p.cli.main import main_parser
    from spantrain_p2p.launch.swarm import run_swarm

    args = main_parser().parse_args(["swarm", *argv, "--json"])
    before = signal.getsignal(signal.SIGTERM)  # the launcher installs its own
    try:
        code, summary = run_swarm(args)
    finally:
        signal.signal(signal.SIGTERM, before)
    return code, None if summary is None else json.loads(json.dumps(summary))


def export_json(*argv: str) -> dict:
    """``spantrain export ARGV --json`` run in this process (its imports are the test process's, ~3 CPU-s
    less than a fresh ``spantrain``): the JSON line it prints. The command line's own exit codes and
    errors: ``tests/test_export.py``."""
    from spantrain_p2p.cli.export import export_command
    from spantrain_p2p.cli.main import main_parser

    args = main_parser().parse_args(["export", *argv, "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert export_command(args) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def swarm_json(run_dir, *args: str, scenario: str = "peers/lan-4.toml") -> dict:
    """``spantrain swarm`` on ``scenario`` with an even plan and no measuring; its run summary."""
    return run_swarm_json("--scenario", scenario, "--plan", "even", "--no-measure", "--run-dir", str(run_dir), *args)
