"""A first pipeline stage's backward split into B and W against the same backward fused (issue 31).

On ZB-H1's first stage each micro-batch's W comes right after its own B, and the peers run the two
as one backward (``schedule.fuse_adjacent_backward``). This times what that saves, with the
executor's own methods: the side-by-side's job (the built-in model at dim 128, 4 heads, sequence
64, micro-batches of 8; ``scripts/pipelining_side_by_side.py``), its first stage of four (layers
[0, 3): the embedding and two blocks), one thread. Each round runs ``--reps`` micro-batches forward
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spantrain_p2p.models.model import ModelConfig, build_layer_range  # noqa: E402
from spantrain_p2p.pipeline.executor import StageExecutor, _Mb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20, help="micro-batches a round and way")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a peer computes
    cfg = ModelConfig(dim=128, depth=8, heads=4, vocab=256, seq_len=64)
    layers = build_layer_range(cfg, 0, 3)
    ids = torch.randint(0, cfg.vocab, (8, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    grad = torch.randn(8, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(1))
    ex = StageExecutor(layers, True, False, 8, batch=lambda step, mb: (ids, None), recv=None, send=None)

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
