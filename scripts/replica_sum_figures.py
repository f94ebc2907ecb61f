"""The replicas' gradient sum on its own: two peers, one stage (2 replicas), a model whose gradient is
big beside its compute (GPT-2 small at 8 tokens a micro-batch: ~500 MB of fp32 gradient a replica),
the default robust aggregation. Prints each peer's median seconds per step of the last 4 steps (its
step breakdown: compute, gradient sum, optimizer, step) and the losses, one JSON line last.

    .venv/bin/python scripts/replica_sum_figures.py [--device cpu|cuda] [--steps 8] [--aggregate robust|sum]
    .venv/bin/python scripts/replica_sum_figures.py --in-process [--mb 240]

``--in-process``: no peers, only ``GradientSum.finish`` of one replica whose other part is already in
(one thread, ``--mb`` MB of fp32 gradient in 1M-value layers, the robust aggregation's weights): the
seconds of each of 3 rounds, the sum's own cost without a network or another replica's pace.

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
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--mb", type=int, default=240)
    a = ap.parse_args()
    if a.in_process:
        return in_process(a.mb)
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


def in_process(mb: int) -> int:
    import asyncio
    import time
    from types import SimpleNamespace

    import torch

    from spantrain_p2p.train.gradsum import GradientSum, layer_buckets

    torch.set_num_threads(1)
    n, layers = 1_000_000, max(1, mb * 1_000_000 // 4_000_000)
    params = [torch.nn.Parameter(torch.zeros(n)) for _ in range(layers)]
    buckets = layer_buckets([[n]] * layers)
    other = [torch.randn(n) for _ in buckets]

    class Transport:  # the other replica's parts, already received
        smap = SimpleNamespace(epoch=1)

        async def send_to(self, *args, **kwargs):
            pass

        async def receive(self, key, kind, src):
            return other[key[2]]

    async def rounds() -> list[float]:
        out = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(n)
            g = GradientSum(Transport(), "a", 1, params, buckets, ["b"], weights={"a": 1.0, "b": 1.0})
            for i in range(layers):
                g.layer_done(i)
            t0 = time.perf_counter()
            await g.finish(None)
            out.append(round(time.perf_counter() - t0, 3))
        return out

    secs = asyncio.run(rounds())
    print(f"GradientSum.finish, 2 replicas, {layers * 4} MB a replica, robust weights: {secs} s", file=sys.stderr)
    print(json.dumps({"in_process": True, "mb": layers * 4, "finish_s": secs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
