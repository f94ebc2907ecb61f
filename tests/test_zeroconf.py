"""--join auto over mDNS, in a private network namespace so nothing multicasts on the host's interfaces."""
import json
import shutil
import subprocess
import sys

import pytest


def namespace_available() -> str:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return "unshare or ip not installed"
    r = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"cannot create a network namespace: {r.stderr.strip()}"


@pytest.mark.heavy
def test_join_auto_finds_and_joins_a_swarm_on_the_lan():
    why = namespace_available()
    if why:
        pytest.skip(why)
    r = subprocess.run(["unshare", "-rn", sys.executable, "tests/_zeroconf_in_namespace.py"],
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["a_members"] == 2 and seen["b_members"] == 2
    assert "found 1 address(es)" in seen["b_log"]
    print(f"\n--join auto peer joined in {seen['join_s']}s (mDNS browse included)")
