"""The planner's search context (``Search``): the swarm, the model, the links, the grouping and
the options that every step of one planning run reads, and the steps they all share: a plan's
cost, its best schedule, its compression relaxed, a candidate's starting form.

The steps themselves: ``candidates`` (units, segments, group orders, layer splits), ``dp``
(proxy tables and the dynamic programme), ``local_search``, ``exhaustive``, ``baselines``;
``planner.plan`` runs them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from ..pipeline.schedule import SCHEDULE_NAMES
from ..swarm.grouping import Grouping, GroupingOptions
from .cost import estimate
from . import levers
from .layout import Layout, LinkTable, build_layout
from .types import COMPRESSIONS, ModelProfile, Plan, Snapshot, Stage, compression_rank, compression_ratio

INF = math.inf
# The order the planner tries schedules in: the least bubble first (a tie keeps the earlier one).
SCHEDULES = SCHEDULE_NAMES[::-1]  # zb-h1, 1f1b, gpipe


@dataclass(frozen=True)
class PlannerOptions:
    global_batch: int = 256
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = SCHEDULES
    compressions: tuple[str, ...] = COMPRESSIONS  # allowed on activation hops, least lossy first
    grouping: GroupingOptions = field(default_factory=GroupingOptions)
    fine_group_size: int = 8  # groups up to this size: every peer is a unit
    chunks_per_class: int = 1  # larger groups: each compute class in up to this many units
    max_orders: int = 8
    thresholds: tuple[float, ...] = (0.0, 1 / 64, 1 / 16, 1 / 4, 1 / 2, 1.0)
    max_candidates: int = 10  # DP chains evaluated in the full cost model beyond 50 peers
    max_candidates_small: int = 200  # ... and up to 50 peers
    relax_tolerance: float = 0.01
    comm_margin: float = 2.0
    single_class_stages: bool = True
    replica_speed_ratio: float = 0.0  # >0: replicas may span classes if the fastest is at most this x the slowest
    local_evals: int = 400  # local search budget (plans evaluated) for up to 50 peers, scaled down beyond
    min_local_evals: int = 8
    local_starts: int = 4
    max_split_evals: int = 120  # a peer sequence with at most this many (layer split, micro-batch) pairs gets all
    op_overhead_s: float = 0.0
    # activation recomputation: auto (on the stages whose peers cannot hold their stash otherwise),
    # none (never), full (every stage) (``plan.levers``)
    recompute: str = "auto"
    # the optimizer state of replicated stages sharded across their replicas (``plan.levers``): the same modes
    shard: str = "none"

    def batch_sizes(self) -> list[int]:
        out = [b for b in self.micro_batch_sizes if b >= 1 and self.global_batch % b == 0]
        return out or [1]


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    grouping: Grouping
    seconds: float
    candidates: int
    timings: dict = field(default_factory=dict)


def cumulative_work(profile: ModelProfile) -> list[float]:
    """F + B + W FLOPs per sample of the layers before each layer boundary (``[0] = 0``)."""
    work = [0.0]
    for x in profile.layers:
        work.append(work[-1] + x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops)
    return work


@dataclass
class Search:
    """One planning run's inputs, read by every step of the search."""

    snapshot: Snapshot
    profile: ModelProfile
    links: LinkTable
    opts: PlannerOptions
    grouping: Optional[Grouping] = None  # the network groups and compute classes (the baselines need none)
    peers: dict = field(init=False)  # peer id -> PeerInfo
    work: list[float] = field(init=False)  # cumulative_work(profile)

    def __post_init__(self) -> None:
        self.peers = self.snapshot.by_id()
        self.work = cumulative_work(self.profile)

    @property
    def strongest(self) -> str:
        """The most compressing of the allowed compressions."""
        return min(self.opts.compressions, key=compression_ratio)

    def shares(self, ids: Sequence[str]) -> tuple[float, ...]:
        """Micro-batch shares of the replicas ``ids`` of a stage, in proportion to their speed."""
        tot = sum(self.peers[x].flops for x in ids)
        return tuple(self.peers[x].flops / tot for x in ids)

    def stage(self, ids: Sequence[str], lo: int, hi: int) -> Stage:
        """A stage of ``ids`` on layers ``[lo, hi)``, shares by speed."""
        return Stage(tuple(ids), (lo, hi), self.shares(ids))

    def candidate(self, stages: tuple[Stage, ...], b: int) -> Plan:
        """``stages`` at micro-batch size ``b`` with the first schedule and every hop at the strongest
        compression: the form a candidate is evaluated in (``best_schedule`` picks its schedule,
        ``relax_compression`` its compression at the end)."""
        return Plan(stages, self.opts.schedules[0], b, self.opts.global_batch // b,
                    (self.strongest,) * (len(stages) - 1))

    def evaluate(self, plan: Plan, layout: Optional[Layout] = None) -> Plan:
        """``plan`` with the cost model's step time and bottleneck, and the memory levers its stages
        need (``levers.fit``: a stage its peers cannot hold recomputes, under ``opts.recompute``)."""
        mode, shard = self.opts.recompute, self.opts.shard
        if "full" in (mode, shard):
            fixed = levers.fit(plan, mode if mode == "full" else "none", self.snapshot, self.profile, self.links,
                               self.opts.op_overhead_s, layout, shard if shard == "full" else "none")
            layout = layout if fixed is plan else None
            plan = fixed
        e = estimate(plan, self.snapshot, self.profile, self.links, op_overhead_s=self.opts.op_overhead_s,
                     layout=layout)
        if "auto" in (mode, shard) and e.bottleneck.startswith("memory:"):  # only a plan that does not fit changes
            fitted = levers.fit(plan, mode, self.snapshot, self.profile, self.links, self.opts.op_overhead_s, layout,
                                shard)
            if fitted is not plan:
                plan = fitted
                e = estimate(plan, self.snapshot, self.profile, self.links, op_overhead_s=self.opts.op_overhead_s)
        return plan.with_estimate(e.step_s, e.bottleneck)

    def best_schedule(self, plan: Plan, layout: Optional[Layout] = None) -> Plan:
        """``plan`` under the schedule of the options that gives the shortest step (the first on a tie)."""
        best = None
        layout = layout or build_layout(plan, self.snapshot, self.profile, self.links, self.opts.op_overhead_s)
        for sched in self.opts.schedules:
            cand = self.evaluate(replace(plan, schedule=sched), layout)
            if best is None or cand.step_s < best.step_s * (1 - 1e-9):
                best = cand
        assert best is not None
        return best

    def relax_compression(self, plan: Plan, layout: Optional[Layout] = None) -> Plan:
        """Each hop: the least lossy compression that keeps the step within tolerance, judged with
        every link ``comm_margin`` times slower (jitter, and hops the model calls free but near-critical)."""
        if plan.num_stages < 2 or not math.isfinite(plan.step_s):
            return plan
        opts = self.opts
        layout = layout or build_layout(plan, self.snapshot, self.profile, self.links, opts.op_overhead_s)

        def pessimistic(p: Plan) -> float:
            return estimate(p, self.snapshot, self.profile, self.links, op_overhead_s=opts.op_overhead_s,
                            layout=layout, comm_scale=opts.comm_margin).step_s

        limit = pessimistic(plan) * (1 + opts.relax_tolerance)
        order = sorted(opts.compressions, key=compression_rank)
        comp = list(plan.compression)
        for h in range(len(comp)):
            for c in order:
                if compression_rank(c) >= compression_rank(comp[h]):
                    break
                trial = list(comp)
                trial[h] = c
                if pessimistic(replace(plan, compression=tuple(trial))) <= limit:
                    comp = trial
                    break
        return self.evaluate(replace(plan, compression=tuple(comp)), layout)
