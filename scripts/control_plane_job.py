"""A training swarm's control plane against N, simulated (``spantrain_p2p.sim.control_job``): the design
before (``63efce7``) and the code now, with the links re-published as often as the code lets them (the
worst case) and never (a quiet network), beside live runs of ``spantrain swarm --json`` (issue 33).

    .venv/bin/python scripts/control_plane_job.py
    .venv/bin/python scripts/control_plane_job.py --peers 20 100 1000 --live before.json now.json --plot job.png --json

``--live FILE...``: outputs of ``spantrain swarm --scenario ... --json`` (their peers' ``control_training``):
each is set beside the simulation of its N, its links re-publishing rate and its epochs (both
designs), with the ratio sim / live of the mean bytes and calls a peer a second.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spantrain_p2p.cli.control_job import calibrate, figures  # noqa: E402
from spantrain_p2p.sim.control_plane import plot_traffic  # noqa: E402

KB = 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, nargs="+", default=[20, 100, 1000, 10000])
    p.add_argument("--live", nargs="+", default=[])
    p.add_argument("--plot", default="")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    out = {**figures(a.peers, weather=True), **figures(a.peers, weather=False)}
    print(f"{'design':>20} {'N':>6} {'KB/s mean':>10} {'p99':>8} {'max':>8} {'busiest':>8} {'planner':>8} "
          f"{'epoch KB':>9} {'planner ep':>10} {'max ep':>8} {'map KB':>7}")
    for name, rows in out.items():
        for r in rows:
            print(f"{name:>20} {r['n']:>6} {r['bytes_per_s']['mean'] / KB:>10.2f} {r['bytes_per_s']['p99'] / KB:>8.2f} "
                  f"{r['bytes_per_s']['max'] / KB:>8.1f} {r['busiest_over_mean']:>7.1f}x {r['planner_bytes_per_s'] / KB:>8.1f} "
                  f"{r['epoch_peer_bytes'] / KB:>9.0f} {r['epoch_planner_bytes'] / KB:>10.0f} {r['epoch_max_bytes'] / KB:>8.0f} "
                  f"{r['map_bytes'] / KB:>7.1f}")
    for name, rows in out.items():
        for r in rows:
            b = r["busiest"]
            role = "the planner" if b["rank"] == 0 else f"rank {b['rank']} by id" + (
                " (takes every links entry: the standby or a voter)" if b["reader"] else "")
            print(f"{name:>20} {r['n']:>6} busiest: {role}, {b['bytes_per_s'] / KB:.1f} KB/s answered: " + ", ".join(
                f"{k} {v / KB:.1f}" for k, v in sorted(b["parts"].items(), key=lambda kv: -kv[1]) if v >= 0.05 * KB))
    print("(KB/s: a peer's control traffic, up + down, training, no epoch; busiest: the node answering the most "
          "bytes against the mean; epoch KB: one new map's burst, a peer's and the planner's)")
    live = []
    for path in a.live:
        c = calibrate(path)
        live.append({"file": path, **c})
        lv = c["live"]
        print(f"live {path}: N {c['n']}, {c['epochs']} epochs in {c['window_s']:.0f} s, links re-published "
              f"{c['links_published_per_s']:.3f}/s a peer: {lv['bytes_per_s'] / KB:.1f} KB/s, {lv['calls_per_s']:.2f} calls/s")
        for name in ("before", "now"):
            s = c[name]
            print(f"  sim {name:>6}: {s['bytes_per_s'] / KB:.1f} KB/s, {s['calls_per_s']:.2f} calls/s "
                  f"(sim / live: bytes {s['bytes_per_s'] / lv['bytes_per_s']:.2f}, calls {s['calls_per_s'] / lv['calls_per_s']:.2f})")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(15, 4))
        plot_traffic(ax[0], ax[1], out, "training")
        ax[0].axhline(16, color="grey", lw=0.8, ls=":")
        for name, rows in out.items():
            ax[2].loglog([r["n"] for r in rows], [r["epoch_peer_bytes"] / KB for r in rows], "o-", label=f"{name}, a peer")
        ax[2].set(xlabel="peers", ylabel="KB", title="one new stage map's burst")
        for x in ax:
            x.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
    if a.json:
        print(json.dumps({"sim": out, "live": live}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
