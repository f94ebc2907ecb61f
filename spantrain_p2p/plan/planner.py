"""The planner: which peers form which pipeline stage, which layers each stage runs, how
micro-batches are sized and shared, which schedule, and how much each hop compresses.

Search, in order:

1. **Groups** (``swarm.grouping``): network groups, compute classes inside them. A stage is
   always a *segment* of one group: a run of its *units* in speed order (a unit is one peer in
   a small group, a compute class in a large one), by default inside one compute class. So a
   stage's all-reduce stays on its group's fast links, only activations cross slow ones, and a
   stage's replicas run at about the same speed (a much slower replica holds up the micro-batches
   it owns, and with them every later one: they flow in index order).
2. **Orders of groups**: every permutation for up to 4 groups; beyond, a handful of chains
   (fastest first, slowest first, nearest-neighbour chains on inter-group link cost from each
   of the fastest groups, 2-opt improved); inside each group, fastest units first or last. The
   DP may skip any unit, so an order also covers its sub-orders.
3. **Dynamic programming over layers x segments** for each micro-batch size and order, with a
   proxy of the cost model: the step is about ``max over stages and hops of their busy time``
   (compute + all-reduce of a stage, serialization and round trip of a hop) plus the time one
   micro-batch takes through everything. A min-max pass finds the smallest bottleneck ``t*``;
   passes at thresholds just above it minimize the latency sum under the bottleneck (the
   trade Alpa makes). Numpy, O(L S^2) per pass for L layers and S segments: the number of
   peers only enters through the grouping and the evaluations below.
4. **Evaluation** of the distinct DP candidates in the full cost model (``plan.cost``), each
   with its DP layer cuts and with the cuts that balance compute, under every schedule.
5. **Local search** in the full cost model from the best few: a cut moved by one, a replica
   dropped, added, moved or exchanged, a stage split, merged, dropped, inserted or handed to an
   unused peer, two stages swapped, the pipeline reversed (each also with balanced cuts); up to
   50 peers, the best few peer sequences also get every layer split. Its budget shrinks with
   the swarm, so planning time stays about N log N (grouping) plus a constant.
6. Each hop's compression is relaxed to the least lossy one that costs under 1 % of step time
   with every link ``comm_margin`` (2x) slower, so a hop is only left uncompressed with room.

``exhaustive=True`` tries every ordered partition of every subset of peers into stages, every
layer split, micro-batch size and schedule (small instances only), in the same cost model: the
yardstick for tests. With ``single_class_stages`` it keeps the planner's rule for a stage.

Baselines in the same cost model: ``gpipe-uniform`` / ``1f1b-uniform`` (layers split evenly
over the peers in join order, one peer per stage, no compression: a Megatron/DeepSpeed
pipeline) and ``greedy`` (Petals-style: each peer in join order takes the next span of
uncovered layers, sized by its share of the swarm's speed and capped by its memory; once all
layers are covered, a peer joins the stage with the fewest servers per unit of work).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

import numpy as np

from ..swarm.grouping import Grouping, GroupingOptions, group
from .cost import estimate
from ..pipeline.assignment import microbatch_counts
from .layout import Layout, LinkTable, build_layout
from .types import (COMPRESSIONS, ModelProfile, Plan, Snapshot, Stage, compression_rank,
                    compression_ratio)

INF = math.inf
SCHEDULES = ("zb-h1", "1f1b", "gpipe")


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


# ------------------------------------------------------------------------------- helpers


def _shares(snapshot_peers: dict, ids: Sequence[str]) -> tuple[float, ...]:
    tot = sum(snapshot_peers[x].flops for x in ids)
    return tuple(snapshot_peers[x].flops / tot for x in ids)


def _evaluate(plan: Plan, snapshot: Snapshot, profile: ModelProfile, links: LinkTable,
              opts: PlannerOptions, layout: Optional[Layout] = None) -> Plan:
    e = estimate(plan, snapshot, profile, links, op_overhead_s=opts.op_overhead_s, layout=layout)
    return plan.with_estimate(e.step_s, e.bottleneck)


def _best_schedule(plan: Plan, snapshot: Snapshot, profile: ModelProfile, links: LinkTable,
                   opts: PlannerOptions, layout: Optional[Layout] = None) -> Plan:
    best = None
    layout = layout or build_layout(plan, snapshot, profile, links, opts.op_overhead_s)
    for sched in opts.schedules:
        cand = _evaluate(replace(plan, schedule=sched), snapshot, profile, links, opts, layout)
        if best is None or cand.step_s < best.step_s * (1 - 1e-9):
            best = cand
    assert best is not None
    return best


def _relax_compression(plan: Plan, snapshot: Snapshot, profile: ModelProfile, links: LinkTable,
                       opts: PlannerOptions, layout: Optional[Layout] = None) -> Plan:
    """Each hop: the least lossy compression that keeps the step within tolerance, judged with
    every link ``comm_margin`` times slower (jitter, and hops the model calls free but near-critical)."""
    if plan.num_stages < 2 or not math.isfinite(plan.step_s):
        return plan
    layout = layout or build_layout(plan, snapshot, profile, links, opts.op_overhead_s)

    def pessimistic(p: Plan) -> float:
        return estimate(p, snapshot, profile, links, op_overhead_s=opts.op_overhead_s, layout=layout,
                        comm_scale=opts.comm_margin).step_s

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
    return _evaluate(replace(plan, compression=tuple(comp)), snapshot, profile, links, opts, layout)


def _strongest(opts: PlannerOptions) -> str:
    return min(opts.compressions, key=compression_ratio)


# ------------------------------------------------------------------------- units, segments


@dataclass
class _Segment:
    group: int
    u0: int  # first unit (index within the group)
    u1: int  # last unit, inclusive
    peers: tuple[str, ...]
    shares: tuple[float, ...]


def _units(grouping: Grouping, peers: dict, opts: PlannerOptions) -> list[list[tuple[tuple[str, ...], int]]]:
    """Per group, its units in speed order, each with the index of its compute class."""
    out = []
    for g in grouping.groups:
        units = []
        fine = len(g.peers) <= opts.fine_group_size
        for ci, c in enumerate(g.classes):
            cs = sorted(c, key=lambda x: (-peers[x].flops, x))
            if fine:
                units.extend(((pid,), ci) for pid in cs)
                continue
            k = max(1, min(opts.chunks_per_class, len(cs)))
            size = len(cs) / k
            for i in range(k):
                chunk = tuple(cs[int(round(i * size)):int(round((i + 1) * size))])
                if chunk:
                    units.append((chunk, ci))
        out.append(units)
    return out


def _segments(units: list[list[tuple[tuple[str, ...], int]]], peers: dict, single_class: bool,
              ratio: float = 0.0) -> list[_Segment]:
    """Stages the search may form: runs of consecutive units of one compute class. Replicas of a
    stage are then within 1.5x of each other's speed: a much slower replica would hold up the
    micro-batches it owns, and with them every later one (they flow in index order)."""
    segs = []
    for gi, us in enumerate(units):
        for a in range(len(us)):
            for b in range(a, len(us)):
                ids = tuple(pid for u, _c in us[a:b + 1] for pid in u)
                if single_class and us[b][1] != us[a][1]:
                    if not ratio or max(peers[x].flops for x in ids) > ratio * min(peers[x].flops for x in ids):
                        continue
                segs.append(_Segment(gi, a, b, ids, _shares(peers, ids)))
    return segs


# ---------------------------------------------------------------------------- group orders


def _group_link(links: LinkTable, grouping: Grouping, ga: int, gb: int) -> tuple[float, float]:
    """(rtt_s, bandwidth) representative of links from group ga to group gb."""
    a, b = grouping.groups[ga].peers[0], grouping.groups[gb].peers[0]
    est = links.estimates.get((min(ga, gb), max(ga, gb)))
    if est is not None:
        return est.rtt_s, est.bandwidth
    lk = links.get(a, b)
    return lk.rtt_s, lk.bandwidth


def _orders(grouping: Grouping, peers: dict, links: LinkTable, ref_bytes: float,
            opts: PlannerOptions) -> list[tuple[int, ...]]:
    g = len(grouping.groups)
    if g <= 4:
        return list(itertools.permutations(range(g)))
    speed = [sum(peers[x].flops for x in grp.peers) for grp in grouping.groups]
    cost = [[0.0] * g for _ in range(g)]
    for i in range(g):
        for j in range(g):
            if i != j:
                rtt, bw = _group_link(links, grouping, i, j)
                cost[i][j] = rtt + ref_bytes / bw
    by_speed = tuple(sorted(range(g), key=lambda i: (-speed[i], i)))
    orders = [by_speed, tuple(reversed(by_speed))]

    def nn_chain(start: int) -> list[int]:
        chain, left = [start], set(range(g)) - {start}
        while left:
            nxt = min(left, key=lambda j: (cost[chain[-1]][j], -speed[j], j))
            chain.append(nxt)
            left.remove(nxt)
        return chain

    def length(ch: Sequence[int]) -> float:
        return sum(cost[ch[i]][ch[i + 1]] for i in range(len(ch) - 1))

    def two_opt(ch: list[int]) -> list[int]:
        best, improved = ch[:], True
        while improved:
            improved = False
            for i in range(1, g - 1):
                for j in range(i + 1, g):
                    cand = best[:i] + best[i:j + 1][::-1] + best[j + 1:]
                    if length(cand) < length(best) - 1e-12:
                        best, improved = cand, True
        return best

    for start in by_speed[:3]:
        ch = nn_chain(start)
        orders.append(tuple(ch))
        orders.append(tuple(two_opt(ch)))
    seen, out = set(), []
    for o in orders:
        if o not in seen:
            seen.add(o)
            out.append(o)
    return out[:opts.max_orders]


# ------------------------------------------------------------------------------------ DP


class _Tables:
    """Proxy costs for one micro-batch size: stage cost/latency per (segment, first, last)
    and hop cost/latency per (cut layer, from segment, to segment)."""

    def __init__(self, segs: list[_Segment], grouping: Grouping, peers: dict, links: LinkTable,
                 profile: ModelProfile, b: int, m: int, n_units: int, opts: PlannerOptions,
                 intra: dict, inter: dict) -> None:
        L = profile.num_layers
        S = len(segs)
        lay = profile.layers
        fbw = np.concatenate([[0.0], np.cumsum([x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in lay])])
        par = np.concatenate([[0.0], np.cumsum([x.param_bytes for x in lay])])
        sta = np.concatenate([[0.0], np.cumsum([x.stash_bytes for x in lay])])
        FBW = fbw[None, :] - fbw[:, None]  # [i, j] = layers i..j-1
        PAR = par[None, :] - par[:, None]
        STA = sta[None, :] - sta[:, None]
        valid = np.triu(np.ones((L + 1, L + 1), dtype=bool), 1)
        state = profile.state_bytes_per_param_byte
        C = np.full((S, L + 1, L + 1), INF)
        LAT = np.full((S, L + 1, L + 1), INF)
        maxcount = np.zeros(S)
        kshare = np.zeros(S)
        for k, sg in enumerate(segs):
            counts = microbatch_counts(sg.shares, m)
            fl = np.array([peers[x].flops for x in sg.peers])
            cnt = np.array(counts, dtype=float)
            cb = float(np.max(cnt / fl))
            lc = float(np.sum(cnt / (m * fl)))
            maxcount[k] = cnt.max()
            kshare[k] = 1.0 / max(sg.shares)
            # activations a peer holds, for the deepest pipeline this order allows (upper bound)
            if all(x == "gpipe" for x in opts.schedules):
                held = cnt
            else:
                window = min(m, math.ceil(n_units * kshare[k]) + 1 + n_units)
                held = np.minimum(cnt, np.ceil(window * cnt / m) + 1)
            feas = valid.copy()
            mem = np.array([peers[x].memory_bytes for x in sg.peers])
            for h, mm in sorted(set(zip(held.tolist(), mem.tolist()))):
                feas &= state * PAR + h * b * STA <= mm
            n = len(sg.peers)
            ar = np.zeros_like(PAR)
            if n > 1:
                ring = [links.get(sg.peers[i], sg.peers[(i + 1) % n]) for i in range(n)]
                lat = max(x.rtt_s for x in ring) / 2
                bw = min(x.bandwidth for x in ring)
                ar = 2 * (n - 1) * (lat + PAR * profile.grad_wire_bytes_per_param_byte / n / bw)
            cost = cb * b * FBW + ar
            C[k] = np.where(feas, cost, INF)
            LAT[k] = np.where(valid, lc * b * FBW, INF)
        # hops
        act = np.array([x.activation_bytes_out for x in lay]) * b * compression_ratio(_strongest(opts))
        gidx = np.array([sg.group for sg in segs])
        rtt = np.zeros((S, S))
        bw = np.ones((S, S))
        for ga in range(len(grouping.groups)):
            for gb in range(len(grouping.groups)):
                r, w = intra[ga] if ga == gb else inter[(ga, gb)]
                mask = (gidx[:, None] == ga) & (gidx[None, :] == gb)
                rtt[mask] = r
                bw[mask] = w
        load = np.minimum(maxcount[:, None], maxcount[None, :])
        x = act[:, None, None] / bw[None, :, :]  # [cut-1, from, to]
        oneway = rtt[None] / 2 + x
        hb = np.maximum(load[None] * x, m * oneway / kshare[None, :, None])
        self.HB = np.concatenate([np.full((1, S, S), INF), hb], axis=0)  # index by cut layer i
        self.HL = np.concatenate([np.full((1, S, S), INF), 2 * oneway], axis=0)
        self.C, self.LAT, self.L, self.S = C, LAT, L, S


def _dp(T: _Tables, order_ok: np.ndarray, threshold: Optional[float]) -> Optional[list[tuple[int, int, int]]]:
    """Best chain of (segment, first layer, last layer) under the proxy.

    ``threshold`` None: minimize the bottleneck (max of stage and hop costs). Else: minimize
    the latency sum among chains whose every stage and hop cost is at most ``threshold``.
    """
    L, S = T.L, T.S
    minmax = threshold is None
    V = np.full((L + 1, S), INF)
    argi = np.zeros((L + 1, S), dtype=np.int64)
    prev = np.full((L + 1, S), INF)  # best value of a chain ending at layer i, then a hop into s
    args = np.full((L + 1, S), -1, dtype=np.int64)
    prev[0, :] = 0.0
    if not minmax:
        C_ok = T.C <= threshold
        HB_ok = (T.HB <= threshold) & order_ok[None]
    for j in range(1, L + 1):
        if minmax:
            cand = np.maximum(prev[:j, :], T.C[:, :j, j].T)  # [i, s]
        else:
            cand = np.where(C_ok[:, :j, j].T, prev[:j, :] + T.LAT[:, :j, j].T, INF)
        bi = np.argmin(cand, axis=0)
        V[j] = cand[bi, np.arange(S)]
        argi[j] = bi
        if j < L:
            if minmax:
                h = np.where(order_ok, np.maximum(V[j][:, None], T.HB[j]), INF)
            else:
                h = np.where(HB_ok[j], V[j][:, None] + T.HL[j], INF)
            bs = np.argmin(h, axis=0)
            prev[j] = h[bs, np.arange(S)]
            args[j] = bs
    last = int(np.argmin(V[L]))
    if not math.isfinite(V[L, last]):
        return None
    chain = []
    j, s = L, last
    while j > 0:
        i = int(argi[j, s])
        chain.append((s, i, j))
        if i == 0:
            break
        s = int(args[i, s])
        j = i
    chain.reverse()
    return chain


def _chain_bottleneck(T: _Tables, chain: list[tuple[int, int, int]]) -> tuple[float, float]:
    worst, lat = 0.0, 0.0
    for k, (s, i, j) in enumerate(chain):
        worst = max(worst, T.C[s, i, j])
        lat += T.LAT[s, i, j]
        if k:
            ps = chain[k - 1][0]
            worst = max(worst, T.HB[i, ps, s])
            lat += T.HL[i, ps, s]
    return worst, lat


# ---------------------------------------------------------------------------------- plan


def plan(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
         exhaustive: bool = False, evaluated: Optional[list] = None) -> PlanResult:
    """The planner's best plan for ``snapshot`` (with its cost-model prediction).

    ``exhaustive``: try every ordered stage partition instead (small instances only).
    ``evaluated``: a list that receives ``(proxy cost, plan)`` for every candidate evaluated.
    """
    opts = options or PlannerOptions()
    t0 = time.perf_counter()
    grouping = group(snapshot, opts.grouping)
    t_group = time.perf_counter() - t0
    links = LinkTable(snapshot, grouping.group_of())
    peers = snapshot.by_id()
    if exhaustive:
        best, n = _exhaustive(snapshot, profile, links, opts, grouping)
        return PlanResult(best, grouping, time.perf_counter() - t0, n, {"grouping_s": t_group})
    units = _units(grouping, peers, opts)
    segs = _segments(units, peers, opts.single_class_stages, opts.replica_speed_ratio)
    ref = max(x.activation_bytes_out for x in profile.layers)
    orders = _orders(grouping, peers, links, ref, opts)
    G = len(grouping.groups)
    intra, inter = {}, {}
    for ga in range(G):
        est = links.estimates.get((ga, ga))
        intra[ga] = (est.rtt_s, est.bandwidth) if est else (links.fallback.rtt_s, links.fallback.bandwidth)
        for gb in range(G):
            if ga != gb:
                inter[(ga, gb)] = _group_link(links, grouping, ga, gb)
    n_units = sum(len(u) for u in units)
    if G <= 2:
        flips = list(itertools.product((False, True), repeat=G))
    else:
        flips = [(False,) * G, (True,) * G]
    variants = [(o, f) for o in orders for f in flips]
    t_dp = time.perf_counter()
    chains: dict[tuple, float] = {}
    for b in opts.batch_sizes():
        m = opts.global_batch // b
        T = _Tables(segs, grouping, peers, links, profile, b, m, min(n_units, profile.num_layers), opts, intra, inter)
        for order, flip in variants:
            base = [0] * G
            acc = 0
            for g in order:
                base[g] = acc
                acc += len(units[g])
            # within a group, units fastest first, or (flip) slowest first
            u0 = np.array([base[sg.group] + (len(units[sg.group]) - 1 - sg.u1 if flip[sg.group] else sg.u0)
                           for sg in segs])
            u1 = np.array([base[sg.group] + (len(units[sg.group]) - 1 - sg.u0 if flip[sg.group] else sg.u1)
                           for sg in segs])
            order_ok = u1[:, None] < u0[None, :]
            top = _dp(T, order_ok, None)
            if top is None:
                continue
            tstar, lat = _chain_bottleneck(T, top)
            key = (b, tuple(top))
            chains[key] = min(chains.get(key, INF), tstar + lat)
            for frac in opts.thresholds[1:]:
                ch = _dp(T, order_ok, tstar + lat * frac)
                if ch is None:
                    continue
                w, lt = _chain_bottleneck(T, ch)
                key = (b, tuple(ch))
                chains[key] = min(chains.get(key, INF), w + lt)
    t_dp = time.perf_counter() - t_dp
    t_eval = time.perf_counter()
    keep = opts.max_candidates_small if len(snapshot.peers) <= 50 else opts.max_candidates
    ranked = sorted(chains.items(), key=lambda kv: kv[1])[:keep]
    best: Optional[Plan] = None
    starts: list[Plan] = []
    strong = _strongest(opts)
    work = _cumulative_work(profile)
    tried: set = set()
    for rank, ((b, chain), _proxy) in enumerate(ranked):
        stages = tuple(Stage(segs[s].peers, (i, j), segs[s].shares) for s, i, j in chain)
        # the DP's layer cuts, and the cuts that balance compute exactly (the proxy's are rough)
        variants_ = [stages]
        if len(snapshot.peers) <= 50 or rank < 3:
            variants_.append(tuple(_rebalance(list(stages), peers, work)))
        for variant in variants_:
            if (variant, b) in tried:
                continue
            tried.add((variant, b))
            cand = Plan(variant, opts.schedules[0], b, opts.global_batch // b, (strong,) * (len(variant) - 1))
            cand = _best_schedule(cand, snapshot, profile, links, opts)
            starts.append(cand)
            if best is None or cand.step_s < best.step_s:
                best = cand
            if evaluated is not None:
                evaluated.append((_proxy, cand))
    if best is None or not math.isfinite(best.step_s):
        raise ValueError("no feasible plan: the model does not fit in the peers' memory")
    t_eval = time.perf_counter() - t_eval
    t_local = time.perf_counter()
    starts.sort(key=lambda x: x.step_s)
    budget = max(opts.min_local_evals, int(opts.local_evals * min(1.0, 50.0 / len(snapshot.peers))))
    n_local = n_split = 0
    # the best few peer sequences with every layer split, where there are few enough splits
    seen_seq: list = []
    for cand in list(starts):
        seq = tuple(st.peers for st in cand.stages)
        if seq in seen_seq:
            continue
        seen_seq.append(seq)
        if len(seen_seq) > opts.local_starts:
            break
        splits = math.comb(profile.num_layers - 1, len(seq) - 1) * len(opts.batch_sizes())
        if len(snapshot.peers) > 50 or splits > opts.max_split_evals:
            continue
        for comp in _compositions(profile.num_layers, len(seq)):
            stages = tuple(Stage(ids, rng, _shares(peers, ids)) for ids, rng in zip(seq, comp))
            for b in opts.batch_sizes():
                trial = Plan(stages, opts.schedules[0], b, opts.global_batch // b, (strong,) * (len(seq) - 1))
                trial = _best_schedule(trial, snapshot, profile, links, opts)
                n_split += 1
                if trial.step_s < best.step_s:
                    best = trial
                    starts.append(trial)
    starts.sort(key=lambda x: x.step_s)
    for start in starts[:opts.local_starts]:
        if n_local >= budget:
            break
        found, used_evals = _local_search(start, snapshot, profile, links, opts, grouping, budget - n_local)
        n_local += used_evals
        if found.step_s < best.step_s:
            best = found
    best = _relax_compression(best, snapshot, profile, links, opts)
    t_local = time.perf_counter() - t_local
    return PlanResult(best, grouping, time.perf_counter() - t0, len(tried) + n_split + n_local,
                      {"grouping_s": t_group, "dp_s": t_dp, "evaluate_s": t_eval, "local_search_s": t_local,
                       "segments": len(segs), "orders": len(variants)})


# --------------------------------------------------------------------------- local search


def _neighbours(plan_: Plan, grouping: Grouping, peers: dict, opts: PlannerOptions,
                work: Sequence[float]) -> Iterator[tuple[Stage, ...]]:
    """Plans one small change away: a layer cut moved by one, a replica dropped or added (the
    fastest unused peer of the stage's group and class), a stage split in two or two adjacent
    stages of one group merged, a one-peer stage dropped (its layers to a neighbour). Then each
    of them with its layers re-split by speed, computed only as the caller gets that far."""
    where = {pid: (gi, ci) for gi, g in enumerate(grouping.groups) for ci, c in enumerate(g.classes) for pid in c}
    stages = list(plan_.stages)
    p = len(stages)
    used = {pid for st in stages for pid in st.peers}

    def st(ids: Sequence[str], lo: int, hi: int) -> Stage:
        return Stage(tuple(ids), (lo, hi), _shares(peers, ids))

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
            yield tuple(_rebalance(x, peers, work))


def _cumulative_work(profile: ModelProfile) -> list[float]:
    work = [0.0]
    for x in profile.layers:
        work.append(work[-1] + x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops)
    return work


def _rebalance(stages: list[Stage], peers: dict, work: Sequence[float]) -> list[Stage]:
    """The same stages with the layer cuts that minimize the slowest stage's compute
    (work / speed; a min-max DP over cut points, O(p L^2), each stage's row at once in numpy;
    the earliest cut wins ties)."""
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


def _local_search(start: Plan, snapshot: Snapshot, profile: ModelProfile, links: LinkTable, opts: PlannerOptions,
                  grouping: Grouping, budget: int) -> tuple[Plan, int]:
    """Steepest descent in the full cost model from ``start`` over ``_neighbours``, at most
    ``budget`` plans evaluated; each neighbour is tried at every micro-batch size and schedule."""
    peers = snapshot.by_id()
    strong = _strongest(opts)
    work = _cumulative_work(profile)
    best, n = start, 0
    seen = {(start.stages, start.micro_batch_size)}
    while n < budget:
        improved = None
        for stages in _neighbours(best, grouping, peers, opts, work):
            if n >= budget:
                break
            for b in opts.batch_sizes():
                if (stages, b) in seen or n >= budget:
                    continue
                seen.add((stages, b))
                n += 1
                cand = Plan(stages, opts.schedules[0], b, opts.global_batch // b, (strong,) * (len(stages) - 1))
                cand = _best_schedule(cand, snapshot, profile, links, opts)
                if cand.step_s < (improved or best).step_s * (1 - 1e-9):
                    improved = cand
        if improved is None:
            break
        best = improved
    return best, n


# ---------------------------------------------------------------------------- exhaustive


def _ordered_partitions(items: Sequence[str]):
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


def _compositions(L: int, p: int):
    for cuts in itertools.combinations(range(1, L), p - 1):
        bounds = (0,) + cuts + (L,)
        yield [(bounds[k], bounds[k + 1]) for k in range(p)]


def _exhaustive(snapshot: Snapshot, profile: ModelProfile, links: LinkTable, opts: PlannerOptions,
                grouping: Grouping) -> tuple[Plan, int]:
    """Every ordered partition of every subset of peers into stages x every layer split x every
    micro-batch size and schedule, in the full cost model; with ``opts.single_class_stages``
    only stages inside one compute class of one network group (the planner's own rule).
    Branch and bound: a split whose busiest stage already computes longer than the best step
    found cannot win (the step is never shorter than any stage's compute)."""
    ids = [p.id for p in snapshot.peers]
    if len(ids) > 7 or profile.num_layers > 10:
        raise ValueError("exhaustive search is for small instances (at most 7 peers and 10 layers)")
    peers = snapshot.by_id()
    L = profile.num_layers
    work = _cumulative_work(profile)
    cls = {pid: (gi, ci) for gi, g in enumerate(grouping.groups) for ci, c in enumerate(g.classes) for pid in c}
    strong = _strongest(opts)
    best: Optional[Plan] = None
    n = 0
    for r in range(1, len(ids) + 1):
        for subset in itertools.combinations(ids, r):
            for parts in _ordered_partitions(subset):
                p = len(parts)
                if p > L:
                    continue
                if opts.single_class_stages and any(not _replicas_ok(part, cls, peers, opts) for part in parts):
                    continue
                speed = [sum(peers[x].flops for x in part) for part in parts]
                for comp in _compositions(L, p):
                    stages = None
                    for b in opts.batch_sizes():
                        m = opts.global_batch // b
                        bound = max(m * b * (work[hi] - work[lo]) / sp for (lo, hi), sp in zip(comp, speed))
                        if best is not None and bound >= best.step_s:
                            continue
                        if stages is None:
                            stages = tuple(Stage(tuple(part), rng, _shares(peers, part)) for part, rng in zip(parts, comp))
                        cand = Plan(stages, opts.schedules[0], b, m, (strong,) * (p - 1))
                        layout = build_layout(cand, snapshot, profile, links, opts.op_overhead_s)
                        cand = _best_schedule(cand, snapshot, profile, links, opts, layout)
                        n += len(opts.schedules)
                        if best is None or cand.step_s < best.step_s:
                            best = cand
    if best is None or not math.isfinite(best.step_s):
        raise ValueError("no feasible plan: the model does not fit in the peers' memory")
    return _relax_compression(best, snapshot, profile, links, opts), n


# ----------------------------------------------------------------------------- baselines


def _best_b(make, snapshot: Snapshot, profile: ModelProfile, links: LinkTable, opts: PlannerOptions,
            name: str) -> Plan:
    best = None
    for b in opts.batch_sizes():
        cand = _evaluate(make(b, opts.global_batch // b), snapshot, profile, links, opts)
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
    opts = options or PlannerOptions()
    links = links or LinkTable(snapshot, group(snapshot, opts.grouping).group_of())
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

    return _best_b(make, snapshot, profile, links, opts, f"{schedule}-uniform")


def greedy_baseline(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
                    links: Optional[LinkTable] = None, schedule: str = "1f1b") -> Plan:
    """Petals-style greedy placement (see the module docstring), 1F1B, no compression."""
    opts = options or PlannerOptions()
    links = links or LinkTable(snapshot, group(snapshot, opts.grouping).group_of())
    L = profile.num_layers
    total_speed = sum(p.flops for p in snapshot.peers)
    state = profile.state_bytes_per_param_byte
    lay = profile.layers
    b_ref = min(opts.batch_sizes())

    def fits(pid: str, lo: int, hi: int, held: int) -> bool:
        need = sum(x.param_bytes for x in lay[lo:hi]) * state + held * b_ref * sum(x.stash_bytes for x in lay[lo:hi])
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
    peers = snapshot.by_id()
    stages = tuple(Stage(tuple(sp[2]), (sp[0], sp[1]), _shares(peers, sp[2])) for sp in spans)

    def make(b: int, m: int) -> Plan:
        return Plan(stages, schedule, b, m, ("none",) * (len(stages) - 1))

    return _best_b(make, snapshot, profile, links, opts, "greedy")


def baselines(snapshot: Snapshot, profile: ModelProfile, options: Optional[PlannerOptions] = None,
              links: Optional[LinkTable] = None) -> dict[str, Plan]:
    opts = options or PlannerOptions()
    links = links or LinkTable(snapshot, group(snapshot, opts.grouping).group_of())
    return {
        "gpipe-uniform": uniform_baseline(snapshot, profile, "gpipe", opts, links),
        "1f1b-uniform": uniform_baseline(snapshot, profile, "1f1b", opts, links),
        "greedy": greedy_baseline(snapshot, profile, opts, links),
    }


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
