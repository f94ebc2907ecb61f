"""How fast a swarm of `spantrain-peer` processes forms and notices departures, as a user starts it.

One founder, then N-1 joiners started at once with `--join` on the founder's address (real processes,
no zygote: what a user's terminals run). Measured, per run:
- join: from starting the joiners until every peer lists N members;
- crash: from a SIGKILL of 2 joiners until the others all list N-2;
- leave: from a Ctrl-C (SIGINT) of one more until the others all list N-3.
Prints one line per run and, last, a JSON summary with the medians.

    .venv/bin/python scripts/formation_figures.py [--peers 8] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

os.environ["SPANTRAIN_ZYGOTE"] = "0"  # real processes, as a user starts them
from spantrain_p2p.launch import PeerProcess  # noqa: E402


def counts(procs) -> list[int]:
    out = []
    for p in procs:
        try:
            out.append(p.status(timeout=5)["member_count"])
        except OSError:
            out.append(-1)
    return out


def wait_for(procs, n: int, limit: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if all(c == n for c in counts(procs)):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError(f"not all {len(procs)} peers listed {n} members within {limit:.0f}s: {counts(procs)}")


def one_run(n: int, run: int, run_dir: str) -> dict:
    swarm = f"form-{os.getpid()}-{run}"
    hb = ("--heartbeat", "2")
    procs = []
    try:
        t0 = time.monotonic()
        founder = PeerProcess("p0", ["--swarm", swarm, *hb], run_dir).start()
        procs.append(founder)
        founder.wait_ready(60)
        founder_s = time.monotonic() - t0
        t1 = time.monotonic()
        rest = [PeerProcess(f"p{i}", ["--swarm", swarm, "--join", founder.info["address"], *hb], run_dir).start()
                for i in range(1, n)]
        procs += rest
        for p in rest:
            p.wait_ready(90)
        ready_s = time.monotonic() - t1
        while not all(c == n for c in counts(procs)):
            if time.monotonic() - t1 > 120:
                raise TimeoutError(f"{n} peers did not all list {n} in 120 s: {counts(procs)}")
            time.sleep(0.1)
        join_s = time.monotonic() - t1
        for p in rest[:2]:
            p.proc.send_signal(signal.SIGKILL)
        survivors = [founder, *rest[2:]]
        crash_s = wait_for(survivors, n - 2, 60)
        leaver = survivors.pop()
        leaver.proc.send_signal(signal.SIGINT)
        leave_s = wait_for(survivors, n - 3, 30)
        out = {"founder_ready_s": round(founder_s, 2), "joiners_ready_s": round(ready_s, 2),
               "join_s": round(join_s, 2), "crash_s": round(crash_s, 2), "leave_s": round(leave_s, 2)}
        print(f"run {run}: founder ready {founder_s:.1f}s; {n - 1} joiners ready {ready_s:.1f}s, all list {n} "
              f"{join_s:.1f}s after they started; SIGKILL of 2 noticed by all in {crash_s:.1f}s; "
              f"Ctrl-C of 1 in {leave_s:.1f}s", flush=True)
        return out
    finally:
        for p in procs:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="spantrain-formation-") as d:
        for r in range(args.runs):
            runs.append(one_run(args.peers, r, d))
    med = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps({"peers": args.peers, "runs": runs, "median": med}))


if __name__ == "__main__":
    sys.exit(main())
