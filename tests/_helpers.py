"""Helpers several test modules share."""
import json
import subprocess
import sys


def swarm_json(run_dir, *args, scenario: str = "peers/lan-4.toml", timeout: float = 240) -> dict:
    """``spantrain swarm`` on ``scenario`` with an even plan and no measuring; its run summary."""
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "swarm", "--scenario", scenario,
                        "--plan", "even", "--no-measure", "--json", "--run-dir", str(run_dir), *args],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
