"""The cost model: a plan's step time, throughput and bottleneck, in closed form.

Per stage ``s`` and peer ``q`` (``n_q`` of the ``m`` micro-batches, per micro-batch
``f_q, b_q, w_q`` seconds = FLOPs / FLOP/s; a stage's micro-batches are shared by speed):

- **compute**: the stage is busy ``max_q n_q (f_q + b_q + w_q)``;
- **hops**: a micro-batch's activation (and later its gradient) goes from its owner on stage
  ``s`` to its owner on ``s + 1`` in RTT/2 + bytes/bandwidth, bytes after the hop's compression;
  a directed link carries its messages one at a time, so it is busy for the sum of their
  bytes/bandwidth;
- **latency**: 1F1B and ZB-H1 let a stage run only so many forwards (its warm-up ``W_s``) before
  it needs a gradient back. For every pair of stages ``s < t`` that is a cycle: forward from
  ``s`` to ``t``, backward from ``t`` to ``s``, then ``s``'s next forward, ``W_s - W_t + 1``
  micro-batches later. A peer of ``s`` owns its share of those (at least one), so it cannot go
  faster than one cycle per owned micro-batch in flight. Over slow links this, not compute,
  sets the pace. A stage of ``k`` replicas waits for fewer forwards ((k - 1)/2 on average,
  capped by its warm-up: a replica only runs its own); and as micro-batches move in index
  order, one whose owner downstream is slower than the window allows stalls the peer that
  sent it (the expected stall over the owners is added to that peer's period);
- **schedule**: steady period ``P`` = the largest of the above per micro-batch. 1F1B: the
  pipeline takes ``m P`` plus one micro-batch's way through every stage and hop and back, less
  the bottleneck's own share (uniform stages: ``(m + p - 1)(T_F + T_B + T_W)``). ZB-H1: less
  the weight-grads it moves into the bubble (uniform: ``m (T_F + T_B + T_W) + (p-1)(T_F + T_B
  - T_W)``), never below the busiest stage's own work. Both never below the fill: a stage's
  first backward waits for its warm-up's forwards, so with ``m`` at or below a stage's warm-up
  (m < p) the stages up to it run like GPipe (``_fill_bound``); a stage whose warm-up covers all
  ``m`` forwards never waits on a latency cycle. GPipe: a forward wave then a backward
  wave, each a flow shop of ``m`` equal jobs;
- **all-reduce**: each stage's replicas average gradients in a ring, 2(n-1) steps of
  ``param_bytes / n`` over the ring's slowest edge, layer by layer: a layer's part goes out once
  the stage's last backward op (W, or fused B+W) has done that layer (at its share of the op's
  FLOPs, from the last layer), so only what the ring has not moved by the op's end adds to the
  step (``layout.RingLayers``); the step ends with the last stage's;
- **step tail**: then each stage's optimizer step, as its slowest peer measured it per byte of
  weights (``profile.step_tail``; an offloaded optimizer: its copies and host step instead; the
  snapshot's copies overlap the next step);
- **memory**: weights + gradients + optimizer state (Adam: 2x) + the stash of the most
  micro-batches the peer's schedule holds at once must fit, else the step time is infinite.

``estimate`` takes these as steps: ``_out_of_memory``, ``_stage_compute``, ``_hop_times``,
``_period_terms`` (with the latency cycles, ``_cycle_terms`` and ``_stall_terms``), ``_pipeline``
(the schedule's fill and drain) and ``_allreduce``.

The discrete-event simulator (``spantrain_p2p.sim``) runs the same plan action by action; the
two agree within 10 % on the shipped scenarios' plans and baselines (``tests/test_sim.py``).
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from ..pipeline.assignment import dealt_shares, stage_warmups
from .layout import Layout, LinkTable, build_layout, held_bound
from .types import ModelProfile, Plan, Snapshot, wire_ratio

INF = math.inf
# A replica of a stage runs the backward of micro-batch y once it has run its *own* forwards up
# to y + lookahead: with k replicas that is on average (k - 1) / 2 micro-batches fewer.
_REPLICA_SLACK = 1.0
# Weight of the expected stall behind micro-batches whose owner downstream is slow.
_HETERO = 1.0


@dataclass(frozen=True)
class Estimate:
    step_s: float
    samples_per_s: float
    bottleneck: str
    parts: dict = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.step_s)


def _infeasible(reason: str) -> Estimate:
    return Estimate(INF, 0.0, reason, {})


def estimate(plan: Plan, snapshot: Snapshot, profile: ModelProfile, links: Optional[LinkTable] = None,
             op_overhead_s: float = 0.0, layout: Optional[Layout] = None, comm_scale: float = 1.0) -> Estimate:
    """The cost model's step time for ``plan`` (``inf`` with the reason if it does not fit).

    ``layout``: ``build_layout`` of a plan with the same stages and micro-batching, to evaluate
    other schedules and compressions of it cheaply. ``comm_scale``: every hop's latency and
    transfer time multiplied by this (a what-if for slower links; the planner's safety margin).
    """
    if layout is None or not layout.matches(plan):
        links = links or LinkTable(snapshot)
        layout = build_layout(plan, snapshot, profile, links, op_overhead_s)
    m = plan.num_micro_batches
    sched = plan.schedule
    warm = stage_warmups(sched, [dealt_shares(list(st.share_of().values()), m) for st in plan.stages], m)
    short = _out_of_memory(layout, sched, warm, m)
    if short:
        return _infeasible(f"memory:{short}")
    c = _stage_compute(layout, m)
    h = _hop_times(layout, plan.compression, comm_scale)
    cands = _period_terms(layout, sched, warm, c, h, m)
    period, why, lam = max(cands)
    top_terms = sorted(cands, reverse=True)[:6]
    pipe, period, ends = _pipeline(sched, c, h, period, lam, m, warm, layout)
    total, ar_stage, ars = _allreduce(layout, sched, pipe, ends)
    steady = m * period
    bubble = pipe - steady
    tail = total - pipe
    parts = {"period_s": period, "steady_s": steady, "bubble_s": bubble, "allreduce_tail_s": tail,
             "pipeline_s": pipe, "allreduce_s": ars, "top_terms": top_terms}
    if ar_stage >= 0 and (tail >= max(steady, bubble) or tail > 0.25 * total):
        offload = layout.stages[ar_stage].step_tail_s
        bottleneck = f"{'offload' if offload > 0.5 * ars[ar_stage] else 'allreduce'}:stage {ar_stage}"
    elif bubble > steady:
        bottleneck = "bubble"
    else:
        bottleneck = why
    return Estimate(total, plan.global_batch / total if total > 0 else 0.0, bottleneck, parts)


def _out_of_memory(layout: Layout, sched: str, warm: list[int], m: int) -> str:
    """The first peer whose weights, gradients, optimizer state and most stashes held at once do
    not fit its memory ("" if every peer's do): a hard limit."""
    short = short_of_memory(layout, sched, warm, m)
    return next(iter(short.values())) if short else ""


def short_of_memory(layout: Layout, sched: str, warm: list[int], m: int) -> dict[int, str]:
    """Stage -> its first peer whose memory does not hold the stage's state and most stashes held
    at once (``peak_memory``), for every stage that has one."""
    out = {}
    for s, sw in enumerate(layout.stages):
        for _, pw in sw.kinds:
            if peak_memory(sw, sched, s, warm[s], len(pw.mbs), m) > pw.memory_bytes:
                out[s] = pw.id
                break
    return out


def peak_memory(sw, sched: str, s: int, warm: int, own: int, m: int) -> float:
    """The bytes a peer of stage ``s`` that owns ``own`` micro-batches holds at most: weights,
    gradients, optimizer state, its most stashes at once, and what recomputation holds once."""
    return sw.state_bytes + held_bound(sched, s, warm, own, m) * sw.stash_bytes + sw.stash_once


@dataclass(frozen=True)
class _StageCompute:
    """Per stage: mean F, B, W seconds per micro-batch over its peers (``fbar``, ``bbar``,
    ``wbar``) and its busiest peer's seconds in all (``busy``), in forwards (``busy_f``) and in
    backwards (``busy_bw``)."""

    fbar: list[float]
    bbar: list[float]
    wbar: list[float]
    busy: list[float]
    busy_f: list[float]
    busy_bw: list[float]


def _stage_compute(layout: Layout, m: int) -> _StageCompute:
    fbar, bbar, wbar, busy, busy_f, busy_bw = [], [], [], [], [], []
    for sw in layout.stages:
        f = b = w = bz = bzf = bzb = 0.0
        for c, pw in sw.kinds:
            n = len(pw.mbs)
            f += c * n * pw.f
            b += c * n * pw.b
            w += c * n * pw.w
            bz = max(bz, n * (pw.f + pw.b + pw.w))
            bzf = max(bzf, n * pw.f)
            bzb = max(bzb, n * (pw.b + pw.w))
        fbar.append(f / m)
        bbar.append(b / m)
        wbar.append(w / m)
        busy.append(bz)
        busy_f.append(bzf)
        busy_bw.append(bzb)
    return _StageCompute(fbar, bbar, wbar, busy, busy_f, busy_bw)


@dataclass(frozen=True)
class _HopTimes:
    """Per hop: one message's latency each way (``lat_f``, ``lat_b``), the busiest directed link's
    busy seconds each way (``busy_f``, ``busy_b``) and that link's name (``worst``)."""

    lat_f: list[float]
    lat_b: list[float]
    busy_f: list[float]
    busy_b: list[float]
    worst: list[str]


def _hop_times(layout: Layout, compression: Sequence[str], comm_scale: float) -> _HopTimes:
    lat_f, lat_b, hop_busy_f, hop_busy_b, hop_worst = [], [], [], [], []
    for h, hl in enumerate(layout.hops):
        nbytes = layout.stages[h].act_bytes * wire_ratio(compression[h], layout.wire_dtype_bytes)
        lat_f.append(comm_scale * (hl.half_rtt_f + nbytes * hl.inv_bw_f))
        lat_b.append(comm_scale * (hl.half_rtt_b + nbytes * hl.inv_bw_b))
        hop_busy_f.append(comm_scale * nbytes * hl.busy_coef_f)
        hop_busy_b.append(comm_scale * nbytes * hl.busy_coef_b)
        hop_worst.append(hl.worst_f if hl.busy_coef_f >= hl.busy_coef_b else hl.worst_b)
    return _HopTimes(lat_f, lat_b, hop_busy_f, hop_busy_b, hop_worst)


def _period_terms(layout: Layout, sched: str, warm: list[int], c: _StageCompute, h: _HopTimes,
                  m: int) -> list[tuple[float, str, float]]:
    """Candidates for the steady period, the slowest resource per micro-batch: ``(period, name,
    latency of one micro-batch through that element)``. A stage of k peers works on k
    micro-batches at once, so its own latency is k periods, not one."""
    p = len(layout.stages)
    cands: list[tuple[float, str, float]] = []
    for s in range(p):
        per = c.busy[s] / m
        cands.append((per, f"compute:stage {s}", max(per, c.fbar[s] + c.bbar[s] + c.wbar[s])))
    for k in range(p - 1):
        per = max(h.busy_f[k], h.busy_b[k]) / m
        cands.append((per, f"link:{h.worst[k]}", per))
    if sched != "gpipe":
        cycles = _cycle_terms(layout, sched != "zb-h1", warm, c, h, m, cands)
        # Micro-batches move in index order: one whose owner downstream is slower than average
        # holds up the window until it is back, and a peer that is busy anyway cannot make that up.
        if _HETERO and cycles:
            _stall_terms(layout, sched != "zb-h1", cycles, m, cands)
    return cands


def _cycle_terms(layout: Layout, fused: bool, warm: list[int], c: _StageCompute, h: _HopTimes, m: int,
                 cands: list[tuple[float, str, float]]) -> list[tuple[int, int, float, float]]:
    """In-flight limits, one cycle per pair of stages s < t (see the module docstring): each
    stage's worst peer's period per cycle, added to ``cands``. Returns the cycles as (stage s,
    stage t, tokens, downstream latency excluding stage t's owner)."""
    p = len(layout.stages)
    fbar, bbar, wbar, lat_f, lat_b = c.fbar, c.bbar, c.wbar, h.lat_f, h.lat_b
    inner = [fbar[u] + bbar[u] + (wbar[u] if fused else 0.0) for u in range(p)]
    cycles = []
    for s in range(p - 1):
        if (warm[s] if fused else warm[s] - 1) >= m - 1:
            continue  # its warm-up covers all m forwards: none of them waits for a gradient
        sw = layout.stages[s]
        down = 0.0
        rows = []  # (t, tokens, down, hops_t) of this stage's cycles
        for t in range(s + 1, p):
            hops_t = lat_f[t - 1] + lat_b[t - 1]
            ahead = warm[t] if fused else warm[t] - 1  # forwards stage t runs past y before y's backward
            slack = min(ahead, _REPLICA_SLACK * (len(layout.stages[t].peers) - 1) / 2)
            tokens = min(m, warm[s] - warm[t] + 1 + slack)
            if tokens > 0:
                rows.append((t, tokens, down, hops_t))
                cycles.append((s, t, tokens, down + hops_t))
            down += inner[t] + hops_t
        if not rows:
            continue
        # per cycle, the worst of the stage's peers (one row per cycle, one column per kind of peer)
        n = sw.busy_n
        worst = [0.0] * len(rows)
        if len(n):
            col = np.array([r[1:] + (inner[r[0]],) for r in rows])  # tokens, down, hops_t, inner[t]
            tok, dn, hp, inn = (col[:, k:k + 1] for k in range(4))
            own = 1.0 + (tok - 1.0) * n / m  # its own micro-batches in a window from one of them
            per = n * (sw.busy_fbw + dn + hp + inn) / own / m
            worst = [max(0.0, float(x)) for x in per.max(axis=1)]
        for (t, *_), w in zip(rows, worst):
            cands.append((w, f"latency:stage {s}->{t}", w))
    return cycles


def _stall_terms(layout: Layout, fused: bool, cycles: list[tuple[int, int, float, float]], m: int,
                 cands: list[tuple[float, str, float]]) -> None:
    """Each cycle's period with the expected stall behind micro-batches whose owner on stage t is
    slower than the period so far allows, added to ``cands``."""
    p_star = max(c[0] for c in cands)
    by_t: dict[int, list] = {}
    for s, t, tokens, down in cycles:
        by_t.setdefault(t, []).append((s, tokens, down))
    for t, rows in by_t.items():
        kinds = [(k, rw) for k, rw in layout.stages[t].kinds if rw.mbs]
        if sum(k for k, _ in kinds) <= 1:
            continue
        # stage t's owners' per-micro-batch times, sorted, with suffix sums
        owners = sorted((rw.f + rw.b + (rw.w if fused else 0.0), k * len(rw.mbs) / m) for k, rw in kinds)
        xs = [x for x, _ in owners]
        suf_w, suf_wx = [0.0] * (len(owners) + 1), [0.0] * (len(owners) + 1)
        for i in range(len(owners) - 1, -1, -1):
            suf_w[i] = suf_w[i + 1] + owners[i][1]
            suf_wx[i] = suf_wx[i + 1] + owners[i][1] * owners[i][0]
        suf_w_a, suf_wx_a = np.array(suf_w), np.array(suf_wx)
        # every upstream stage's peers at once: one segment of columns per stage s
        segs = [(s, tokens, down, layout.stages[s]) for s, tokens, down in rows]
        for s, _, _, sw in segs:
            if not len(sw.busy_n):
                cands.append((0.0, f"latency:stage {s}->{t}", 0.0))
        segs = [x for x in segs if len(x[3].busy_n)]
        if not segs:
            continue
        n = np.concatenate([x[3].busy_n for x in segs])
        fbw = np.concatenate([x[3].busy_fbw for x in segs])
        tok = np.concatenate([np.full(len(x[3].busy_n), float(x[1])) for x in segs])
        dn = np.concatenate([np.full(len(x[3].busy_n), float(x[2])) for x in segs])
        own = 1.0 + (tok - 1.0) * n / m
        budget = own * p_star * m / n  # time its window allows per own micro-batch
        base = fbw + dn
        i = np.searchsorted(xs, budget - base, side="right")  # owners slower than that stall it
        stall = ((base - budget) * suf_w_a[i] + suf_wx_a[i]) / own
        val = p_star + _HETERO * n / m * stall
        starts = np.cumsum([0] + [len(x[3].busy_n) for x in segs[:-1]])
        for (s, *_), w in zip(segs, np.maximum.reduceat(val, starts)):
            w = max(0.0, float(w))
            cands.append((w, f"latency:stage {s}->{t}", w))


def _pipeline(sched: str, c: _StageCompute, h: _HopTimes, period: float, lam: float,
              m: int, warm: list[int], layout: Layout) -> tuple[float, float, list[float]]:
    """The pipeline's length with its fill and drain (the bubbles), the steady period (GPipe's is
    its two waves'), and when each stage's last compute ends."""
    fbar, bbar, wbar, busy = c.fbar, c.bbar, c.wbar, c.busy
    lat_f, lat_b = h.lat_f, h.lat_b
    p = len(fbar)
    fused = sched != "zb-h1"
    path = sum(fbar) + sum(bbar) + sum(lat_f) + sum(lat_b)
    ends: list[float] = []
    if sched == "gpipe":
        # a forward wave, then a backward wave, each a flow shop of m equal jobs through the
        # stages and hops: done when the last job leaves = every element's latency once plus
        # (m - 1) times the slowest element's period
        fw_lat = sum(fbar) + sum(lat_f)
        fw_per = max([x / m for x in c.busy_f] + [x / m for x in h.busy_f])
        t_fwd = fw_lat + (m - 1) * fw_per
        lat_acc, per_max = 0.0, 0.0
        ends = [0.0] * p
        for s in range(p - 1, -1, -1):
            lat_acc += bbar[s] + wbar[s]
            per_max = max(per_max, c.busy_bw[s] / m)
            if s < p - 1:
                lat_acc += lat_b[s]
                per_max = max(per_max, h.busy_b[s] / m)
            ends[s] = t_fwd + lat_acc + (m - 1) * per_max
        pipe = max(ends)
        if max(busy) > pipe:
            pipe = max(busy)
        period = max(period, fw_per + per_max)
    elif fused:
        pipe = m * period - lam + path + sum(wbar)
    else:
        # ZB-H1: weight-grads fill the bubble; never below the busiest stage's own work
        pipe = m * period - lam + path + wbar[0] - sum(wbar[1:])
        lower = max(sum(fbar[:s]) + sum(lat_f[:s]) + busy[s] for s in range(p))
        pipe = max(pipe, lower)
    if sched != "gpipe":
        pipe = max(pipe, _fill_bound(fused, c, h, m, warm, layout))
    if not ends:
        back = 0.0
        for s in range(p):
            if fused:
                ends.append(pipe - back)
            else:
                owed = min(m, s + 1) * wbar[s] if s > 0 else wbar[0]
                ends.append(min(pipe, pipe - wbar[0] - back + owed))
            back += bbar[s] + (wbar[s] if fused else 0.0) + (lat_b[s] if s < p - 1 else 0.0)
    return pipe, period, ends


def _fill_bound(fused: bool, c: _StageCompute, h: _HopTimes, m: int, warm: list[int], layout: Layout) -> float:
    """What the steady-state formula misses when warm-ups are long against ``m`` (a lower bound
    for 1F1B and ZB-H1). Micro-batch 0's owner on stage ``t`` runs its backward only after its own
    forwards up to ``j = min(ahead, m - 1)`` (``ahead``: as in ``_cycle_terms``), and forward ``j``
    reaches stage ``t`` no faster than the forward flow through stages ``0..t`` allows. From there
    that owner still has its other backwards, the forwards it has left and (ZB-H1) the
    weight-grads it owes before its last backward (W(y) follows B(y + t)); and if it is stage
    ``t``'s only peer, every peer and hop on the way back has all but one of its backwards left.
    Then the way back to stage 0 (its fastest peers), and (ZB-H1) the weight-grads a stage on the
    way still owes after its last backward. With ``ahead >= m - 1`` (``m`` below the
    pipeline's depth) stages ``0..t`` run like GPipe: all forwards, then all backwards."""
    best = f_lat = back = f_per = b_tail = 0.0
    drain = -INF  # ZB-H1: max over stages u of (weight-grads u owes after its last backward - back to u)
    for t, sw in enumerate(layout.stages):
        pw = sw.peers[sw.owner[0]]  # micro-batch 0's owner
        if t > 0:
            f_lat += h.lat_f[t - 1]
            back += h.lat_b[t - 1]
            f_per = max(f_per, h.busy_f[t - 1] / m)
            # the hop's busiest link carries at least as many of the m as its quietest pair of owners
            b_tail = max(b_tail, h.busy_b[t - 1] * (1.0 - 1.0 / _fewest(layout.stages[t - 1].owner, sw.owner)))
        f_lat += pw.f
        f_per = max(f_per, c.busy_f[t] / m)
        mine = pw.mbs
        top = min(warm[t] if fused else warm[t] - 1, m - 1)
        done = bisect_right(mine, top)  # its forwards before its first backward, the last j
        j = mine[done - 1]
        bw = pw.b + (pw.w if fused else 0.0)
        own = (len(mine) - 1) * bw + (len(mine) - done) * pw.f
        if not fused:
            owed = bisect_left(mine, mine[-1] - t)
            own += owed * pw.w
            drain = max(drain, min((len(q.mbs) - bisect_left(q.mbs, q.mbs[-1] - t)) * q.w
                                   for _, q in sw.kinds if q.mbs) - back)
            here = (len(mine) - owed) * pw.w
        busiest = max((len(q.mbs) - 1) * (q.b + (q.w if fused else 0.0)) for _, q in sw.kinds if q.mbs)
        tail = max(b_tail, busiest, own) if len(mine) == m else own
        end = back if fused else max(back + drain, here)
        best = max(best, f_lat + j * f_per + bw + tail + end)
        back += min(q.b + (q.w if fused else 0.0) for _, q in sw.kinds if q.mbs)
        b_tail = max(b_tail, busiest)
    return best


@lru_cache(maxsize=4096)
def _fewest(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The fewest micro-batches any pair of owners (a[mb], b[mb]) of two adjacent stages shares."""
    return min(Counter(zip(a, b)).values())


def _allreduce(layout: Layout, sched: str, pipe: float, ends: list[float]) -> tuple[float, int, list[float]]:
    """Each stage's all-reduce, layer by layer during its last backward op and the rest after it:
    the step's end, the stage whose all-reduce ends it (-1: none) and each stage's tail."""
    fused = sched != "zb-h1"
    total = pipe
    ar_stage = -1
    ars = []
    for s in range(len(layout.stages)):
        ring = layout.allreduce_layers[s]
        if ring is None:
            ars.append(0.0)
        else:
            last_op = max((pw.w + (pw.b if fused else 0.0) for _, pw in layout.stages[s].kinds if pw.mbs), default=0.0)
            ars.append(ring.tail_s(last_op, fused))
        ars[s] += layout.stages[s].step_tail_s  # the optimizer's step (an offloaded one's copies and host step)
        if ends[s] + ars[s] > total:
            total, ar_stage = ends[s] + ars[s], s
    return total, ar_stage, ars
