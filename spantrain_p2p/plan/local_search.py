"""Local search in the full cost model: from a plan, its neighbours one small change away.

``neighbours``: a layer cut moved by one, a replica dropped, added, moved or exchanged, a stage
split, merged, dropped, inserted or handed to an unused peer, two stages swapped, the pipeline
reversed; each also with its layers re-split by speed (``rebalance``). ``local_search``: steepest
descent over them within a budget of plans evaluated.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from .search import INF, Search
from .types import Plan, Stage


def neighbours(ctx: Search, plan_: Plan) -> Iterator[tuple[Stage, ...]]:
    """Plans one small change away: a layer cut moved by one, a replica dropped or added (the
    fastest unused peer of the stage's group and class), a stage split in two or two adjacent
    stages of one group merged, a one-peer stage dropped (its layers to a neighbour). Then each
    of them with its layers re-split by speed, computed only as the caller gets that far."""
    grouping, peers, opts = ctx.grouping, ctx.peers, ctx.opts
    where = {pid: (gi, ci) for gi, g in enumerate(grouping.groups) for ci, c in enumerate(g.classes) for pid in c}
    stages = list(plan_.stages)
    p = len(stages)
    used = {pid for st in stages for pid in st.peers}

    st = ctx.stage

    def same_place(ids: Sequence[str]) -> bool:
        keys = {where[x] for x in ids}
        groups = {k[0] for k in keys}
        if len(groups) != 1:
            return False
        if not opts.single_class_stages or len(keys) == 1:
            return True
        speeds = [peers[x].flops for x in ids]
        return bool(opts.replica_speed_ratio) and max(speeds) <= opts.replica_speed_ratio * min(speeds)

    out: list[list[Stage]] = []
    for k in range(p - 1):
        a, b = stages[k], stages[k + 1]
        for d in (-1, 1):
            cut = a.layers[1] + d
            if a.layers[0] < cut < b.layers[1]:
                new = stages[:]
                new[k], new[k + 1] = st(a.peers, a.layers[0], cut), st(b.peers, cut, b.layers[1])
                out.append(new)
        if same_place(a.peers + b.peers):
            new = stages[:k] + [st(a.peers + b.peers, a.layers[0], b.layers[1])] + stages[k + 2:]
            out.append(new)
    for k, s_ in enumerate(stages):
        lo, hi = s_.layers
        if len(s_.peers) > 1:
            for pid in s_.peers:
                new = stages[:]
                new[k] = st([x for x in s_.peers if x != pid], lo, hi)
                out.append(new)
            if hi - lo > 1:
                ordered = sorted(s_.peers, key=lambda x: (-peers[x].flops, x))
                half, mid = len(ordered) // 2, (lo + hi) // 2
                out.append(stages[:k] + [st(ordered[:half], lo, mid), st(ordered[half:], mid, hi)] + stages[k + 1:])
                out.append(stages[:k] + [st(ordered[half:], lo, mid), st(ordered[:half], mid, hi)] + stages[k + 1:])
        spare = [x for x in peers if x not in used and same_place(s_.peers + (x,))]
        if spare:
            pid = min(spare, key=lambda x: (-peers[x].flops, x))
            new = stages[:]
            new[k] = st(s_.peers + (pid,), lo, hi)
            out.append(new)
        if p > 1:
            if k > 0:
                prev = stages[k - 1]
                out.append(stages[:k - 1] + [st(prev.peers, prev.layers[0], hi)] + stages[k + 1:])
            if k < p - 1:
                nxt = stages[k + 1]
                out.append(stages[:k] + [st(nxt.peers, lo, nxt.layers[1])] + stages[k + 2:])
        if k < p - 1:  # swap the peers of two neighbouring stages
            nxt = stages[k + 1]
            out.append(stages[:k] + [st(nxt.peers, lo, hi), st(s_.peers, *nxt.layers)] + stages[k + 2:])
    # one replica moved to, or exchanged with, another stage of the same group (small stages)
    for k in range(p):
        for l in range(p):
            a, b = stages[k], stages[l]
            if k == l or len(a.peers) > 8 or len(b.peers) > 8:
                continue
            for x in a.peers:
                if len(a.peers) > 1 and same_place(b.peers + (x,)):
                    new = stages[:]
                    new[k] = st([y for y in a.peers if y != x], *a.layers)
                    new[l] = st(b.peers + (x,), *b.layers)
                    out.append(new)
                if k < l:
                    for y in b.peers:
                        ra = [z for z in a.peers if z != x] + [y]
                        rb = [z for z in b.peers if z != y] + [x]
                        if same_place(ra) and same_place(rb):
                            new = stages[:]
                            new[k], new[l] = st(ra, *a.layers), st(rb, *b.layers)
                            out.append(new)
    if p > 1:  # the whole pipeline the other way round
        out.append([st(stages[p - 1 - k].peers, *stages[k].layers) for k in range(p)])
    # the fastest unused peer of each compute class of each group
    fastest_spare = []
    for g in grouping.groups:
        for c in g.classes:
            spare = [x for x in c if x not in used]
            if spare:
                fastest_spare.append(min(spare, key=lambda x: (-peers[x].flops, x)))
    for k, s_ in enumerate(stages):
        if len(s_.peers) == 1:
            for pid in fastest_spare:
                new = stages[:]
                new[k] = st([pid], *s_.layers)
                out.append(new)
    # a new one-peer stage of one of those, anywhere, taking half of a neighbour's layers
    for pid in fastest_spare:
        for k in range(p + 1):
            nb = stages[min(k, p - 1)]
            lo, hi = nb.layers
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            if k < p:
                out.append(stages[:k] + [st([pid], lo, mid), st(nb.peers, mid, hi)] + stages[k + 1:])
            else:
                out.append(stages[:p - 1] + [st(nb.peers, lo, mid), st([pid], mid, hi)])
    for x in out:
        yield tuple(x)
    # every structural change also with its layers re-split in proportion to the stages' speed
    for x in out:
        if len(x) > 1:
            yield tuple(rebalance(ctx, x))



def rebalance(ctx: Search, stages: list[Stage]) -> list[Stage]:
    """The same stages with the layer cuts that minimize the slowest stage's compute
    (work / speed; a min-max DP over cut points, O(p L^2), each stage's row at once in numpy;
    the earliest cut wins ties)."""
    peers, work = ctx.peers, ctx.work
    speed = [sum(peers[x].flops for x in s_.peers) for s_ in stages]
    p, L = len(stages), len(work) - 1
    w = np.asarray(work, dtype=float)
    diff = w[:, None] - w[None, :]  # diff[j, i]: work of layers [i, j)
    i_idx = np.arange(L + 1)
    best = np.full((p + 1, L + 1), INF)  # best[k, j]: first k stages cover layers [0, j)
    arg = np.zeros((p + 1, L + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, p + 1):
        js = np.arange(k, L - (p - k) + 1)
        if not len(js):
            continue
        m = np.maximum(best[k - 1][None, :], diff[js] / speed[k - 1])
        m[(i_idx[None, :] < k - 1) | (i_idx[None, :] >= js[:, None])] = INF
        best[k, js] = m.min(axis=1)
        arg[k, js] = m.argmin(axis=1)
    cuts = [L]
    for k in range(p, 0, -1):
        cuts.append(int(arg[k, cuts[-1]]))
    cuts.reverse()
    return [Stage(s_.peers, (cuts[k], cuts[k + 1]), s_.shares) for k, s_ in enumerate(stages)]


def local_search(ctx: Search, start: Plan, budget: int) -> tuple[Plan, int]:
    """Steepest descent in the full cost model from ``start`` over ``neighbours``, at most
    ``budget`` plans evaluated; each neighbour is tried at every micro-batch size and schedule."""
    opts = ctx.opts
    best, n = start, 0
    seen = {(start.stages, start.micro_batch_size)}
    while n < budget:
        improved = None
        for stages in neighbours(ctx, best):
            if n >= budget:
                break
            for b in opts.batch_sizes():
                if (stages, b) in seen or n >= budget:
                    continue
                seen.add((stages, b))
                n += 1
                cand = ctx.best_schedule(ctx.candidate(stages, b))
                if cand.step_s < (improved or best).step_s * (1 - 1e-9):
                    improved = cand
        if improved is None:
            break
        best = improved
    return best, n
