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

from ..pipeline.assignment import dealt_shares, peer_actions, stage_warmups
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


def predicted_peaks(plan: Plan, profile: ModelProfile) -> dict[str, dict[str, float]]:
    """Per peer of ``plan``, the memory the cost model holds it to (``cost.peak_memory``), in parts:
    ``state`` (weights, gradients, optimizer state), ``stash`` (the most micro-batches' activations
    held at once, and what recomputation holds once) and ``peak`` (their sum)."""
    from .types import Link, Network, PeerInfo

    ids = [p for st in plan.stages for p in st.peers]
    near = [(a, b) for x, y in zip(plan.stages, plan.stages[1:]) for a in x.peers for b in y.peers]
    near += [(a, b) for st in plan.stages for a in st.peers for b in st.peers if a != b]
    snap = Snapshot(tuple(PeerInfo(p, 1e12, 1e18) for p in ids),  # links, speed and memory do not matter here
                    Network({pair: Link(0.0, 1e12) for pair in near}))
    layout = build_layout(plan, snap, profile, LinkTable(snap))
    held = most_held(plan)
    out = {}
    for sw in layout.stages:
        for pw in sw.peers:
            stash = held.get(pw.id, 0) * sw.stash_bytes + (sw.stash_once if pw.mbs else 0.0)
            out[pw.id] = {"state": sw.state_bytes, "stash": stash, "peak": sw.state_bytes + stash}
    return out


def most_held(plan: Plan) -> dict[str, int]:
    """Per peer, the most micro-batches whose activations it holds at once, following its own list of
    actions in the plan's schedule (a forward keeps them; the backward that ends them, W or fused BW,
    frees them): exact, where the cost model's ``held_bound`` is a quick upper bound."""
    from ..pipeline.schedule import peak_stashed

    m = plan.num_micro_batches
    acts = peer_actions([st.assign(m) for st in plan.stages], plan.schedule)
    return {peer: peak_stashed(actions) for (_, peer), actions in acts.items()}
