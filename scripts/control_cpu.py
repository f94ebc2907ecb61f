"""Each peer's CPU while a swarm trains, by part: the control plane (membership, records, DHT, the
planner and its elections, the map), the data plane, the status pages, training, and its p2p
daemon (the DHT's transport: control plane too) (issue 33: "control-plane CPU <= 5 % of one core
per peer at the largest live N").

    .venv/bin/python scripts/control_cpu.py --scenario peers/lan-20.toml --steps 600 --after-step 60 --seconds 60

Starts ``spantrain swarm --scenario ... --steps ... --json``, waits until it has trained
``--after-step`` steps, then for ``--seconds`` samples every peer with py-spy (installed here on
first use: ``pip install py-spy``) and reads its process's and its children's CPU seconds from
/proc. A part's CPU is its share of the samples times the process's CPU seconds: on a loaded box a
thread waiting for a core reads as running to a sampler, so the samples give the split and /proc
the amount. The daemon's CPU is its own (/proc). Prints one row per peer and the mean, and writes
them as JSON (``--out``). Linux only; the swarm runs to its end (its summary beside the rows).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from spantrain_p2p.launch.cpu_samples import shares  # noqa: E402
from spantrain_p2p.train.cpu_use import children_cpu_s, process_cpu_s  # noqa: E402

PY = os.path.join(ROOT, ".venv", "bin", "python")
SPY = os.path.join(ROOT, ".venv", "bin", "py-spy")


def status(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as r:
        return json.load(r)


def peers_by_pid() -> dict[int, dict]:
    """The peer processes on this machine that answer ``/status`` on a port they listen on (``ss``
    names each listening socket's process): pid -> their status."""
    listed = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ports: dict[int, list[int]] = {}
    for line in listed.splitlines():
        m = re.search(r"127\.0\.0\.1:(\d+)\s.*pid=(\d+)", line)
        if m:
            ports.setdefault(int(m.group(2)), []).append(int(m.group(1)))
    out = {}
    for pid, ps in ports.items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "zygote" not in cmd and "spantrain-peer" not in cmd:
            continue
        for port in sorted(ps):
            try:
                out[pid] = status(f"http://127.0.0.1:{port}", 2.0)
                break
            except (OSError, ValueError):
                continue
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default="peers/lan-20.toml")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--after-step", type=int, default=60, help="sample once the swarm trained this many steps")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rate", type=int, default=25, help="samples a second, each peer")
    p.add_argument("--out", default=None, help="write the rows and the swarm's summary here (JSON)")
    a = p.parse_args()
    if not os.path.exists(SPY):
        subprocess.run([PY, "-m", "pip", "install", "-q", "py-spy"], check=True)
    work = os.path.join("/tmp", f"control-cpu-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    err = open(os.path.join(work, "swarm.err"), "w")
    out = open(os.path.join(work, "swarm.json"), "w")
    swarm = subprocess.Popen([os.path.join(ROOT, ".venv", "bin", "spantrain"), "swarm", "--scenario", a.scenario,
                              "--steps", str(a.steps), "--json"], stdout=out, stderr=err, cwd=ROOT)
    try:
        url, deadline = None, time.monotonic() + 600
        while url is None:
            if swarm.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the swarm ended or never served (see {work}/swarm.err)")
            m = re.search(r"dashboard[^\n]*?(http://\S+)", open(err.name).read())
            url = m.group(1) if m else None
            time.sleep(1.0)
        while True:
            if swarm.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the swarm ended before step {a.after_step} (see {work}/swarm.err)")
            steps = re.findall(r"step\s+(\d+)/", open(err.name).read())  # the swarm's progress line
            if steps and int(steps[-1]) >= a.after_step:
                break
            time.sleep(1.0)
        peers = peers_by_pid()
        planner = next((s["train"].get("planner") for s in peers.values() if s["train"].get("planner")), None)
        print(f"{len(peers)} peers at step {a.after_step}; sampling {a.seconds:.0f} s at {a.rate}/s each", file=sys.stderr)
        before = {pid: (process_cpu_s(pid), children_cpu_s(pid)) for pid in peers}
        t0 = time.monotonic()
        spies = {pid: subprocess.Popen([SPY, "record", "--pid", str(pid), "--rate", str(a.rate), "--duration",
                                        str(int(a.seconds)), "--format", "raw", "--full-filenames", "--threads",
                                        "--nonblocking", "-o", os.path.join(work, f"{pid}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for pid in peers}
        for s in spies.values():
            s.wait()
        wall = time.monotonic() - t0
        rows = []
        for pid, st in sorted(peers.items(), key=lambda kv: kv[1]["name"]):
            try:
                cpu, kids = process_cpu_s(pid) - before[pid][0], children_cpu_s(pid)
                with open(os.path.join(work, f"{pid}.txt")) as f:
                    sampled = shares(f, a.rate, a.seconds)
            except (OSError, ValueError):
                continue  # it left meanwhile
            daemon = (kids - before[pid][1]) / wall if kids is not None and before[pid][1] is not None else None
            split = {k: v / sampled["all"] * cpu / wall if sampled["all"] else 0.0 for k, v in sampled["share_of_a_core"].items()}
            rows.append({"peer": st["name"], "planner": st["name"] == planner, "process": cpu / wall, "daemon": daemon,
                         "parts": split, "samples": sampled["samples"],
                         "control_with_daemon": split.get("control", 0.0) + (daemon or 0.0)})
        cols = ["control", "data plane", "pages", "training", "loop"]
        print(f"{'peer':>8} {'process':>8} " + " ".join(f"{c:>10}" for c in cols) + f" {'daemon':>7} {'control+daemon':>15} samples")
        for r in rows:
            print(f"{r['peer'] + ('*' if r['planner'] else ''):>8} {100 * r['process']:7.1f}% "
                  + " ".join(f"{100 * r['parts'].get(c, 0.0):9.1f}%" for c in cols)
                  + f" {100 * (r['daemon'] or 0):6.1f}% {100 * r['control_with_daemon']:14.1f}% {r['samples']:7d}")
        both = [r["control_with_daemon"] for r in rows]
        print(f"control plane with its daemon, % of one core a peer: mean {100 * statistics.fmean(both):.1f}, "
              f"max {100 * max(both):.1f} ({len(rows)} peers, * the planner; sampled {wall:.0f} s)")
        swarm.wait(timeout=3600)
        out.close()
        summary = [x for x in open(out.name).read().splitlines() if x.startswith("{")]
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"rows": rows, "seconds": wall, "after_step": a.after_step, "scenario": a.scenario,
                           "swarm": json.loads(summary[-1]) if summary else None}, f)
        return 0
    finally:
        if swarm.poll() is None:
            swarm.terminate()
            swarm.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
