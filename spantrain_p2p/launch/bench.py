"""``spantrain bench``: the planner's plan (step-synchronous: ``--sync global``), islands (``--sync
islands``: each region trains its own plan and they meet once a round) and the baselines
(best-region: the planner inside the best single region; gpipe- and 1f1b-uniform) on the same
scenario, back to back, with the ratios of their samples/s."""
from __future__ import annotations

import copy
import json
import sys
from typing import Optional

from .swarm import run_swarm


RUNS = ("planner", "islands", "best-region", "gpipe-uniform", "1f1b-uniform")


def workload_facts(args) -> Optional[dict]:
    """The bench's workload: its name, parameters, layers and tokens per sample (None: the job's model)."""
    if not getattr(args, "workload", None):
        return None
    from ..models.workload import facts, profile_of

    return {**facts(args.workload, args.workload_seq_len),
            "flops_per_sample": profile_of(args.workload, args.workload_seq_len).total_flops_per_sample()}


def bench_command(args) -> int:
    """The planner's plan and the baselines on the same scenario, one after the other."""
    runs, code = {}, 0
    kinds = [k.strip() for k in (getattr(args, "runs", None) or ",".join(RUNS)).split(",") if k.strip()]
    unknown = [k for k in kinds if k not in RUNS]
    if unknown or not kinds:
        print(f"spantrain bench: error: --runs takes some of {', '.join(RUNS)}, not {unknown or kinds}",
              file=sys.stderr, flush=True)
        return 2
    for kind in kinds:
        a = copy.copy(args)
        a.plan, a.json, a.measure_only, a.chaos, a.duration = kind, True, False, [], None
        a.sync = "global"
        if kind == "islands":  # the planner's islands (the round length it picks, or the job's islands:H)
            a.plan, a.sync = "planner", args.sync if args.sync.startswith("islands") else "islands"
        if kind.endswith("-uniform"):  # best-region: the planner's own choice of schedule, inside one region
            # what people run instead: a uniform split, one schedule, tensors as they are (the
            # baseline is priced uncompressed: with the job's adaptive codecs its prediction would be off)
            a.schedule = "gpipe" if kind == "gpipe-uniform" else "1f1b"
            a.compression = "none"
        print(f"bench: {kind}", file=sys.stderr, flush=True)
        rc, summary = run_swarm(a)
        if rc == 130:  # Ctrl-C (or SIGTERM) stopped that swarm: the operator wants the bench stopped
            print(f"bench: stopped during {kind}", file=sys.stderr, flush=True)
            return rc
        if rc != 0 or summary is None:
            code = rc or 1
            runs[kind] = {"error": f"exit code {rc}"}
            continue
        keep = ("samples_per_s", "tokens_per_s", "step_s", "predicted_step_s", "predicted_samples_per_s",
                "configured_predicted_samples_per_s", "simulated_samples_per_s", "measured_over_predicted",
                "measured_over_configured_predicted", "measured_over_simulated", "bound_samples_per_s", "bottleneck",
                "aggregate_bound_samples_per_s", "aggregate_utilization", "mfu", "compute_utilization",
                "wire_bytes_per_step", "wire_bytes_per_step_by_link_class", "fidelity", "plan", "codecs", "islands")
        runs[kind] = {k: summary.get(k) for k in keep}
    ratios = {}
    for mine in ("planner", "islands"):
        base = runs.get(mine, {}).get("samples_per_s")
        ratios.update({f"{mine}/{k}": round(base / v["samples_per_s"], 3) for k, v in runs.items()
                       if k not in ("planner", "islands") and base and v.get("samples_per_s")})
    if runs.get("planner", {}).get("samples_per_s") and runs.get("islands", {}).get("samples_per_s"):
        ratios["islands/planner"] = round(runs["islands"]["samples_per_s"] / runs["planner"]["samples_per_s"], 3)
    out = {"scenario": args.scenario, "steps": args.steps, "workload": workload_facts(args), "runs": runs,
           "ratios": ratios}
    if not args.json:
        for k, v in runs.items():
            print(f"{k:>14}: {v.get('samples_per_s')} samples/s (bound {v.get('bound_samples_per_s')})")
        print(f"ratios: {ratios}")
    print(json.dumps(out), flush=True)
    return code
