#!/usr/bin/env python3
"""Islands' training quality in one process: the same arithmetic as a live run with --sync islands
(each island's own replica and inner Adam, its own data steps of ``plan.islands.data_steps``, the
delayed merge of ``islands.outer``: pseudo-gradients compressed with error feedback, token-weighted,
outer Nesterov), next to one-process synchronous training (``job.reference``, which the global
plan matches step for step) on the same data, seed and data order. No network: it shows what the
outer optimizer does to the loss for a choice of steps per round, codec and outer settings, in
seconds instead of a swarm's minutes. Prints one JSON object.

    .venv/bin/python scripts/islands_quality.py --steps 200 --rounds-steps 10,5 --codec int8
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from spantrain_p2p.plan.islands import data_steps  # noqa: E402
from spantrain_p2p.job.dataset import open_data, with_data  # noqa: E402
from spantrain_p2p.job.spec import JobSpec, ModelHandle  # noqa: E402
from spantrain_p2p.job.optim import make_optimizer  # noqa: E402
from spantrain_p2p.islands.outer import Contribution, OuterLayers  # noqa: E402
from spantrain_p2p.job.reference import reference_run  # noqa: E402


def _step(layers, opt, batch, data_step: int, m: int, splits: int = 1) -> float:
    """One data step's ``m`` micro-batches, as ``splits`` optimizer steps of ``m / splits`` each."""
    total = 0.0
    per = m // splits
    for part in range(splits):
        for mb in range(part * per, (part + 1) * per):
            x, y = batch(data_step, mb)
            for layer in layers[:-1]:
                x = layer(x)
            loss = layers[-1](x, y)
            (loss / per).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return total / m


def held_out_loss(layers, batch, first: int, n: int, m: int) -> float:
    """The mean loss of a model on data steps ``first .. first + n - 1`` (steps no run trained on)."""
    total = 0.0
    with torch.no_grad():
        for ds in range(first, first + n):
            for mb in range(m):
                x, y = batch(ds, mb)
                for layer in layers[:-1]:
                    x = layer(x)
                total += float(layers[-1](x, y))
    return total / (n * m)


def islands_run(job: JobSpec, steps_per_round: list[int], codec: str, held_out: int = 10, splits: int = 1):
    """Loss per data step of islands that each take ``steps_per_round[i]`` steps a round, their
    figures, and the final model's loss on ``held_out`` data steps after the job's."""
    batch = open_data(job).batch
    handle = ModelHandle(job)
    n = len(steps_per_round)
    reps = []
    for _ in range(n):
        layers = handle.build(0, handle.num_layers)  # the job's seed: every island starts alike
        params = [p for layer in layers for p in layer.parameters()]
        outer = OuterLayers({i: [p for p in layer.parameters() if p.requires_grad] for i, layer in enumerate(layers)},
                            codec, job.outer_lr, job.outer_momentum)
        reps.append((layers, make_optimizer(job, params), outer))
    plans = [list(data_steps(steps_per_round, i, job.steps)) for i in range(n)]
    losses: dict[int, float] = {}
    pending = None
    sent = 0
    tokens_per_step = job.samples_per_step * job.seq_len
    for k in range(len(plans[0])):
        mine = []
        for i, (layers, opt, outer) in enumerate(reps):
            _r, _base, dsteps = plans[i][k]
            for ds in dsteps:
                losses[ds] = _step(layers, opt, batch, ds, job.num_micro_batches, splits)
            prog = outer.progress()
            if pending is not None:
                outer.merge(pending)
            outer.replay(prog)
            enc = outer.encode(prog)
            sent += sum(sum(memoryview(b).nbytes for b in bufs) for _m, bufs, _d in enc.values())
            mine.append({layer: Contribution(len(dsteps) * tokens_per_step, dec) for layer, (_m, _b, dec) in enc.items()})
        pending = {layer: [c[layer] for c in mine] for layer in mine[0]}
    for _layers, _opt, outer in reps:
        outer.merge(pending)
        outer.reset_to_anchor()
    final = held_out_loss(reps[0][0], batch, job.steps, held_out, job.num_micro_batches)
    return losses, {"rounds": len(plans[0]), "exchange_bytes": sent,
                    "exchange_bytes_per_token": round(sent / (job.steps * tokens_per_step), 3),
                    "held_out_loss": round(final, 4)}


def _reference(job: JobSpec, steps: int) -> list[float]:
    """The one-process losses, kept in /tmp by the job's fingerprint (a sweep computes them once)."""
    import hashlib
    import pathlib

    key = hashlib.sha256(json.dumps([job.to_dict(), steps], sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = pathlib.Path(f"/tmp/spantrain-reference-{key}.json")
    if path.exists():
        return json.loads(path.read_text())
    losses, _ = reference_run(job, steps)
    path.write_text(json.dumps(losses))
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hf:gpt2-tiny")
    ap.add_argument("--model-arg", action="append", default=["n_embd=128", "n_layer=4"])
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds-steps", default="10,5", help="steps per round of each island, e.g. 10,5")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--islands-lr", type=float, default=None, help="the islands' inner learning rate (default --lr)")
    ap.add_argument("--island-split", type=int, default=1,
                    help="--island-split: the islands take each data step as this many optimizer steps (of "
                         "micro-batches / K each); the global run is also trained so, for comparison")
    ap.add_argument("--last", type=int, default=20, help="compare the mean loss of the last N data steps")
    a = ap.parse_args(argv)
    args = {}
    for kv in a.model_arg:
        k, _, v = kv.partition("=")
        args[k] = int(v) if v.isdigit() else v
    job = JobSpec(model=a.model, model_args=args, data=a.data, seq_len=a.seq_len, micro_batch_size=a.micro_batch_size,
                  num_micro_batches=a.micro_batches, steps=a.steps, lr=a.lr, seed=a.seed, outer_lr=a.outer_lr,
                  outer_momentum=a.outer_momentum, sync="islands")
    job = with_data(job, job.data, job.tokenizer, None)  # the data set's and tokenizer's fingerprints, as a swarm's
    t0 = time.time()
    ref = _reference(job, a.steps)
    # one island taking every step, lossless, outer lr 1 without momentum: plain training (the
    # reference's losses, tests/test_outer.py), for its final model's held-out loss
    one, one_figs = islands_run(dataclasses.replace(job, outer_lr=1.0, outer_momentum=0.0), [a.steps], "none")
    assert max(abs(one[s] - ref[s]) for s in range(a.steps)) < 1e-3, "one island must train like one process"
    t1 = time.time()
    inner = dataclasses.replace(job, lr=a.islands_lr) if a.islands_lr else job
    isl, figs = islands_run(inner, [int(x) for x in a.rounds_steps.split(",")], a.codec, splits=a.island_split)
    t2 = time.time()
    g = sum(ref[-a.last:]) / a.last
    i = sum(isl[s] for s in range(a.steps - a.last, a.steps)) / a.last
    same = {}
    if a.island_split > 1:  # the global run with the islands' optimizer step (as many updates per token)
        one, one_figs2 = islands_run(dataclasses.replace(job, outer_lr=1.0, outer_momentum=0.0), [a.steps], "none",
                                     splits=a.island_split)
        gs = sum(one[s] for s in range(a.steps - a.last, a.steps)) / a.last
        same = {f"global_split_last{a.last}": round(gs, 4), "islands_over_global_split": round(i / gs, 4),
                "global_split_held_out_loss": one_figs2["held_out_loss"]}
    print(json.dumps({"steps": a.steps, "rounds_steps": a.rounds_steps, "codec": a.codec, "islands_lr": inner.lr, "island_split": a.island_split,
                      "outer_lr": a.outer_lr,
                      "outer_momentum": a.outer_momentum, f"global_last{a.last}": round(g, 4),
                      f"islands_last{a.last}": round(i, 4), "islands_over_global": round(i / g, 4),
                      "global_held_out_loss": one_figs["held_out_loss"],
                      "held_out_islands_over_global": round(figs["held_out_loss"] / one_figs["held_out_loss"], 4), **figs,
                      **same,
                      "seconds": [round(t1 - t0, 1), round(t2 - t1, 1)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
