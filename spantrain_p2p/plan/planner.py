"""The planner's entry point: which peers form which pipeline stage, which layers each stage runs, how
micro-batches are sized and shared, which schedule, and how much each hop compresses.

Search, in order:

1. **Groups** (``swarm.grouping``; units and segments in ``candidates``): network groups, compute classes inside them. A stage is
   always a *segment* of one group: a run of its *units* in speed order (a unit is one peer in
   a small group, a compute class in a large one), by default inside one compute class. So a
   stage's all-reduce stays on its group's fast links, only activations cross slow ones, and a
   stage's replicas run at about the same speed (a much slower replica holds up the micro-batches
   it owns, and with them every later one: they flow in index order).
2. **Orders of groups** (``candidates.group_orders``): every permutation for up to 4 groups; beyond, a handful of chains
   (fastest first, slowest first, nearest-neighbour chains on inter-group link cost from each
   of the fastest groups, 2-opt improved); inside each group, fastest units first or last. The
   DP may skip any unit, so an order also covers its sub-orders.
3. **Dynamic programming over layers x segments** (``dp``) for each micro-batch size and order, with a
   proxy of the cost model: the step is about ``max over stages and hops of their busy time``
   (compute + all-reduce of a stage, serialization and round trip of a hop) plus the time one
   micro-batch takes through everything. A min-max pass finds the smallest bottleneck ``t*``;
   passes at thresholds just above it minimize the latency sum under the bottleneck (the
   trade Alpa makes). Numpy, O(L S^2) per pass for L layers and S segments: the number of
   peers only enters through the grouping and the evaluations below.
4. **Evaluation** of the distinct DP candidates in the full cost model (``plan.cost``), each
   with its DP layer cuts and with the cuts that balance compute, under every schedule.
5. **Local search** (``local_search``) in the full cost model from the best few: a cut moved by one, a replica
   dropped, added, moved or exchanged, a stage split, merged, dropped, inserted or handed to an
   unused peer, two stages swapped, the pipeline reversed (each also with balanced cuts); up to
   50 peers, the best few peer sequences also get every layer split. Its budget shrinks with
   the swarm, so planning time stays about N log N (grouping) plus a constant.
6. Each hop's compression is relaxed to the least lossy one that costs under 1 % of step time
   with every link ``comm_margin`` (2x) slower, so a hop is only left uncompressed with room.

``exhaustive=True`` (``exhaustive``) tries every ordered partition of every subset of peers into stages, every
layer split, micro-batch size and schedule (small instances only), in the same cost model: the
yardstick for tests. With ``single_class_stages`` it keeps the planner's rule for a stage.

Baselines (``baselines``) in the same cost model: ``gpipe-uniform`` / ``1f1b-uniform`` (layers split evenly
over the peers in join order, one peer per stage, no compression: a Megatron/DeepSpeed
pipeline) and ``greedy`` (Petals-style: each peer in join order takes the next span of
uncovered layers, sized by its share of the swarm's speed and capped by its memory; once all
layers are covered, a peer joins the stage with the fewest servers per unit of work) and
``best-region`` (this planner inside the single fastest network group, the slow links left out).

Every step reads one ``search.Search`` (the snapshot, model profile, links, grouping, options).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Optional, Sequence

from ..swarm.grouping import group
from . import dp
from .baselines import BEST_REGION, greedy_baseline, uniform_baseline
from .candidates import Segment, compositions, segments, units
from .exhaustive import exhaustive as exhaustive_search
from .layout import LinkTable
from .local_search import local_search, rebalance
from .search import PlannerOptions, PlanResult, Search  # noqa: F401  (the plan API)
from .types import ModelProfile, Plan, Snapshot, Stage


REGIONS_MAX_PEERS = 200  # up to this many peers the planner also plans each network group alone


def plan(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
         exhaustive: bool = False, evaluated: Optional[list] = None, regions: bool = True) -> PlanResult:
    """The planner's best plan for ``snapshot`` (with its cost-model prediction).

    ``exhaustive``: try every ordered stage partition instead (small instances only).
    ``evaluated``: a list that receives ``(proxy cost, plan)`` for every candidate evaluated.
    ``regions``: with several network groups (and at most ``REGIONS_MAX_PEERS`` peers), also plan
    each group alone and keep the best: the search over the whole swarm can miss a plan that
    leaves the slow links out (best-region found one 15 % faster on volunteers-real with GPT-2 XL).
    """
    opts = options or PlannerOptions()
    t0 = time.perf_counter()
    grouping = group(snapshot, opts.grouping)
    t_group = time.perf_counter() - t0
    ctx = Search(snapshot, profile, LinkTable(snapshot, grouping.group_of()), opts, grouping)
    if exhaustive:
        best, n = exhaustive_search(ctx)
        return PlanResult(best, grouping, time.perf_counter() - t0, n, {"grouping_s": t_group})
    us = units(ctx)
    segs = segments(ctx, us)
    variants = dp.orders_and_flips(ctx, us)
    t_dp = time.perf_counter()
    chains = dp.chains(ctx, us, segs, variants)
    t_dp = time.perf_counter() - t_dp
    t_eval = time.perf_counter()
    best, starts, n_eval = _evaluate_chains(ctx, chains, segs, evaluated)
    t_eval = time.perf_counter() - t_eval
    t_local = time.perf_counter()
    best, n_split = _every_split(ctx, best, starts)
    starts.sort(key=lambda x: x.step_s)
    budget = max(opts.min_local_evals, int(opts.local_evals * min(1.0, 50.0 / len(snapshot.peers))))
    n_local = 0
    for start in starts[:opts.local_starts]:
        if n_local >= budget:
            break
        found, used_evals = local_search(ctx, start, budget - n_local)
        n_local += used_evals
        if found.step_s < best.step_s:
            best = found
    best = ctx.relax_compression(best)
    t_local = time.perf_counter() - t_local
    if regions and len(grouping.groups) > 1 and len(snapshot.peers) <= REGIONS_MAX_PEERS:
        alone = _best_single_region(ctx, grouping, opts)
        if alone is not None and alone.step_s < best.step_s:
            best = replace(alone, name=best.name)
    return PlanResult(best, grouping, time.perf_counter() - t0, n_eval + n_split + n_local,
                      {"grouping_s": t_group, "dp_s": t_dp, "evaluate_s": t_eval, "local_search_s": t_local,
                       "segments": len(segs), "orders": len(variants)})


def _evaluate_chains(ctx: Search, chains: dict[tuple, float], segs: list[Segment],
                     evaluated: Optional[list]) -> tuple[Plan, list[Plan], int]:
    """The best DP chains (by proxy) in the full cost model, each with its DP layer cuts and with
    the cuts that balance compute exactly (the proxy's are rough), under every schedule: the best
    plan, every plan evaluated (the local search's starting points) and how many."""
    opts, n_peers = ctx.opts, len(ctx.snapshot.peers)
    keep = opts.max_candidates_small if n_peers <= 50 else opts.max_candidates
    ranked = sorted(chains.items(), key=lambda kv: kv[1])[:keep]
    best: Optional[Plan] = None
    starts: list[Plan] = []
    tried: set = set()
    for rank, ((b, chain), _proxy) in enumerate(ranked):
        stages = tuple(Stage(segs[s].peers, (i, j), segs[s].shares) for s, i, j in chain)
        variants_ = [stages]
        if n_peers <= 50 or rank < 3:
            variants_.append(tuple(rebalance(ctx, list(stages))))
        for variant in variants_:
            if (variant, b) in tried:
                continue
            tried.add((variant, b))
            cand = ctx.best_schedule(ctx.candidate(variant, b))
            starts.append(cand)
            if best is None or cand.step_s < best.step_s:
                best = cand
            if evaluated is not None:
                evaluated.append((_proxy, cand))
    if best is None or not math.isfinite(best.step_s):
        raise ValueError("no feasible plan: the model does not fit in the peers' memory")
    return best, starts, len(tried)


def _every_split(ctx: Search, best: Plan, starts: list[Plan]) -> tuple[Plan, int]:
    """The best few peer sequences of ``starts`` with every layer split, where there are few
    enough splits (up to 50 peers): the best plan so far and how many were evaluated; a better
    one joins ``starts``."""
    opts, L = ctx.opts, ctx.profile.num_layers
    starts.sort(key=lambda x: x.step_s)
    n_split = 0
    seen_seq: list = []
    for cand in list(starts):
        seq = tuple(st.peers for st in cand.stages)
        if seq in seen_seq:
            continue
        seen_seq.append(seq)
        if len(seen_seq) > opts.local_starts:
            break
        splits = math.comb(L - 1, len(seq) - 1) * len(opts.batch_sizes())
        if len(ctx.snapshot.peers) > 50 or splits > opts.max_split_evals:
            continue
        for comp in compositions(L, len(seq)):
            stages = tuple(ctx.stage(ids, *rng) for ids, rng in zip(seq, comp))
            for b in opts.batch_sizes():
                trial = ctx.best_schedule(ctx.candidate(stages, b))
                n_split += 1
                if trial.step_s < best.step_s:
                    best = trial
                    starts.append(trial)
    return best, n_split


def plan_largest(snapshot: Snapshot, configs: Sequence, options: Optional[PlannerOptions] = None):
    """(config, profile, PlanResult) for the first model config (largest first) that has a
    feasible plan; ValueError with the last reason if none has."""
    errors = []
    for cfg in configs:
        profile = ModelProfile.from_model_config(cfg)
        try:
            return cfg, profile, plan(snapshot, profile, options)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(f"no feasible plan for any model tried: {errors[-1] if errors else ''}")


# ---- the baselines that need the planner itself, and all of them by name ------------------------------
def best_region_baseline(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
                         links: Optional[LinkTable] = None) -> Plan:
    """The planner's plan inside each network group alone, the fastest of them (evaluated among the
    whole swarm's links, like every plan). Where no group can hold the model: the largest group's
    1F1B pipeline, which the cost model finds infeasible (``step_s`` infinite)."""
    opts = options or PlannerOptions()
    grouping = group(snapshot, opts.grouping)
    ctx = Search(snapshot, profile, links or LinkTable(snapshot, grouping.group_of()), opts)
    best = _best_single_region(ctx, grouping, opts)
    if best is None:
        largest = max(grouping.groups, key=lambda g: (len(g.peers), g.peers))
        members = set(largest.peers)
        region = Snapshot(tuple(p for p in snapshot.peers if p.id in members), snapshot.network)
        best = ctx.evaluate(uniform_baseline(region, profile, "1f1b", opts))
    return replace(best, name=BEST_REGION)


def _best_single_region(ctx: Search, grouping, opts: PlannerOptions) -> Optional[Plan]:
    """The planner's plan of each network group alone, the fastest in ``ctx`` (the whole swarm's
    links); None if no group can hold the model."""
    best = None
    for g in grouping.groups:
        members = set(g.peers)
        region = Snapshot(tuple(p for p in ctx.snapshot.peers if p.id in members), ctx.snapshot.network)
        try:
            cand = ctx.evaluate(plan(region, ctx.profile, opts, regions=False).plan)
        except ValueError:  # nothing fits in this group
            continue
        if best is None or cand.step_s < best.step_s:
            best = cand
    return best


def baseline(kind: str, snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
             links: Optional[LinkTable] = None) -> Plan:
    """The one baseline ``kind`` (a key of ``baselines()``)."""
    if kind in ("gpipe-uniform", "1f1b-uniform"):
        return uniform_baseline(snapshot, profile, kind.removesuffix("-uniform"), options, links)
    if kind == "greedy":
        return greedy_baseline(snapshot, profile, options, links)
    if kind == BEST_REGION:
        return best_region_baseline(snapshot, profile, options, links)
    raise ValueError(f"no baseline {kind!r}")


def baselines(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
              links: Optional[LinkTable] = None) -> dict[str, Plan]:
    opts = options or PlannerOptions()
    links = links or LinkTable(snapshot, group(snapshot, opts.grouping).group_of())
    return {
        "gpipe-uniform": uniform_baseline(snapshot, profile, "gpipe", opts, links),
        "1f1b-uniform": uniform_baseline(snapshot, profile, "1f1b", opts, links),
        "greedy": greedy_baseline(snapshot, profile, opts, links),
        BEST_REGION: best_region_baseline(snapshot, profile, opts, links),
    }
