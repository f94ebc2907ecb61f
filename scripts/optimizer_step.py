#!/usr/bin/env python3
"""How long one Adam step takes over a job's layers, by torch's kernel: fused (what
``make_optimizer`` picks where it can, ``job.optim.adam_kernel``), ``foreach`` and per tensor.
One thread, as in a peer. A benchmark, not a test: the figures depend on the box and the hour.

    .venv/bin/python scripts/optimizer_step.py                  # the built-in model, all its layers
    .venv/bin/python scripts/optimizer_step.py --model-args '{"dim": 256, "depth": 8}' --reps 100
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from spantrain_p2p.job.spec import JobSpec, ModelHandle


def step_ms(params: list, reps: int, **kernel) -> tuple[float, float]:
    """(median, min) ms of ``torch.optim.Adam(params, **kernel).step()`` after its first step."""
    opt = torch.optim.Adam(params, lr=1e-3, **kernel)
    opt.step()  # makes the state
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-args", default="{}", help="JSON: the built-in model's arguments (dim, depth, ...)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (a peer sets 1)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    handle = ModelHandle(JobSpec(model_args=json.loads(a.model_args)))
    layers = handle.build(0, handle.num_layers)
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {n:,} parameters, {a.threads} thread(s), {a.reps} steps each")
    for name, kernel in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("per tensor", {"foreach": False})):
        med, low = step_ms(params, a.reps, **kernel)
        print(f"  {name:<10} {med:7.3f} ms median  {low:7.3f} min")


if __name__ == "__main__":
    main()
