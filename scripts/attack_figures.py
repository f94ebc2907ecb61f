#!/usr/bin/env python3
"""Issue 29's attack figures: each attack of the harness (``--chaos byzantine:PEER:ATTACK``,
``spantrain_p2p/robust/attacks.py``) against (1) one replica among 4 replicas of a stage
(peers/lan-4.toml, --plan even --stages 1: p3 attacks its gradient-sum parts), (2) one island among 4
(peers/four-sites.toml, --sync islands: both peers of site d forge their pseudo-gradients) and (3)
one pipeline replica among 4 of a stage (peers/lan-8.toml, --plan even --stages 2: p5 forges the
activations or gradients it sends its neighbours: the boundary gate and verified computation), with
the defences (--aggregate robust, the default) and without (--aggregate sum), next to the clean
runs. Per run: the final loss (mean of the last 20 steps' losses), its distance from the clean
defended run's, the step the attacker was evicted at (the first step of the map without it),
samples/s.

    .venv/bin/python scripts/attack_figures.py [--steps 300] [--world replicas|islands|both]
        [--attacks a,b,...] [--aggregates robust,sum] [--clean-steps 1000 --precision fp32|bf16] [--json]

``--clean-steps N``: instead, N clean steps of the replicas' (or, with --world pipeline|islands,
that) world with the defences on: the evictions (there must be none), the largest clip ratio
any replica reached, the gate's largest deviation per kind and the verifier's largest relative error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from spantrain_p2p.robust.attacks import ATTACKS, BOUNDARY  # noqa: E402

WORLDS = {
    "replicas": (["--scenario", "peers/lan-4.toml", "--plan", "even", "--stages", "1"], ["p3"]),
    "islands": (["--scenario", "peers/four-sites.toml", "--sync", "islands"], ["d1", "d2"]),
    "pipeline": (["--scenario", "peers/lan-8.toml", "--plan", "even", "--stages", "2"], ["p5"]),
}
GRADIENT_ATTACKS = [a for a in ATTACKS if a not in BOUNDARY]


def run(world: str, steps: int, aggregate: str, attack: str, precision: str = "fp32") -> dict:
    base, attackers = WORLDS[world]
    run_dir = tempfile.mkdtemp(prefix=f"attack-{world}-{attack or 'clean'}-{aggregate}-")
    argv = [sys.executable, "-m", "spantrain_p2p", "swarm", *base, "--steps", str(steps), "--seed", "1",
            "--aggregate", aggregate, "--precision", precision, "--run-dir", run_dir, "--json"]
    for a in attackers if attack else ():
        argv += ["--chaos", f"byzantine:{a}:{attack}"]
    t0 = time.monotonic()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    try:
        s = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"world": world, "attack": attack or "clean", "aggregate": aggregate, "error": out.stderr[-800:]}
    losses = s.get("losses") or []
    evicted_at = None
    for e in s.get("epochs") or []:
        plan = next((p for p in s.get("plans", []) if p.get("epoch") == e["epoch"]), {})
        if plan.get("evicted") and evicted_at is None:
            evicted_at = e["first_step"]
    clip, cos = _max_clip(run_dir, world)
    checks = _checks(run_dir)
    return {"world": world, "attack": attack or "clean", "aggregate": aggregate, "precision": precision,
            "steps": s.get("steps"), "lost_steps": s.get("lost_steps"),
            "final_loss": round(statistics.mean(losses[-20:]), 4) if losses else None,
            "evicted_at_step": evicted_at, "evicted": sorted({n for p in s.get("plans", []) for n in p.get("evicted", [])}),
            "samples_per_s": s.get("samples_per_s"), "max_clip_ratio": clip,
            **({"min_cos": cos} if cos else {}), **checks, "wall_s": round(wall, 1), "run_dir": run_dir}


def _max_clip(run_dir: str, world: str) -> tuple[dict, dict]:
    """The largest clip ratio each contributor reached, from the peers' reports (and, for islands,
    each island's smallest cosine with the robust centre)."""
    out: dict = {}
    cos: dict = {}
    rep_dir = os.path.join(run_dir, "reports")
    for name in sorted(os.listdir(rep_dir)) if os.path.isdir(rep_dir) else ():
        with open(os.path.join(rep_dir, name)) as f:
            r = json.load(f)
        if world == "islands":
            for row in (r.get("islands") or {}).get("rounds", []):
                for isl, x in (row.get("clip") or {}).items():
                    out[f"island{isl}"] = max(out.get(f"island{isl}", 0.0), x)
                for isl, x in (row.get("cos") or {}).items():
                    cos[f"island{isl}"] = min(cos.get(f"island{isl}", 1.0), x)
        else:
            for peer, x in ((r.get("defence") or {}).get("max_ratio") or {}).items():
                out[peer] = max(out.get(peer, 0.0), x)
    return out, cos


def _checks(run_dir: str) -> dict:
    """The gate's largest deviation per kind and what it refused or named, and the verifier's checks
    and largest relative error (of passed checks), over the peers' reports."""
    dev: dict = {}
    out = {"refused": 0, "named": 0, "checks": 0, "failed_checks": 0, "max_relative_error": 0.0}
    rep_dir = os.path.join(run_dir, "reports")
    for name in sorted(os.listdir(rep_dir)) if os.path.isdir(rep_dir) else ():
        with open(os.path.join(rep_dir, name)) as f:
            d = json.load(f).get("defence") or {}
        g, v = d.get("gate") or {}, d.get("verify") or {}
        for kind, x in (g.get("max_deviation") or {}).items():
            dev[kind] = max(dev.get(kind, 0.0), x)
        out["refused"] += sum((g.get("refused") or {}).values())
        out["named"] += sum((g.get("suspected") or {}).values())
        out["checks"] += v.get("checks", 0)
        out["failed_checks"] += sum((v.get("failed") or {}).values())
        out["max_relative_error"] = max(out["max_relative_error"], v.get("max_relative_error", 0.0))
    return {"gate_max_deviation": dev, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", choices=("replicas", "islands", "pipeline", "all"), default="all")
    ap.add_argument("--attacks", default="", help="default: the gradient attacks (replicas, islands), the "
                    "pipeline ones (pipeline)")
    ap.add_argument("--aggregates", default="robust,sum", help="robust (defended), sum (undefended) or both")
    ap.add_argument("--clean-steps", type=int, default=0)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []

    def say(r: dict) -> None:
        rows.append(r)
        print(json.dumps(r), flush=True)

    if args.clean_steps:
        say(run("replicas" if args.world == "all" else args.world, args.clean_steps, "robust", "", args.precision))
        return 0
    worlds = ["replicas", "islands", "pipeline"] if args.world == "all" else [args.world]
    for world in worlds:
        aggregates = args.aggregates.split(",")
        clean = run(world, args.steps, "robust", "")
        say(clean)
        if "sum" in aggregates:
            say(run(world, args.steps, "sum", ""))
        attacks = args.attacks.split(",") if args.attacks else list(BOUNDARY if world == "pipeline" else GRADIENT_ATTACKS)
        for attack in [a for a in attacks if a]:
            for aggregate in aggregates:
                r = run(world, args.steps, aggregate, attack)
                if r.get("final_loss") is not None and clean.get("final_loss"):
                    r["vs_clean"] = round(r["final_loss"] / clean["final_loss"] - 1, 4)
                say(r)
    print(f"{time.strftime('%H:%M', time.gmtime())} UTC", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
