#!/usr/bin/env python3
"""Issue 30's recomputation figures: what full activation recomputation saves and costs.

A whole pipeline in this process (``spantrain_p2p.job.inprocess``: 2 stages x 2 replicas of a
transformers Llama, fp32), each schedule run without and with ``--recompute full``, back to back,
``--pairs`` times. Per run: whether the losses equal the run without recomputation to the last bit,
each stage's most activation bytes held at once (``pipeline.memory.StashMeter``: what autograd keeps,
as it keeps it; the largest of the stage's replicas) and the compute seconds per step of all peers
together (the executors' F, B, W time; the box has 2 cores, the 4 peers share them).

    .venv/bin/python scripts/memory_figures.py [--model hf:llama-tiny] [--steps 20] [--pairs 3] [--json]

``--offload``: instead, the optimizer step of the whole model with ``--offload-optimizer`` and without
(median of 50 steps, after 5), next to what the cost model charges for offloading (``plan.layout``:
the copies at ``HOST_BYTES_PER_S`` and the host step); on this CPU the host is the device, so the
copies are memory copies. ``--device cuda`` (with ``--offload``): the weights on the GPU, the copies
over PCIe into pinned memory, and the copy rate itself measured both ways.

``--optimizer-steps N``: instead, 8-bit Adam against Adam (``--optimizer adam8bit``): the single-process
reference run of N steps on this Python's standard library as text (``--data stdlib``), the loss (mean
of the last 20 steps) of each, and the optimizer state per parameter as the tensors hold it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from spantrain_p2p.job.inprocess import run_pipeline  # noqa: E402
from spantrain_p2p.job.spec import JobSpec  # noqa: E402


def one(job: JobSpec, steps: int, recompute: str) -> tuple[list[float], dict, float]:
    stash: dict = {}
    losses, _ = asyncio.run(run_pipeline(job, 2, steps, widths=[2, 2], recompute=recompute, stash=stash))
    by_stage: dict[int, int] = {}
    for (k, _peer), (peak, _) in stash.items():
        by_stage[k] = max(by_stage.get(k, 0), peak)
    compute = sum(secs for _, secs in stash.values()) / steps
    return losses, by_stage, compute


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf:llama-tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--schedules", default="1f1b,zb-h1")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--optimizer-steps", type=int, default=0)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--device", default="cpu", help="--offload only: where the weights live (cpu, cuda)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a peer process
    if args.optimizer_steps:
        return optimizer_figures(args)
    if args.offload:
        return offload_figures(args)
    job = JobSpec(model=args.model, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                  num_micro_batches=args.micro_batches, steps=args.steps, lr=1e-3)
    rows = []
    for schedule in args.schedules.split(","):
        j = replace(job, schedule=schedule)
        pairs = []
        for _ in range(args.pairs):
            base, kept, t_none = one(j, args.steps, "none")
            losses, recomputed, t_full = one(j, args.steps, "full")
            pairs.append({"identical": losses == base, "stash_none": kept, "stash_full": recomputed,
                          "compute_none_s": round(t_none, 4), "compute_full_s": round(t_full, 4),
                          "extra_compute": round(t_full / t_none - 1, 3)})
        saved = {k: round(1 - pairs[0]["stash_full"][k] / pairs[0]["stash_none"][k], 4) for k in pairs[0]["stash_none"]}
        row = {"schedule": schedule, "model": args.model, "identical": all(p["identical"] for p in pairs),
               "stash_bytes_none": pairs[0]["stash_none"], "stash_bytes_full": pairs[0]["stash_full"],
               "activation_memory_saved": saved,
               "extra_compute_median": statistics.median(p["extra_compute"] for p in pairs),
               "pairs": [{k: p[k] for k in ("compute_none_s", "compute_full_s", "extra_compute")} for p in pairs]}
        rows.append(row)
        print(json.dumps(row) if args.json else
              f"{schedule}: losses {'bit-identical' if row['identical'] else 'DIFFER'}; activations held at most, "
              f"per stage: {row['stash_bytes_none']} -> {row['stash_bytes_full']} bytes "
              f"(saved {', '.join(f'{v:.1%}' for v in saved.values())}); compute per step "
              f"{[p['compute_none_s'] for p in row['pairs']]} -> {[p['compute_full_s'] for p in row['pairs']]} s, "
              f"extra median {row['extra_compute_median']:+.1%}", flush=True)
    print(f"{time.strftime('%H:%M', time.gmtime())} UTC", file=sys.stderr)
    return 0 if all(r["identical"] for r in rows) else 1


def offload_figures(args) -> int:
    from spantrain_p2p.job.optim import adam_kernel, make_optimizer
    from spantrain_p2p.job.spec import ModelHandle
    from spantrain_p2p.plan.types import HOST_BYTES_PER_S
    from spantrain_p2p.train.planning import HOST_STEP_S_PER_PARAM_BYTE

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    job = JobSpec(model=args.model, seq_len=args.seq_len)
    out = {}
    for offload in (False, True):
        handle = ModelHandle(job)
        params = [p for layer in handle.build(0, handle.num_layers) for p in layer.to(device).parameters()]
        opt = make_optimizer(replace(job, offload_optimizer=offload), params)
        times = []
        for i in range(55):
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        out["offloaded" if offload else "on_device"] = round(statistics.median(times), 6)
        weight_bytes = sum(p.numel() * 4 for p in params)
        del opt, params
    priced = weight_bytes * (3.0 / HOST_BYTES_PER_S + HOST_STEP_S_PER_PARAM_BYTE["adam"])
    row = {"model": args.model, "device": str(device), "weight_bytes": weight_bytes, "step_s": out,
           "added_s": round(out["offloaded"] - out["on_device"], 6), "priced_tail_s": round(priced, 6),
           "priced_copies_s": round(weight_bytes * 3.0 / HOST_BYTES_PER_S, 6)}
    if device.type == "cuda":  # the copy rate the cost model assumes (HOST_BYTES_PER_S), measured: pinned host <-> GPU
        host = torch.empty(weight_bytes // 4, dtype=torch.float32, pin_memory=True)
        dev = torch.empty_like(host, device=device)
        rates = {}
        for name, (dst, src) in {"to_host": (host, dev), "to_device": (dev, host)}.items():
            ts = []
            for _ in range(10):
                sync()
                t0 = time.perf_counter()
                dst.copy_(src)
                sync()
                ts.append(time.perf_counter() - t0)
            rates[name] = round(weight_bytes / statistics.median(ts[2:]) / 1e9, 2)
        row["host_copy_gb_per_s"] = rates
        masters = [torch.zeros(weight_bytes // 4, requires_grad=True)]  # the host's Adam alone, as priced
        masters[0].grad = torch.full_like(masters[0], 1e-3)
        adam, ts = torch.optim.Adam(masters, **adam_kernel(masters)), []  # the kernel an offloaded step uses
        for _ in range(8):
            t0 = time.perf_counter()
            adam.step()
            ts.append(time.perf_counter() - t0)
        row["host_adam_s"] = round(statistics.median(ts[2:]), 6)
        row["priced_host_adam_s"] = round(weight_bytes * HOST_STEP_S_PER_PARAM_BYTE["adam"], 6)
    print(json.dumps(row), flush=True)
    print(f"{time.strftime('%H:%M', time.gmtime())} UTC", file=sys.stderr)
    return 0


def optimizer_figures(args) -> int:
    import warnings

    from spantrain_p2p.job.optim import make_optimizer
    from spantrain_p2p.job.reference import reference_run
    from spantrain_p2p.job.spec import ModelHandle
    from spantrain_p2p.train.memory_use import held_state

    warnings.filterwarnings("ignore")
    from spantrain_p2p.job.dataset import with_data

    base = with_data(JobSpec(model=args.model, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                             num_micro_batches=args.micro_batches, steps=args.optimizer_steps, lr=1e-3),
                     "stdlib", "bytes")
    out = {}
    for opt_name in ("adam", "adam8bit"):
        job = replace(base, optimizer=opt_name)
        t0 = time.perf_counter()
        losses, _ = reference_run(job, args.optimizer_steps)
        wall = time.perf_counter() - t0
        handle = ModelHandle(job)
        layers = handle.build(0, handle.num_layers)
        params = [p for layer in layers for p in layer.parameters()]
        opt = make_optimizer(job, params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        held = held_state(params, opt)
        n = sum(p.numel() for p in params)
        out[opt_name] = {"final_loss": round(statistics.mean(losses[-20:]), 4), "wall_s": round(wall, 1),
                         "state_bytes_per_param": round(held["optimizer"] / n, 3)}
    out["loss_vs_adam"] = round(out["adam8bit"]["final_loss"] / out["adam"]["final_loss"] - 1, 4)
    print(json.dumps({"model": args.model, "steps": args.optimizer_steps, "data": "stdlib", **out}), flush=True)
    print(f"{time.strftime('%H:%M', time.gmtime())} UTC", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
