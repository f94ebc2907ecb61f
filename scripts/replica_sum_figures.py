"""The replicas' gradient sum on its own: two peers, one stage (2 replicas), a model whose gradient is
big beside its compute (GPT-2 small at 8 tokens a micro-batch: ~500 MB of fp32 gradient a replica),
the default robust aggregation. Prints each peer's median seconds per step of the last 4 steps (its
step breakdown: compute, gradient sum, optimizer, step) and the losses, one JSON line last.

    .venv/bin/python scripts/replica_sum_figures.py [--device cpu|cuda] [--steps 8] [--aggregate robust|sum]

To compare two versions of the package, run it twice with PYTHONPATH naming each (the peers it starts
inherit it)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import last_stage_losses, run_peers  # noqa: E402

from spantrain_p2p.data.tokenizer import train_bpe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--aggregate", default="robust", choices=("robust", "sum"))
    ap.add_argument("--model", default="hf:gpt2")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="replica-sum-")
    tok = os.path.join(work, "tokenizer.json")
    train_bpe("stdlib", 512, tok)
    reports = run_peers(os.path.join(work, "run"), [
        "--steps", str(a.steps), "--precision", "fp32", "--plan", "even", "--stages", "1", "--aggregate", a.aggregate,
        "--model", a.model, "--seq-len", "8", "--micro-batch-size", "1", "--micro-batches", "2",
        "--data", "stdlib", "--tokenizer", tok], a.device, 2, 1800)
    out = {"device": a.device, "model": a.model, "aggregate": a.aggregate, "steps": a.steps,
           "peers": [{"name": r["name"], "step_breakdown": r["step_breakdown"]} for r in reports],
           "losses": [round(x, 5) for x in last_stage_losses(reports)]}
    for p in out["peers"]:
        b = p["step_breakdown"]
        print(f"{p['name']}: step {b['step_s']:.3f} s, gradient sum {b['gradient_sum_s']:.3f} s, compute "
              f"{b['compute_s']:.3f} s, optimizer {b['optimizer_s']:.3f} s (median of the last {b['steps']})",
              file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
