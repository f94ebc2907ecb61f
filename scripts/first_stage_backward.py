"""A first pipeline stage's backward split into B and W against the same backward fused (issue 31).

On ZB-H1's first stage each micro-batch's W comes right after its own B, and the peers run the two
as one backward (``schedule.fuse_adjacent_backward``). This times what that saves, with the
executor's own methods on the side-by-side's job and split, taken from
``scripts/pipelining_side_by_side.py`` (``make_job``, ``PROCESSES``): its first stage of four (layers
[0, 3): the embedding and two blocks), built and fed as that script does, one thread. Each round runs ``--reps`` micro-batches forward
and backward, split (``_backward_input`` then ``_backward_weight``) and fused (``_backward_full``)
alternately, and prints the CPU (``time.process_time``) a micro-batch took: the median of the
rounds, and each round. It checks that the two leave the same weight gradients, bit for bit.

    .venv/bin/python scripts/first_stage_backward.py [--rounds 7] [--reps 20]
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
from spantrain_p2p.pipeline.executor import StageExecutor, _Mb  # noqa: E402
from spantrain_p2p.plan.stagemap import even_split  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20, help="micro-batches a round and way")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a peer computes
    job = make_job(1)
    handle = ModelHandle(job)
    first, last = even_split(handle.num_layers, PROCESSES)[0]
    ids, _ = open_data(job).batch(0, 0)
    grad = torch.randn(handle.boundary_shapes()[last], generator=torch.Generator().manual_seed(1))
    ex = StageExecutor(handle.build(first, last), True, False, job.num_micro_batches,
                       batch=lambda step, mb: (ids, None), recv=None, send=None)

    def one(split: bool) -> None:
        st = _Mb()
        ex._forward(0, 0, st)
        st.grad_out = grad
        if split:
            ex._backward_input(st)
            ex._backward_weight(st)
        else:
            ex._backward_full(st)

    grads = {}
    for split in (True, False):
        ex.zero_grad()
        one(split)
        grads[split] = [p.grad.clone() for p in ex.params]
    same = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    for _ in range(5):
        one(True)
        one(False)
    ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for split in (True, False):
            t0 = time.process_time()
            for _ in range(args.reps):
                one(split)
            ms[split].append((time.process_time() - t0) / args.reps * 1e3)
    for split, name in ((True, "split (B, then W)"), (False, "fused (BW)")):
        print(f"{name:>17}: {statistics.median(ms[split]):.1f} ms of CPU a micro-batch, forward and backward "
              f"(median of {args.rounds} rounds of {args.reps}: {', '.join(f'{x:.1f}' for x in ms[split])})")
    print(f"weight gradients {'equal bit for bit' if same else 'DIFFER'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
