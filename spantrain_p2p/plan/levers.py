"""Memory levers, a stage's choice: which stages of a plan shard their optimizer state across their
replicas, and which recompute their activations.

A stage of replicas in one fast group may shard its optimizer state (ZeRO-1, ``train.shard``):
each replica owns the state of a share of the stage's parameters (``layout.shard_owners``), receives
the others' gradients of those only, steps them, and sends the others its updated weights (the
all-gather the cost model adds after the step, ``layout.ring_layers``). Never across a slow link
(``SHARD_MIN_BYTES_PER_S``): every step's weights would cross it after the backward, unhidden.

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
SHARD_MIN_BYTES_PER_S = 125e6  # 1 Gbit/s: the slowest link between replicas that may shard their state


def fit(plan: Plan, mode: str, snapshot: Snapshot, profile: ModelProfile, links: LinkTable,
        op_overhead_s: float = 0.0, layout: Optional[Layout] = None, shard: str = "none") -> Plan:
    """``plan`` with the levers ``mode`` (recomputation) and ``shard`` (sharded optimizer state) ask
    for: ``full`` on every stage that can take it, ``auto`` on the stages whose peers cannot hold
    them otherwise, sharding first (it costs one all-gather of the weights inside a fast group,
    where recomputation costs a forward more in every backward), recomputation where that is not
    enough. ``plan`` itself, the same object, where nothing changes."""
    for name, m in (("recompute", mode), ("shard", shard)):
        if m not in MODES:
            raise ValueError(f"{name} must be one of {MODES}, not {m!r}")
    stages = list(plan.stages)
    if shard == "full":
        stages = [replace(st, shard=True) if can_shard(st, links) else st for st in stages]
    if mode == "full":
        stages = [replace(st, recompute="full") for st in stages]
    if "auto" in (mode, shard):
        for lever, lever_mode in (("shard", shard), ("recompute", mode)):
            if lever_mode != "auto":
                continue
            cur = replace(plan, stages=tuple(stages))
            if layout is None or not layout.matches(cur):
                layout = build_layout(cur, snapshot, profile, links, op_overhead_s)
            m = cur.num_micro_batches
            warm = stage_warmups(cur.schedule, [dealt_shares(list(st.share_of().values()), m) for st in stages], m)
            for s in short_of_memory(layout, cur.schedule, warm, m):
                if lever == "shard" and not stages[s].shard and can_shard(stages[s], links):
                    stages[s] = replace(stages[s], shard=True)
                elif lever == "recompute":
                    stages[s] = replace(stages[s], recompute="full")
            layout = None
    if tuple(stages) == plan.stages:
        return plan
    return replace(plan, stages=tuple(stages))


def can_shard(stage, links: LinkTable) -> bool:
    """Whether ``stage``'s replicas may shard their optimizer state: two or more, every link between
    them fast (``SHARD_MIN_BYTES_PER_S`` both ways)."""
    ps = stage.peers
    return len(ps) > 1 and all(links.get(a, b).bandwidth >= SHARD_MIN_BYTES_PER_S for a in ps for b in ps if a != b)


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
        for pw in sw.peers:  # (sharded: each replica its share of the state, layout.sharded_state_share)
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
