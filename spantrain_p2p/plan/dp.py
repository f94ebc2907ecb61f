"""The planner's dynamic programme over layers x segments, on a proxy of the cost model.

The step is about ``max over stages and hops of their busy time`` (compute + all-reduce of a
stage, serialization and round trip of a hop) plus the time one micro-batch takes through
everything. A min-max pass finds the smallest bottleneck ``t*``; passes at thresholds just above
it minimize the latency sum under the bottleneck (the trade Alpa makes). Numpy, O(L S^2) per
pass for L layers and S segments: the number of peers only enters through the grouping.

``Tables``: the proxy's costs for one micro-batch size; ``best_chain``: one DP pass;
``chains``: every pass over every micro-batch size and order of groups, the distinct chains
with their proxy cost.
"""
from __future__ import annotations

import itertools
import math
from typing import Optional

import numpy as np

from ..pipeline.assignment import microbatch_counts
from .candidates import Segment, Units, group_link, group_orders
from .search import INF, Search
from . import levers
from .layout import recomputed_kept
from .types import wire_ratio

Chain = list[tuple[int, int, int]]  # (segment, first layer, last layer exclusive) per stage


class Tables:
    """Proxy costs for one micro-batch size: stage cost/latency per (segment, first, last)
    and hop cost/latency per (cut layer, from segment, to segment)."""

    def __init__(self, ctx: Search, segs: list[Segment], b: int, m: int, n_units: int, intra: dict,
                 inter: dict) -> None:
        grouping, peers, links, profile, opts = ctx.grouping, ctx.peers, ctx.links, ctx.profile, ctx.opts
        L = profile.num_layers
        S = len(segs)
        lay = profile.layers
        fbw = np.concatenate([[0.0], np.cumsum([x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in lay])])
        par = np.concatenate([[0.0], np.cumsum([x.param_bytes for x in lay])])
        sta = np.concatenate([[0.0], np.cumsum([x.stash_bytes for x in lay])])
        FBW = fbw[None, :] - fbw[:, None]  # [i, j] = layers i..j-1
        PAR = par[None, :] - par[:, None]
        STA = sta[None, :] - sta[:, None]
        fix = np.concatenate([[0.0], np.cumsum([x.stash_fixed_bytes for x in lay])])
        HELD = b * STA + (fix[None, :] - fix[:, None])  # one micro-batch's stash (the fixed part: autocast's weight copies)
        valid = np.triu(np.ones((L + 1, L + 1), dtype=bool), 1)
        state = profile.state_bytes_per_param_byte
        # full recomputation (``layout.recomputed_stash``): one activation per layer kept (and the
        # stage's input), the largest layer's stash once, the forward's FLOPs again in the backward
        lever = opts.recompute
        if lever != "none":
            INP = recomputed_kept(profile)  # [i, j]: per sample, layers i..j-1
            stash_l = np.array([x.stash_bytes * b + x.stash_fixed_bytes for x in lay])
            ONCE = np.zeros((L + 1, L + 1))
            for i in range(L):
                ONCE[i, i + 1:] = np.maximum.accumulate(stash_l[i:])
            fw = np.concatenate([[0.0], np.cumsum([x.fwd_flops for x in lay])])
            FW = fw[None, :] - fw[:, None]
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
            mem = np.array([peers[x].memory_bytes for x in sg.peers])
            n = len(sg.peers)
            ar = np.zeros_like(PAR)
            ar_sharded = None
            if n > 1:
                ring = [links.get(sg.peers[i], sg.peers[(i + 1) % n]) for i in range(n)]
                lat = max(x.rtt_s for x in ring) / 2
                bw = min(x.bandwidth for x in ring)
                ar = 2 * (n - 1) * (lat + PAR * profile.grad_wire_bytes_per_param_byte / n / bw)
                if opts.shard != "none" and levers.can_shard(sg, links):
                    # the reduce-scatter alone, then a replica's share of the weights to the others (layout.ring_layers)
                    ar_sharded = ar / 2 + (n - 1) * PAR / n / bw + lat
            # the levers a cell may take, cheapest first (levers.fit): none, sharded optimizer state,
            # recomputation, both; "full" takes its lever everywhere it can
            recs = {"none": (False,), "full": (True,)}.get(lever, (False, True))
            shards = (False,) if ar_sharded is None else {"full": (True,)}.get(opts.shard, (False, True))
            opt = profile.optimizer_bytes_per_param_byte
            feas = np.zeros_like(valid)
            cost = np.full_like(PAR, INF)
            for rec, sh in sorted((r, x) for r in recs for x in shards):
                ok = valid.copy()
                coef = state - opt * (1 - 1 / n) if sh else state
                for h, mm in sorted(set(zip(held.tolist(), mem.tolist()))):
                    ok &= coef * PAR + (h * b * INP + ONCE if rec else h * HELD) <= mm
                new = ok & ~feas
                cost = np.where(new, cb * b * (FBW + FW if rec else FBW) + (ar_sharded if sh else ar), cost)
                feas |= ok
            C[k] = np.where(feas, cost, INF)
            LAT[k] = np.where(valid, lc * b * FBW, INF)
        # hops
        act = np.array([x.activation_bytes_out for x in lay]) * b * wire_ratio(ctx.strongest, profile.wire_dtype_bytes)
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


def best_chain(T: Tables, order_ok: np.ndarray, threshold: Optional[float]) -> Optional[Chain]:
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


def chain_bottleneck(T: Tables, chain: Chain) -> tuple[float, float]:
    worst, lat = 0.0, 0.0
    for k, (s, i, j) in enumerate(chain):
        worst = max(worst, T.C[s, i, j])
        lat += T.LAT[s, i, j]
        if k:
            ps = chain[k - 1][0]
            worst = max(worst, T.HB[i, ps, s])
            lat += T.HL[i, ps, s]
    return worst, lat



def orders_and_flips(ctx: Search, units: Units) -> list[tuple[tuple[int, ...], tuple[bool, ...]]]:
    """Orders of groups, each with its groups' units fastest first or (flip) slowest first."""
    ref = max(x.activation_bytes_out for x in ctx.profile.layers)
    orders = group_orders(ctx, ref)
    G = len(ctx.grouping.groups)
    if G <= 2:
        flips = list(itertools.product((False, True), repeat=G))
    else:
        flips = [(False,) * G, (True,) * G]
    return [(o, f) for o in orders for f in flips]


def chains(ctx: Search, units: Units, segs: list[Segment],
           variants: list[tuple[tuple[int, ...], tuple[bool, ...]]]) -> dict[tuple, float]:
    """``{(micro-batch size, chain): proxy cost}`` of the chains every DP pass finds, for every
    micro-batch size and order of groups (``variants``, from ``orders_and_flips``)."""
    links, grouping, opts, profile = ctx.links, ctx.grouping, ctx.opts, ctx.profile
    G = len(grouping.groups)
    intra, inter = {}, {}
    for ga in range(G):
        est = links.estimates.get((ga, ga))
        intra[ga] = (est.rtt_s, est.bandwidth) if est else (links.fallback.rtt_s, links.fallback.bandwidth)
        for gb in range(G):
            if ga != gb:
                inter[(ga, gb)] = group_link(ctx, ga, gb)
    n_units = sum(len(u) for u in units)
    out: dict[tuple, float] = {}
    for b in opts.batch_sizes():
        m = opts.global_batch // b
        T = Tables(ctx, segs, b, m, min(n_units, profile.num_layers), intra, inter)
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
            top = best_chain(T, order_ok, None)
            if top is None:
                continue
            tstar, lat = chain_bottleneck(T, top)
            key = (b, tuple(top))
            out[key] = min(out.get(key, INF), tstar + lat)
            for frac in opts.thresholds[1:]:
                ch = best_chain(T, order_ok, tstar + lat * frac)
                if ch is None:
                    continue
                w, lt = chain_bottleneck(T, ch)
                key = (b, tuple(ch))
                out[key] = min(out.get(key, INF), w + lt)
    return out
