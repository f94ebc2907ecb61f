"""Where the peers' event loops spend their CPU while training, by role and by coroutine (issue 31).

Runs one swarm with ``SPANTRAIN_LOOP_CPU`` set (``train/loop_cpu.py``: each task's turns and the data
plane's callbacks timed on the loop thread's own CPU clock, from each peer's first training step to
its last), then prints per peer the loop thread's CPU in ms a second of training, the same over all
peers by role (data plane, schedule, gradient sum, recovery, status pages, control plane, streams,
the loop's own), and the coroutines that took most. Either the side-by-side's job
(``pipelining_side_by_side.py``: four peers, 1F1B or ZB-H1) or a scenario's bench job:

    .venv/bin/python scripts/loop_cpu.py --side-by-side 1f1b
    .venv/bin/python scripts/loop_cpu.py --scenario peers/cee-3region.toml --steps 150

The timing costs about 1.5 us a turn: the swarm runs a little slower than without it. Run it on an
idle machine.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spantrain_p2p.train import loop_cpu  # noqa: E402


def side_by_side_cmd(schedule: str, steps: int, tmp: str, encrypted: bool = False, lanes: bool = True) -> list[str]:
    import pipelining_side_by_side as sbs

    scenario = os.path.join(tmp, "unpadded-4.toml")
    with open(scenario, "w") as f:
        f.write(sbs.SCENARIO_APART if encrypted else sbs.SCENARIO)
    return sbs.ours_argv(schedule, steps, scenario, lanes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--side-by-side", choices=("1f1b", "zb-h1"), help="the side-by-side's job, this schedule")
    g.add_argument("--scenario", help="a scenario's bench job (spantrain bench --runs planner)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--top", type=int, default=15, help="coroutines listed")
    p.add_argument("--encrypted", action="store_true",
                   help="with --side-by-side: its peers as machines of their own (encrypted connections)")
    p.add_argument("--no-lanes", action="store_true",
                   help="with --side-by-side: its peers without --lanes (every tensor through their loops)")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="loop-cpu-")
    out = os.path.join(tmp, "loop_cpu")
    if a.side_by_side:
        argv = [*side_by_side_cmd(a.side_by_side, a.steps, tmp, a.encrypted, not a.no_lanes), "--run-dir", os.path.join(tmp, "run")]
    else:
        argv = ["bench", "--scenario", a.scenario, "--steps", str(a.steps), "--runs", "planner",
                "--run-dir", os.path.join(tmp, "run")]
    env = {**os.environ, loop_cpu.ENV: out}
    done = subprocess.run([sys.executable, "-m", "spantrain_p2p", *argv, "--json"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    files = sorted(glob.glob(os.path.join(out, "*.loop_cpu.json")))
    if not files:
        print(f"no peer wrote its figures to {out}", file=sys.stderr)
        return 1
    roles: collections.Counter = collections.Counter()
    coros: collections.Counter = collections.Counter()
    for path in files:
        with open(path) as f:
            fig = json.load(f)
        wall = fig["wall_s"]
        name = os.path.basename(path)[: -len(".loop_cpu.json")]
        print(f"{name:>10}: loop thread {1e3 * fig['loop_cpu_s'] / wall:6.1f} ms of CPU a second, over {wall:.1f} s of training")
        for r, s in loop_cpu.by_role(fig).items():
            roles[r] += 1e3 * s / wall
        for c, (s, _turns) in fig["coroutines"].items():
            coros[c] += 1e3 * s / wall
    total = sum(roles.values())
    print(f"all {len(files)} peers: {total:.1f} ms of loop CPU a second")
    for r, v in roles.most_common():
        print(f"  {v:7.1f} ms/s {100 * v / total:5.1f} %  {r}")
    print("coroutines and callbacks:")
    for c, v in coros.most_common(a.top):
        print(f"  {v:7.1f} ms/s {100 * v / total:5.1f} %  {c}  ({loop_cpu.role(c)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
