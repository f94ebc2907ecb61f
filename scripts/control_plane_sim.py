"""The control plane's figures against N, simulated (``spantrain_p2p.sim.control_plane``), beside the
live runs of ``scripts/control_plane_live.py`` where given (issue 33), and the design for large
swarms, ``--liveness swim`` (``sim.control_swim``: direct probes, records stored when they change).

    .venv/bin/python scripts/control_plane_sim.py
    .venv/bin/python scripts/control_plane_sim.py --live live.json swim-live.json --plot sim.png --json

``--live FILE...``: JSON lines ``control_plane_live.py --json`` printed (their results are set beside
the simulated ones of the same N and design, with the ratio sim / live of the mean bytes and calls
per peer: the calibration). A file of ``--liveness swim`` runs goes with design ``swim``; the others
with ``--live-design`` (default ``buckets-lean``, the record design as shipped since 2026-11-27
15:45 UTC; ``watchers-2-1`` from 12:45 UTC that day, ``direct`` before).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spantrain_p2p.sim.control_plane import DESIGNS, plot_traffic, simulate  # noqa: E402
from spantrain_p2p.sim.control_swim import SwimDesign, simulate_swim  # noqa: E402

SWIM = "swim"  # --liveness swim (sim/control_swim.py)

KB = 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32, 100, 1000, 10000])
    p.add_argument("--designs", nargs="+", default=[*DESIGNS, SWIM], choices=[*DESIGNS, SWIM])
    p.add_argument("--live", nargs="+", default=[], help="control_plane_live.py --json outputs to calibrate against")
    p.add_argument("--live-design", default="buckets-lean", choices=list(DESIGNS))
    p.add_argument("--plot", default="")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    live: dict[tuple[str, int], dict] = {}  # (design, N) -> the live run's results
    for path in a.live:
        with open(path) as f:
            line = [x for x in f.read().splitlines() if x.startswith("{")][-1]
        for r in json.loads(line)["results"]:
            live[(SWIM if r.get("liveness") == "swim" else a.live_design, r["n"])] = r
    out = {}
    for name in a.designs:
        print(f"design {name}{' (--liveness swim)' if name == SWIM else ''}:")
        print(f"  {'N':>6} {'KB/s mean':>10} {'p99':>9} {'max':>10} {'calls/s':>8} {'busiest':>8} "
              f"{'value KB':>9} {'crash p95 s':>11} {'join p95 s':>10} {'read s':>7} {'link load':>9}")
        rows = []
        for n in a.peers:
            f = simulate_swim(SwimDesign(), n) if name == SWIM else simulate(DESIGNS[name], n)
            rows.append(f.to_dict())
            print(f"  {n:>6} {f.bytes_per_s['mean'] / KB:>10.1f} {f.bytes_per_s['p99'] / KB:>9.1f} "
                  f"{f.bytes_per_s['max'] / KB:>10.1f} {f.calls_per_s['mean']:>8.1f} {f.busiest_over_mean:>7.1f}x "
                  f"{f.largest_value / KB:>9.1f} {f.crash_to_noticed_s['p95']:>11.2f} {f.join_to_visible_s['p95']:>10.2f} {f.search_s:>7.2f} {f.link_load['max']:>9.3f}")
            if (name, n) in live:
                lv = live[(name, n)]
                rb = f.bytes_per_s["mean"] / lv["control_bytes_per_s"]["mean"]
                rc = f.calls_per_s["mean"] / lv["calls_out_per_s"]["mean"]
                rows[-1]["live"] = {"bytes_per_s_mean": lv["control_bytes_per_s"]["mean"],
                                    "calls_per_s_mean": lv["calls_out_per_s"]["mean"],
                                    "sim_over_live_bytes": rb, "sim_over_live_calls": rc}
                print(f"  {'live':>6} {lv['control_bytes_per_s']['mean'] / KB:>10.1f} {lv['control_bytes_per_s']['p99'] / KB:>9.1f} "
                      f"{lv['control_bytes_per_s']['max'] / KB:>10.1f} {lv['calls_out_per_s']['mean']:>8.1f} "
                      f"{lv['busiest_over_mean']:>7.1f}x {lv['largest_value'].get('members', 0) / KB:>9.1f}   "
                      f"(sim / live: bytes {rb:.2f}, calls {rc:.2f})")
        out[name] = rows
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(15, 4))
        plot_traffic(ax[0], ax[1], out, "idle swarm")
        for name, rows in out.items():
            ns = [r["n"] for r in rows]
            ax[2].semilogx(ns, [r["crash_to_noticed_s"]["p95"] for r in rows], "o-", label=f"{name}, crash (p95)")
            ax[2].semilogx(ns, [r["join_to_visible_s"]["p95"] for r in rows], "s--", label=f"{name}, join (p95)")
            lv = [(r["n"], r["live"]["bytes_per_s_mean"] / KB) for r in rows if "live" in r]
            if lv:
                ax[0].loglog(*zip(*lv), "kx", markersize=9, label=f"{name}, live")
        ax[2].axhline(10, color="grey", lw=0.8)
        ax[2].set(xlabel="peers", ylabel="s", title="membership times")
        for x in ax:
            x.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
