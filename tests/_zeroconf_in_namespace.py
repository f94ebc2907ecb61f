"""Run inside a private network namespace (unshare -rn): two --join auto peers find each other via mDNS.

Prints one JSON line with what it saw. Never run this on the host's real interfaces.
"""
import json
import shutil
import subprocess
import sys
import tempfile
import time

from spantrain_p2p.launch import PeerProcess, wait_until


def main() -> int:
    for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "link", "set", "lo", "multicast", "on"],
                ["ip", "route", "add", "224.0.0.0/4", "dev", "lo"]):
        subprocess.run(cmd, check=True)
    run_dir = tempfile.mkdtemp(prefix="spantrain-zc-")
    a = PeerProcess("a", ["--join", "auto", "--swarm", "lan"], run_dir)
    b = PeerProcess("b", ["--join", "auto", "--swarm", "lan"], run_dir)
    done = False
    try:
        a.start().wait_ready(60)  # finds nobody, starts the swarm and advertises it
        t0 = time.monotonic()
        b.start().wait_ready(60)
        wait_until(lambda: a.status()["member_count"] == 2 and b.status()["member_count"] == 2, 30)
        took = time.monotonic() - t0
        print(json.dumps({"a": a.info["peer_id"], "b": b.info["peer_id"], "a_members": a.status()["member_count"],
                          "b_members": b.status()["member_count"], "join_s": round(took, 2),
                          "b_log": b.log_tail(40)}))
        done = True
        return 0
    finally:
        for p in (b, a):
            p.stop(5)
        if done:
            shutil.rmtree(run_dir, ignore_errors=True)  # (the peers' logs; b's tail is in the line printed)
        else:
            print(f"the peers' logs are kept in {run_dir}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
