"""The yardstick for tests: every ordered partition of every subset of peers into stages, every
layer split, micro-batch size and schedule, in the same cost model (small instances only)."""
from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence

from .candidates import compositions
from .layout import build_layout
from .search import PlannerOptions, Search
from .types import Plan


def ordered_partitions(items: Sequence[str]):
    """Every ordered partition of ``items`` into non-empty blocks."""
    n = len(items)
    if n == 0:
        yield ()
        return
    # assign each item a block label, blocks labelled in order of first use, then permute blocks
    def set_partitions(seq):
        if not seq:
            yield []
            return
        first, rest = seq[0], seq[1:]
        for part in set_partitions(rest):
            yield [(first,)] + part
            for k in range(len(part)):
                yield part[:k] + [(first,) + part[k]] + part[k + 1:]

    for part in set_partitions(list(items)):
        for perm in itertools.permutations(part):
            yield perm


def _replicas_ok(part, cls: dict, peers: dict, opts: PlannerOptions) -> bool:
    keys = {cls[x] for x in part}
    if len({k[0] for k in keys}) > 1:
        return False
    if len(keys) == 1:
        return True
    speeds = [peers[x].flops for x in part]
    return bool(opts.replica_speed_ratio) and max(speeds) <= opts.replica_speed_ratio * min(speeds)



def exhaustive(ctx: Search) -> tuple[Plan, int]:
    """Every ordered partition of every subset of peers into stages x every layer split x every
    micro-batch size and schedule, in the full cost model; with ``opts.single_class_stages``
    only stages inside one compute class of one network group (the planner's own rule).
    Branch and bound: a split whose busiest stage already computes longer than the best step
    found cannot win (the step is never shorter than any stage's compute)."""
    snapshot, profile, links, opts, grouping = ctx.snapshot, ctx.profile, ctx.links, ctx.opts, ctx.grouping
    ids = [p.id for p in snapshot.peers]
    if len(ids) > 7 or profile.num_layers > 10:
        raise ValueError("exhaustive search is for small instances (at most 7 peers and 10 layers)")
    peers = ctx.peers
    L = profile.num_layers
    work = ctx.work
    cls = {pid: (gi, ci) for gi, g in enumerate(grouping.groups) for ci, c in enumerate(g.classes) for pid in c}
    best: Optional[Plan] = None
    n = 0
    for r in range(1, len(ids) + 1):
        for subset in itertools.combinations(ids, r):
            for parts in ordered_partitions(subset):
                p = len(parts)
                if p > L:
                    continue
                if opts.single_class_stages and any(not _replicas_ok(part, cls, peers, opts) for part in parts):
                    continue
                speed = [sum(peers[x].flops for x in part) for part in parts]
                for comp in compositions(L, p):
                    stages = None
                    for b in opts.batch_sizes():
                        m = opts.global_batch // b
                        bound = max(m * b * (work[hi] - work[lo]) / sp for (lo, hi), sp in zip(comp, speed))
                        if best is not None and bound >= best.step_s:
                            continue
                        if stages is None:
                            stages = tuple(ctx.stage(part, *rng) for part, rng in zip(parts, comp))
                        cand = ctx.candidate(stages, b)
                        layout = build_layout(cand, snapshot, profile, links, opts.op_overhead_s)
                        cand = ctx.best_schedule(cand, layout)
                        n += len(opts.schedules)
                        if best is None or cand.step_s < best.step_s:
                            best = cand
    if best is None or not math.isfinite(best.step_s):
        raise ValueError("no feasible plan: the model does not fit in the peers' memory")
    return ctx.relax_compression(best), n
