"""Memory levers, a stage's choice: which stages of a plan recompute their activations.

A stage keeps what its forwards save for their backwards (the stash) for as many micro-batches as
its schedule holds at once; where one of its peers cannot hold that beside the stage's weights,
gradients and optimizer state, full recomputation (``pipeline.memory``) keeps one activation per
layer instead, for a forward more in each backward pass (``layout._stage_work`` prices both).
``auto`` turns it on exactly on the stages that need it, so a plan that fits as it is stays as it is
(and trains bit for bit as before); ``full`` on every stage; ``none`` never.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..pipeline.assignment import dealt_shares, stage_warmups
from .cost import short_of_memory
from .layout import Layout, LinkTable, build_layout
from .types import ModelProfile, Plan, Snapshot

MODES = ("auto", "none", "full")


def fit(plan: Plan, mode: str, snapshot: Snapshot, profile: ModelProfile, links: LinkTable,
        op_overhead_s: float = 0.0, layout: Optional[Layout] = None) -> Plan:
    """``plan`` with ``recompute="full"`` on the stages ``mode`` asks for (``plan`` itself, the same
    object, where nothing changes)."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, not {mode!r}")
    if mode == "none":
        return plan
    if mode == "full":
        want = set(range(plan.num_stages))
    else:
        if layout is None or not layout.matches(plan):
            layout = build_layout(plan, snapshot, profile, links, op_overhead_s)
        m = plan.num_micro_batches
        warm = stage_warmups(plan.schedule, [dealt_shares(list(st.share_of().values()), m) for st in plan.stages], m)
        want = set(short_of_memory(layout, plan.schedule, warm, m))
    want = {s for s in want if plan.stages[s].recompute != "full"}
    if not want:
        return plan
    return replace(plan, stages=tuple(replace(st, recompute="full") if s in want else st
                                      for s, st in enumerate(plan.stages)))
