"""Helpers several test modules share."""
import json
import signal


def run_swarm_json(*argv: str) -> dict:
    """``spantrain swarm ARGV --json`` run in this process; its run summary, as JSON gives it.

    In-process, the launcher forks the peers from this process's zygote, which the suite keeps
    warm: ~3.5 s less per launch than a fresh ``spantrain`` process (its zygote imports torch).
    The launcher's progress and errors go to stderr (pytest shows them on a failure)."""
    from spantrain_p2p.cli.main import main_parser
    from spantrain_p2p.launch.swarm import run_swarm

    args = main_parser().parse_args(["swarm", *argv, "--json"])
    before = signal.getsignal(signal.SIGTERM)  # the launcher installs its own
    try:
        code, summary = run_swarm(args)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 0 and summary is not None, f"spantrain swarm exited {code} (its output: stderr above)"
    return json.loads(json.dumps(summary))


def swarm_json(run_dir, *args: str, scenario: str = "peers/lan-4.toml") -> dict:
    """``spantrain swarm`` on ``scenario`` with an even plan and no measuring; its run summary."""
    return run_swarm_json("--scenario", scenario, "--plan", "even", "--no-measure", "--run-dir", str(run_dir), *args)
