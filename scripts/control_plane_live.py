"""What today's control plane costs per peer, live on this machine, as a swarm grows (issue 33).

For each N in ``--peers``: a founder and N - 1 idle ``spantrain-peer`` processes (no job) join one
swarm on loopback; once every peer lists all N, the script measures over ``--window`` seconds:

- per peer, from its ``/status`` ``control`` meter (``swarm.control_meter``): DHT calls made and
  answered per second, and the protobuf bytes it sent and received per second (what its p2p daemon
  carries, less libp2p's framing and encryption); per method and key, the swarm's calls and bytes;
  the largest value any peer saw per key;
- per peer, from ``/proc``: the CPU of the peer process (idle: all of it is the control plane: its
  heartbeats, member reads, record checks, pages) and of its p2p daemon, and the bytes the daemon
  read and wrote (``rchar + wchar``: the control socket to the peer and the network, about twice the
  wire traffic);
- the busiest peer's answered calls against the mean (how unevenly the DHT's load falls);
- join-to-visible: one more peer is started; from its ready file (it has joined and announced) until
  a watcher (the lowest peer id: it reads the member key every poll, as a planner does) and a peer
  that does not watch (it reads the key seldom in a large swarm) list it;
- crash-to-noticed: another peer and its daemon are SIGKILLed; until those two no longer list it;
- how long the founder's ``/status`` takes to answer (``spantrain status`` reads it).

    .venv/bin/python scripts/control_plane_live.py --peers 8 16 --window 30
    .venv/bin/python scripts/control_plane_live.py --peers 8 16 32 --window 30 --json --plot cp.png
    .venv/bin/python scripts/control_plane_live.py --peers 16 32 --liveness swim   # the design for large swarms

Every process it starts is stopped at the end, also on failure or Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spantrain_p2p.launch.processes import PeerProcess, wait_until  # noqa: E402
from spantrain_p2p.sim.control_plane import spread  # noqa: E402
from spantrain_p2p.swarm.control_meter import rates  # noqa: E402
from spantrain_p2p.train.cpu_use import process_cpu_s  # noqa: E402

SWARM = "cp"


def proc_io(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        vals = dict(line.split(":") for line in f.read().splitlines())
    return int(vals["rchar"]) + int(vals["wchar"])


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def daemon_of(pid: int) -> int | None:
    for c in children(pid):
        try:
            with open(f"/proc/{c}/comm") as f:
                if f.read().strip() == "p2pd":
                    return c
        except OSError:
            pass
    return None


def status(p: PeerProcess, timeout: float = 10.0) -> dict:
    return p.status(timeout=timeout)


def members(p: PeerProcess, liveness: str) -> set[str]:
    """The members ``p`` lists: the records in its view; with SWIM, its member list, those it has
    only heard of included (a peer that does not watch reads only the records it needs, and a
    member is confirmed once it has heard from it)."""
    if liveness == "swim":
        listed = p.status(timeout=10.0, path="/swim")["members"]
        return {k for k, v in listed.items() if v["state"] not in ("dead", "left")} | {p.info["peer_id"]}
    return {m["peer_id"] for m in status(p)["members"]}


def sample(peers: list[PeerProcess]) -> dict:
    out = {}
    for p in peers:
        pid = p.proc.pid
        d = daemon_of(pid)
        out[p.name] = {"t": time.monotonic(), "control": status(p)["control"], "cpu": process_cpu_s(pid),
                       "daemon_cpu": process_cpu_s(d) if d else 0.0, "daemon_io": proc_io(d) if d else 0}
    return out


def start(name: str, run_dir: str, join: str | None, liveness: str) -> PeerProcess:
    args = ["--name", name, "--swarm", SWARM, "--no-measure", "--liveness", liveness]
    if join:
        args += ["--join", join]
    return PeerProcess(name, args, run_dir).start()


def one_n(n: int, window: float, run_dir: str, rng: random.Random, converge_timeout: float, settle: float,
          liveness: str) -> dict:
    peers: list[PeerProcess] = []
    try:
        t0 = time.monotonic()
        founder = start("c000", run_dir, None, liveness)
        founder.wait_ready(120)
        peers.append(founder)
        addr = founder.info["address"]
        wave = 8  # a wave at a time: 2 cores start ~8 daemons at once without timeouts
        for i in range(1, n, wave):
            batch = [start(f"c{j:03d}", run_dir, addr, liveness) for j in range(i, min(n, i + wave))]
            for p in batch:
                p.wait_ready(180)
            peers += batch
        started_s = time.monotonic() - t0
        ids = {p.name: p.info["peer_id"] for p in peers}
        try:
            wait_until(lambda: all(len(members(p, liveness)) >= n for p in peers), converge_timeout, 1.0,
                       f"all {n} peers listing each other")
            converged_s = round(time.monotonic() - t0, 1)
        except TimeoutError:  # measured all the same: this is how such a swarm runs
            converged_s = None
        listed = sorted(len(members(p, liveness)) for p in peers)
        time.sleep(settle)  # the joins' own traffic settles (SWIM: their news passed on enough)
        a = sample(peers)
        time.sleep(window)
        b = sample(peers)
        per = {}
        for p in peers:
            x, y = a[p.name], b[p.name]
            dt = y["t"] - x["t"]
            r = rates(x["control"], y["control"])
            per[p.name] = {
                "control_bytes_per_s": r["bytes_sent_per_s"] + r["bytes_received_per_s"],
                "sent_per_s": r["bytes_sent_per_s"], "received_per_s": r["bytes_received_per_s"],
                "calls_out_per_s": r["calls_out_per_s"], "calls_served_per_s": r["calls_served_per_s"],
                "cpu_pct": 100 * (y["cpu"] - x["cpu"]) / dt, "daemon_cpu_pct": 100 * (y["daemon_cpu"] - x["daemon_cpu"]) / dt,
                "total_cpu_pct": 100 * (y["cpu"] + y["daemon_cpu"] - x["cpu"] - x["daemon_cpu"]) / dt,
                "daemon_io_per_s": (y["daemon_io"] - x["daemon_io"]) / dt,
            }
        keys: dict[str, dict] = {}
        for p in peers:
            x, y = a[p.name]["control"], b[p.name]["control"]
            dt = y["since_s"] - x["since_s"]
            for row, v in y["out"].items():
                before = x["out"].get(row, {"calls": 0, "bytes_out": 0, "bytes_back": 0})
                k = keys.setdefault(row, {"calls_per_s": 0.0, "bytes_per_s": 0.0})
                k["calls_per_s"] += (v["calls"] - before["calls"]) / dt
                k["bytes_per_s"] += (v["bytes_out"] + v["bytes_back"] - before["bytes_out"] - before["bytes_back"]) / dt
        largest: dict[str, int] = {}
        for p in peers:
            for k, v in b[p.name]["control"]["largest_value"].items():
                largest[k] = max(largest.get(k, 0), v)

        t = time.monotonic()
        status(founder)
        status_s = time.monotonic() - t

        # join-to-visible: from the joiner's ready file to being listed by a watcher (the lowest peer id:
        # it reads the member key every poll, as a planner does) and by a peer that does not watch
        # (it reads the key every N / 8 polls: ``membership.read_interval``)
        by_id = sorted(peers, key=lambda p: ids[p.name])
        watcher = by_id[0]
        other = rng.choice(by_id[2:]) if n > 2 else by_id[-1]
        joiner = start(f"c{n:03d}", run_dir, addr, liveness)
        wait_until(joiner.poll_ready, 180, 0.05, "the joiner's ready file")
        ready_at = time.monotonic()
        jid = joiner.info["peer_id"]
        seen = {}
        while len(seen) < 2 and time.monotonic() - ready_at < 60:
            for w in (watcher, other):
                if w.name not in seen and jid in members(w, liveness):
                    seen[w.name] = time.monotonic() - ready_at
            time.sleep(0.1)
        peers.append(joiner)

        # crash-to-noticed: SIGKILL a peer and its daemon
        victim = rng.choice([p for p in peers if p not in (watcher, other, joiner)]) if n > 2 else joiner
        vid = ids.get(victim.name) or victim.info["peer_id"]
        killed_at = time.monotonic()
        os.killpg(victim.proc.pid, signal.SIGKILL)
        gone = {}
        while len(gone) < 2 and time.monotonic() - killed_at < 120:
            for w in (watcher, other):
                if w.name not in gone and vid not in members(w, liveness):
                    gone[w.name] = time.monotonic() - killed_at
            time.sleep(0.1)

        vals = list(per.values())

        def stat(field: str) -> dict:
            return spread([v[field] for v in vals])

        served = [v["calls_served_per_s"] for v in vals]

        def role(name: str) -> str:
            return f"{name} ({'watcher' if name == watcher.name else 'member'})"

        return {
            "n": n, "liveness": liveness, "window_s": window, "started_s": round(started_s, 1), "converged_s": converged_s,
            "listed": {"min": listed[0], "median": listed[len(listed) // 2], "max": listed[-1]},
            "control_bytes_per_s": stat("control_bytes_per_s"), "calls_out_per_s": stat("calls_out_per_s"),
            "calls_served_per_s": stat("calls_served_per_s"),
            "busiest_over_mean": max(served) / statistics.fmean(served) if statistics.fmean(served) > 0 else None,
            "daemon_io_per_s": stat("daemon_io_per_s"), "cpu_pct": stat("cpu_pct"), "daemon_cpu_pct": stat("daemon_cpu_pct"),
            "total_cpu_pct": stat("total_cpu_pct"),
            # each peer's row; "watcher": among the two lowest peer ids, which read every poll
            "peers": {k: {**{f: round(x, 2) for f, x in v.items()}, "watcher": k in {p.name for p in by_id[:2]}}
                      for k, v in per.items()},
            "by_key": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in sorted(keys.items(), key=lambda kv: -kv[1]["bytes_per_s"])},
            "largest_value": largest, "status_s": round(status_s, 3),
            "join_to_visible_s": {role(k): round(v, 2) for k, v in seen.items()},
            "crash_to_noticed_s": {role(k): round(v, 2) for k, v in gone.items()},
        }
    finally:
        for p in peers:
            p.kill()


def show(r: dict) -> None:
    kb = 1024

    def f(st, scale=1.0, unit=""):
        return f"mean {st['mean'] / scale:.1f}{unit}, p99 {st['p99'] / scale:.1f}{unit}, max {st['max'] / scale:.1f}{unit}"

    conv = (f"all listing all at {r['converged_s']} s" if r["converged_s"] is not None else
            f"NOT all listing all within the timeout (each lists {r['listed']['min']}-{r['listed']['max']} of {r['n']})")
    print(f"N = {r['n']}: all started in {r['started_s']} s, {conv}")
    print(f"  control traffic per peer (protobuf, up + down): {f(r['control_bytes_per_s'], kb, ' KB/s')}")
    print(f"  p2p daemon I/O per peer (rchar + wchar):        {f(r['daemon_io_per_s'], kb, ' KB/s')}")
    print(f"  DHT calls made per peer: {f(r['calls_out_per_s'], 1, '/s')}; answered: {f(r['calls_served_per_s'], 1, '/s')}; "
          f"busiest node answers {r['busiest_over_mean']:.1f}x the mean")
    print(f"  CPU per peer process: {f(r['cpu_pct'], 1, ' %')}; its daemon: {f(r['daemon_cpu_pct'], 1, ' %')}; "
          f"both: {f(r['total_cpu_pct'], 1, ' %')}")
    print("  by call and key (swarm total): " + "; ".join(
        f"{k} {v['calls_per_s']:.0f}/s {v['bytes_per_s'] / kb:.0f} KB/s" for k, v in list(r["by_key"].items())[:6]))
    print(f"  largest value per key (bytes): {r['largest_value']}")
    print(f"  founder's /status answered in {r['status_s']} s; join to visible {r['join_to_visible_s']} s; "
          f"crash to noticed {r['crash_to_noticed_s']} s")


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in results]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    ax[0].plot(ns, [r["control_bytes_per_s"]["mean"] / 1024 for r in results], "o-", label="mean")
    ax[0].plot(ns, [r["control_bytes_per_s"]["p99"] / 1024 for r in results], "s--", label="p99")
    ax[0].set(xlabel="peers", ylabel="KB/s per peer", title="control traffic (protobuf, up + down)")
    ax[0].legend()
    ax[1].plot(ns, [r["cpu_pct"]["mean"] for r in results], "o-", label="peer process")
    ax[1].plot(ns, [r["daemon_cpu_pct"]["mean"] for r in results], "s--", label="p2p daemon")
    ax[1].set(xlabel="peers", ylabel="% of a core", title="control-plane CPU per peer (idle swarm)")
    ax[1].legend()
    ax[2].plot(ns, [max(r["crash_to_noticed_s"].values(), default=float("nan")) for r in results], "o-", label="crash to noticed")
    ax[2].plot(ns, [max(r["join_to_visible_s"].values(), default=float("nan")) for r in results], "s--", label="join to visible")
    ax[2].set(xlabel="peers", ylabel="s", title="membership times (slowest of two observers)")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, nargs="+", default=[8, 16], help="swarm sizes (default 8 16)")
    p.add_argument("--window", type=float, default=30.0, help="seconds measured per size (default 30)")
    p.add_argument("--converge-timeout", type=float, default=180.0,
                   help="how long to wait for every peer to list all N before measuring anyway (default 180)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=None,
                   help="seconds between all listing all and the window (default: a third of the window, at most "
                        "10; with SWIM a join's news is passed on for a few minutes: 150 measures the steady state)")
    p.add_argument("--liveness", choices=("records", "swim"), default="records",
                   help="the peers' --liveness: records (the design before 2026-11-28, this script's default: its "
                        "figures' baseline) or swim (the peers' default: direct probes)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object, last")
    p.add_argument("--plot", default="", help="write a PNG of the figures against N here")
    args = p.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        for n in args.peers:
            settle = args.settle if args.settle is not None else min(10.0, args.window / 3)
            r = one_n(n, args.window, tempfile.mkdtemp(prefix=f"n{n}-", dir=tmp), rng, args.converge_timeout, settle,
                      args.liveness)
            show(r)
            results.append(r)
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
