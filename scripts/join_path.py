"""A joiner's way to its first plan against the swarm's size (issue 33), simulated
(``spantrain_p2p.cli.join_path``) with the costs that do not depend on the size taken from a live
joiner, beside the live joiners given.

    .venv/bin/python scripts/join_path.py --calibrate runs/lan4.json:p3 --live runs/lan20.json:p19
    .venv/bin/python scripts/join_path.py --calibrate lan4.json:p3 --peers 100 1000 10000 --json

``--calibrate FILE:PEER``: a ``spantrain swarm --json`` summary (its last line) and the joiner's name
(``--chaos join:PEER@step=K``): its milestones give the start (plus this box's import time, measured
here: the launcher's peers fork from a process that imported everything), the job's setup and the
profile. ``--live FILE:PEER``: joiners to set beside the simulation of their swarm's size, in their
own world (an emulated LAN: ``--live-world lan``). The planner's time and the stage map's size at
each N are measured here on a synthetic swarm of N (the real planner).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spantrain_p2p.cli.join_path import (JoinCosts, JoinWorld, entry_sizes, largest_values,  # noqa: E402
                                         planner_at, simulate_join)

PHASES = ("joined", "job", "profiled", "pinged", "probed", "map")
LAN = JoinWorld(regions=1, link_mbps=1000.0, intra_rtt_ms=(0.5, 0.5), intra_mbps=(1000.0, 1000.0))


def import_s(runs: int = 3) -> float:
    """Seconds ``spantrain-peer`` spends importing before its peer starts (the fastest of ``runs``)."""
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import spantrain_p2p.peer_command.main, spantrain_p2p.train.trainer"],
                       check=True)
        best = min(best, time.perf_counter() - t)
    return best


def joiner(spec: str) -> tuple[int, dict]:
    """(peers in the run, the joiner's milestones) of ``FILE:PEER``."""
    path, _, name = spec.rpartition(":")
    with open(path) as f:
        summary = json.loads([x for x in f.read().splitlines() if x.startswith("{")][-1])
    row = next((p for p in summary["peers"] if p.get("name") == name), None)
    if row is None or not row.get("milestones"):
        raise SystemExit(f"{spec}: no peer {name!r} with milestones in that summary")
    return len(summary["peers"]), row["milestones"]


def live_phases(m: dict, start_extra: float) -> dict:
    """A live joiner's milestones as the simulator's phases (seconds from its launch)."""
    at = {"joined": m["idle"] + start_extra, "job": m["measuring"] + start_extra,
          "profiled": m["profiled"] + start_extra, "pinged": m["pinged"] + start_extra,
          "probed": m["probed"] + start_extra, "map": m["map"] + start_extra}
    if "planned" in m:
        at["planned"] = m["planned"] + start_extra
    return at


def plot(out: dict, path: str) -> None:
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for design, style in (("before", "--"), ("now", "-")):
        rows = [r for r in out["sim"] if r["design"] == design]
        ns = [r["n"] for r in rows]
        for ms, mark in (("map", "o"), ("planned", "s")):
            ys = [r["at"][ms]["p95"] for r in rows]
            ax.semilogx([n for n, y in zip(ns, ys) if math.isfinite(y)], [y for y in ys if math.isfinite(y)],
                        mark + style, label=f"{design}: {ms} (p95)")
    for lv in out["live"]:
        for ms, mark in (("map", "o"), ("planned", "s")):
            if ms in lv["live"]:
                ax.semilogx([lv["n"]], [lv["live"][ms]], mark, color="grey" if lv["before"] else "black", mfc="none")
    stuck = [f"{r['design']}: no {ms} at {r['n']:,}" for r in out["sim"] for ms in ("map", "planned")
             if not math.isfinite(r["at"][ms]["p95"])]
    if stuck:  # a value past what a response carries, or a map past what may be published
        ax.text(0.01, 0.01, "; ".join(stuck), transform=ax.transAxes, fontsize=7, va="bottom")
    ax.axhline(30, color="grey", lw=0.8)
    ax.set_xlabel("peers in the swarm")
    ax.set_ylabel("seconds from a joiner's launch")
    ax.set_title("a joiner's first stage map and first plan (open: live on this box; grey: before)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calibrate", required=True, metavar="FILE:PEER")
    p.add_argument("--live", nargs="*", default=[], metavar="FILE:PEER")
    p.add_argument("--live-before", nargs="*", default=[], metavar="FILE:PEER",
                   help="live joiners of the design before (b5ce1d1), set beside its simulation")
    p.add_argument("--peers", type=int, nargs="+", default=[20, 100, 1000, 10000])
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default="", metavar="PNG", help="the joiner's first map and plan (p95) against N, both designs")
    a = p.parse_args()
    imp = import_s()
    _n, m = joiner(a.calibrate)
    costs = JoinCosts(start_s=imp + m["idle"], job_s=m["measuring"] - m["idle"],
                      profile_s=m["profiled"] - m["measuring"], ready_s=0.0)
    sizes = entry_sizes()
    print(f"calibrated on {a.calibrate}: imports {imp:.2f} s, start {costs.start_s:.2f} s, job {costs.job_s:.2f} s, "
          f"profile {costs.profile_s:.2f} s; entries: job copy {sizes.job_copy} B, profile {sizes.profile} B, "
          f"links {sizes.links} B")
    out = {"costs": costs.__dict__, "sizes": {k: v for k, v in sizes.__dict__.items() if k != "stage_map"},
           "import_s": imp, "live": [], "sim": []}
    for spec, before in [*((x, False) for x in a.live), *((x, True) for x in a.live_before)]:
        n, lm = joiner(spec)
        at = live_phases(lm, imp)
        plan_s, map_bytes = planner_at(n, regions=1)
        sim = simulate_join(n, costs, sizes, LAN, plan_s, map_bytes, samples=a.samples, before=before)
        print(f"\nlive {spec} ({n} peers, an emulated LAN{', the design before' if before else ''}), seconds from "
              f"launch; beside it the simulation of {n} on a LAN (p50):")
        for ph in (*PHASES, "planned"):
            if ph in at:
                print(f"  {ph:>9} live {at[ph]:7.2f}   sim {sim['at'][ph]['p50']:7.2f}")
        out["live"].append({"spec": spec, "n": n, "before": before, "live": at,
                            "sim_p50": {k: v["p50"] for k, v in sim["at"].items()}})
    print(f"\nsimulated joiners ({JoinWorld().regions} regions, a {JoinWorld().link_mbps:g} Mbit/s home link), "
          "seconds from launch, p50 / p95 (before: the design until 2026-11-28, b5ce1d1):")
    print(f"  {'N':>6} {'design':>7} {'plan s':>7} {'map KB':>7} " + " ".join(f"{ph:>13}" for ph in (*PHASES, "planned")))
    for n in a.peers:
        plan_s, map_bytes = planner_at(n)
        for before in (True, False):
            sim = simulate_join(n, costs, sizes, JoinWorld(), plan_s, map_bytes, samples=a.samples, before=before)
            print(f"  {n:>6} {'before' if before else 'now':>7} {plan_s:>7.2f} {map_bytes / 1024:>7.1f} " + " ".join(
                f"{sim['at'][ph]['p50']:>6.1f}/{sim['at'][ph]['p95']:<6.1f}" for ph in (*PHASES, "planned")))
            big = largest_values(n, sizes)
            out["sim"].append({"n": n, "design": "before" if before else "now", "plan_s": plan_s,
                               "map_bytes": map_bytes, "largest_values": big, **sim})
    print("\nthe largest value of each kind now, KB (256 KiB at most):")
    for row in out["sim"]:
        if row["design"] == "now":
            print(f"  {row['n']:>6} " + ", ".join(f"{k} {v / 1024:.0f}" for k, v in
                                                   {**row["largest_values"], "stagemap": row["map_bytes"]}.items()))
    if a.plot:
        plot(out, a.plot)
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
