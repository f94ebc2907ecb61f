"""The baselines the planner is measured against, in the same cost model, and the plan kinds a
job may ask for.

``gpipe-uniform`` / ``1f1b-uniform``: layers split evenly over the peers in join order, one peer
per stage, no compression (a Megatron/DeepSpeed pipeline). ``greedy``: Petals-style, each peer in
join order takes the next span of uncovered layers, sized by its share of the swarm's speed and
capped by its memory; once all layers are covered, a peer joins the stage with the fewest
servers per unit of work. ``best-region``: the planner's own plan inside the one network group
(region) where it is fastest, every slower link left out: what an operator does by hand with the
best site (its peers only; the other regions idle). That one runs the planner, so it lives in
``planner.py``, with ``baseline(kind)`` and ``baselines()``, which name them all.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from ..swarm.grouping import group
from .layout import LinkTable
from .search import PlannerOptions, Search
from .types import ModelProfile, Plan, Snapshot, Stage

BEST_REGION = "best-region"

# What a job's ``plan`` may be (``--plan``): the planner's search, the even split every peer
# computes alike (``stagemap.placeholder_map``), or one of ``baselines()``.
PLAN_KINDS = ("planner", "even", "gpipe-uniform", "1f1b-uniform", "greedy", "best-region")


def _search(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions],
            links: Optional[LinkTable]) -> Search:
    opts = options or PlannerOptions()
    links = links or LinkTable(snapshot, group(snapshot, opts.grouping).group_of())
    return Search(snapshot, profile, links, opts)


def _best_b(ctx: Search, make: Callable[[int, int], Plan], name: str) -> Plan:
    """The plan ``make(b, m)`` at the micro-batch size with the shortest step, named ``name``."""
    opts = ctx.opts
    best = None
    for b in opts.batch_sizes():
        cand = ctx.evaluate(make(b, opts.global_batch // b))
        if best is None or cand.step_s < best.step_s:
            best = cand
    assert best is not None
    return replace(best, name=name)


def uniform_baseline(snapshot: Snapshot, profile: ModelProfile, schedule: str,
                     options: Optional[PlannerOptions] = None, links: Optional[LinkTable] = None) -> Plan:
    """Layers split evenly over the peers in join order, one peer per stage, no compression.

    With more peers than layers, stage ``s`` gets peers ``s, s + L, s + 2L, ...`` as
    data-parallel replicas with equal shares (speed-blind, as such a pipeline would be).
    """
    ctx = _search(snapshot, profile, options, links)
    ids = [p.id for p in snapshot.peers]
    L = profile.num_layers
    p = min(len(ids), L)
    sizes = [L // p + (1 if k < L % p else 0) for k in range(p)]
    bounds = [0]
    for sz in sizes:
        bounds.append(bounds[-1] + sz)
    groups = [ids[k::p] for k in range(p)]
    stages = tuple(Stage(tuple(g), (bounds[k], bounds[k + 1]), tuple([1.0 / len(g)] * len(g)))
                   for k, g in enumerate(groups))

    def make(b: int, m: int) -> Plan:
        return Plan(stages, schedule, b, m, ("none",) * (p - 1))

    return _best_b(ctx, make, f"{schedule}-uniform")


def greedy_baseline(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
                    links: Optional[LinkTable] = None, schedule: str = "1f1b") -> Plan:
    """Petals-style greedy placement (see the module docstring), 1F1B, no compression."""
    ctx = _search(snapshot, profile, options, links)
    L = profile.num_layers
    total_speed = sum(p.flops for p in snapshot.peers)
    state = profile.state_bytes_per_param_byte
    lay = profile.layers
    b_ref = min(ctx.opts.batch_sizes())

    def fits(pid: str, lo: int, hi: int, held: int) -> bool:
        need = sum(x.param_bytes for x in lay[lo:hi]) * state + held * sum(
            b_ref * x.stash_bytes + x.stash_fixed_bytes for x in lay[lo:hi])
        return need <= snapshot.peer(pid).memory_bytes

    spans: list[list] = []  # [lo, hi, [peers]]
    covered = 0
    for pinfo in snapshot.peers:
        if covered < L:
            want = max(1, int(round(L * pinfo.flops / total_speed)))
            n = min(want, L - covered)
            while n > 1 and not fits(pinfo.id, covered, covered + n, 1 + len(snapshot.peers)):
                n -= 1
            if not fits(pinfo.id, covered, covered + n, 1):
                continue
            spans.append([covered, covered + n, [pinfo.id]])
            covered += n
            continue
        # all covered: join the span with the least speed per unit of work that this peer can hold
        def load(sp):
            work = sum(x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in lay[sp[0]:sp[1]])
            return sum(snapshot.peer(q).flops for q in sp[2]) / max(work, 1.0)

        options_ = [sp for sp in spans if fits(pinfo.id, sp[0], sp[1], 1 + len(snapshot.peers))]
        if options_:
            min(options_, key=lambda sp: (len(sp[2]), load(sp), sp[0]))[2].append(pinfo.id)
    if covered < L:
        if not spans:
            raise ValueError("greedy: no peer can hold a layer")
        spans[-1][1] = L  # the last peer takes the rest (it may not fit: then the plan is infeasible)
    stages = tuple(ctx.stage(sp[2], sp[0], sp[1]) for sp in spans)

    def make(b: int, m: int) -> Plan:
        return Plan(stages, schedule, b, m, ("none",) * (len(stages) - 1))

    return _best_b(ctx, make, "greedy")
