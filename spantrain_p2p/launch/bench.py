"""``spantrain bench``: the planner's plan and the baselines (best-region: the planner inside the best
single region; gpipe- and 1f1b-uniform) on the same scenario, back to back, with the ratios of their
samples/s."""
from __future__ import annotations

import copy
import json
import sys

from .swarm import run_swarm


def bench_command(args) -> int:
    """The planner's plan and the baselines on the same scenario, one after the other."""
    runs, code = {}, 0
    for kind in ("planner", "best-region", "gpipe-uniform", "1f1b-uniform"):
        a = copy.copy(args)
        a.plan, a.json, a.measure_only, a.chaos, a.duration = kind, True, False, [], None
        if kind.endswith("-uniform"):  # best-region: the planner's own choice of schedule, inside one region
            a.schedule = "gpipe" if kind == "gpipe-uniform" else "1f1b"
        print(f"bench: {kind}", file=sys.stderr, flush=True)
        rc, summary = run_swarm(a)
        if rc != 0 or summary is None:
            code = rc or 1
            runs[kind] = {"error": f"exit code {rc}"}
            continue
        keep = ("samples_per_s", "tokens_per_s", "step_s", "predicted_step_s", "bound_samples_per_s", "bottleneck",
                "aggregate_bound_samples_per_s", "aggregate_utilization", "mfu", "compute_utilization", "wire_bytes_per_step", "fidelity", "plan")
        runs[kind] = {k: summary.get(k) for k in keep}
    base = runs.get("planner", {}).get("samples_per_s")
    ratios = {f"planner/{k}": round(base / v["samples_per_s"], 3) for k, v in runs.items()
              if k != "planner" and base and v.get("samples_per_s")}
    out = {"scenario": args.scenario, "steps": args.steps, "runs": runs, "ratios": ratios}
    if not args.json:
        for k, v in runs.items():
            print(f"{k:>14}: {v.get('samples_per_s')} samples/s (bound {v.get('bound_samples_per_s')})")
        print(f"ratios: {ratios}")
    print(json.dumps(out), flush=True)
    return code
