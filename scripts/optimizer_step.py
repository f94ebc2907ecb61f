#!/usr/bin/env python3
"""How long one optimizer step takes over a job's layers: Adam by torch's kernel, fused (what
``make_optimizer`` picks where it can, ``job.optim.adam_kernel``), ``foreach`` and per tensor, and
the job's SGD as a peer makes it (``--optimizer sgd``: torch's, no momentum).
One thread, as in a peer; each timed by ``profile.step_tail.measure`` (what a peer publishes as its
step tail: copies of the parameters, up to 4 M elements, the median of ``--reps`` steps after the
first; its rate a byte times the model's bytes, both printed: the rate is what the planner prices an
offloaded step's host part at, ``train.planning.HOST_STEP_S_PER_PARAM_BYTE``). A benchmark, not a
test: the figures depend on the box and the hour.

    .venv/bin/python scripts/optimizer_step.py                  # the built-in model, all its layers
    .venv/bin/python scripts/optimizer_step.py --model-args '{"dim": 256, "depth": 8}' --reps 100
    .venv/bin/python scripts/optimizer_step.py --model-args '{"dim": 1024, "depth": 4}' --reps 9  # large tensors
    .venv/bin/python scripts/optimizer_step.py --model-args '{"dim": 256, "depth": 8}' --reps 9 --adam8bit
"""
from __future__ import annotations

import argparse
import json

import torch

from spantrain_p2p.job.optim import make_optimizer
from spantrain_p2p.job.spec import JobSpec, ModelHandle
from spantrain_p2p.profile import step_tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-args", default="{}", help="JSON: the built-in model's arguments (dim, depth, ...)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (a peer sets 1)")
    ap.add_argument("--adam8bit", action="store_true",
                    help="also torchao's 8-bit Adam (``--optimizer adam8bit``; its first step compiles, ~20 s)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    handle = ModelHandle(JobSpec(model_args=json.loads(a.model_args)))
    layers = handle.build(0, handle.num_layers)
    params = [p for layer in layers for p in layer.parameters()]
    n = sum(p.numel() for p in params)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    print(f"{len(params)} tensors, {n:,} parameters, {a.threads} thread(s), median of {a.reps} steps each")
    makers = [(name, lambda ps, kernel=kernel: torch.optim.Adam(ps, lr=1e-3, **kernel)) for name, kernel in
              (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("per tensor", {"foreach": False}))]
    makers.append(("sgd", lambda ps: make_optimizer(JobSpec(optimizer="sgd"), ps)))
    if a.adam8bit:
        makers.append(("adam8bit", lambda ps: make_optimizer(JobSpec(optimizer="adam8bit"), ps)))
    for name, make in makers:
        s_per_byte = step_tail.measure(layers, make, reps=a.reps)
        print(f"  {name:<10} {s_per_byte * nbytes * 1e3:7.3f} ms ({s_per_byte * 1e9:.3f} ns a weight byte)", flush=True)


if __name__ == "__main__":
    main()
