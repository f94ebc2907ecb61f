"""A pipeline stage's backward split into B and W against the same backward fused (issue 31).

On ZB-H1's first stage each micro-batch's W comes right after its own B, and the peers run the two
as one backward (``schedule.fuse_adjacent_backward``); on the other stages B and W stay apart. This
times, with the executor's own methods on the side-by-side's job and split (taken from
``scripts/pipelining_side_by_side.py``: ``make_job``, ``PROCESSES``), one stage's micro-batch forward
and backward three ways, one thread:
- ``fused``: one backward (``_backward_full``);
- ``split``: B then W as the executor runs them (``_backward_input``, ``_backward_weight``): in
  float32 the linear layers leave their weight gradients' factors to W (``pipeline.split_backward``);
- ``torch split``: B then W as ``torch.distributed.pipelining`` splits them (B keeps the graph and
  where each weight enters it, W runs autograd again from there): what the executor ran before.
``--stage`` picks the stage (0: the first, layers [0, 3): the embedding and two blocks). Each round
runs ``--reps`` micro-batches each way, the ways in turn, and the script prints the CPU
(``time.process_time``) a micro-batch took: the median of the rounds, and each round. It checks that
the three leave the same weight gradients, bit for bit.

    .venv/bin/python scripts/first_stage_backward.py [--stage 0] [--rounds 7] [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from pipelining_side_by_side import PROCESSES, make_job  # noqa: E402  (the side-by-side's job and split)
from spantrain_p2p.job.dataset import open_data  # noqa: E402
from spantrain_p2p.job.spec import ModelHandle  # noqa: E402
from spantrain_p2p.pipeline import split_backward  # noqa: E402
from spantrain_p2p.pipeline.executor import StageExecutor, _Mb  # noqa: E402
from spantrain_p2p.plan.stagemap import even_split  # noqa: E402

WAYS = ("split", "fused", "torch split")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", type=int, default=0, help=f"which of the {PROCESSES} stages (default 0)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20, help="micro-batches a round and way")
    args = ap.parse_args()
    if not 0 <= args.stage < PROCESSES:
        ap.error(f"--stage is one of 0..{PROCESSES - 1}")
    torch.set_num_threads(1)  # as a peer computes
    job = make_job(1)
    handle = ModelHandle(job)
    first, last = even_split(handle.num_layers, PROCESSES)[args.stage]
    is_first, is_last = first == 0, last == handle.num_layers
    ids, targets = open_data(job).batch(0, 0)
    shapes = handle.boundary_shapes()
    gen = torch.Generator().manual_seed(1)
    x = None if is_first else torch.randn(shapes[first], generator=gen)
    grad = None if is_last else torch.randn(shapes[last], generator=gen)
    executors = {}
    for way in WAYS:
        torch.manual_seed(0)  # the same weights each way
        ex = StageExecutor(handle.build(first, last), is_first, is_last, job.num_micro_batches,
                           batch=lambda step, mb: (ids, targets), recv=None, send=None)
        if way == "split":
            split_backward.install(list(ex.layers), ex._deferral)
        elif way == "torch split":
            ex._deferral = None
        executors[way] = ex

    def one(way: str) -> None:
        ex = executors[way]
        st = _Mb(inp=None if is_first else x.clone().requires_grad_(True))
        ex._forward(0, 0, st)
        st.grad_out = grad
        if way == "fused":
            ex._backward_full(st)
        else:
            ex._backward_input(st)
            ex._backward_weight(st)

    for way in WAYS:
        executors[way].zero_grad()
        one(way)
    want = executors["fused"].params
    same = all(all(torch.equal(p.grad, q.grad) for p, q in zip(want, executors[way].params)) for way in WAYS)
    for _ in range(5):
        for way in WAYS:
            one(way)
    ms: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            t0 = time.process_time()
            for _ in range(args.reps):
                one(way)
            ms[way].append((time.process_time() - t0) / args.reps * 1e3)
    print(f"stage {args.stage} of {PROCESSES} (layers [{first}, {last})), a micro-batch forward and backward:")
    for way in WAYS:
        print(f"{way:>12}: {statistics.median(ms[way]):.1f} ms of CPU (median of {args.rounds} rounds of "
              f"{args.reps}: {', '.join(f'{v:.1f}' for v in ms[way])})")
    print(f"weight gradients {'equal bit for bit' if same else 'DIFFER'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
