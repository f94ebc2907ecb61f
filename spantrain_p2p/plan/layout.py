"""What a plan means peer by peer, shared by the cost model and the simulator.

Which peer of a stage runs which micro-batch, and each peer's action list, are the runtime's
own functions (``pipeline.assignment``): the cost model and the simulator call them too.

- ``held_bound``: most micro-batches a peer keeps activations for, under its stage's warm-up.
- ``LinkTable``: a link for every pair, estimating unknown ones from the grouping.
- ``build_layout``: per peer compute times, per hop link summaries, per stage all-reduce.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..pipeline.assignment import microbatch_owners
from ..pipeline.schedule import backward_done_fractions
from .types import Link, ModelProfile, Plan, Snapshot, Stage


def held_bound(schedule_name: str, stage: int, warmup: int, n: int, m: int) -> int:
    """Most micro-batches a peer with ``n`` of ``m`` keeps activations for (an upper bound)."""
    if n == 0:
        return 0
    if schedule_name == "gpipe":
        return n
    window = warmup + 1 if schedule_name == "1f1b" else warmup + stage + 1
    return min(n, int(math.ceil(window * n / m)) + 1)


class LinkTable:
    """Every pair's link: measured where known, else estimated from links between the same groups.

    Estimates: the median of the known links between the two peers' network groups (or inside
    the group); failing that, the slowest known link. With no grouping, the slowest known link.
    """

    def __init__(self, snapshot: Snapshot, group_of: Optional[dict[str, int]] = None) -> None:
        self.network = snapshot.network
        self.group_of = group_of or {}
        by_pair: dict[tuple[int, int], list[Link]] = {}
        worst_bw, worst_rtt = math.inf, 0.0
        any_known = False
        for a, b, link in self.network.known():
            any_known = True
            worst_bw, worst_rtt = min(worst_bw, link.bandwidth), max(worst_rtt, link.rtt_s)
            ga, gb = self.group_of.get(a), self.group_of.get(b)
            if ga is not None and gb is not None:
                by_pair.setdefault((min(ga, gb), max(ga, gb)), []).append(link)
        self.fallback = Link(worst_rtt, worst_bw) if any_known else Link(0.1, 1.25e6)
        self.estimates = {
            k: Link(statistics.median(x.rtt_s for x in v), statistics.median(x.bandwidth for x in v),
                    statistics.median(x.jitter_s for x in v))
            for k, v in by_pair.items()
        }
        self._cache: dict[tuple[str, str], Link] = {}
        self.layout_cache: dict = {}  # build_layout's parts, shared by the plans evaluated against this table

    def get(self, a: str, b: str) -> Link:
        got = self.network.link(a, b)
        if got is not None:
            return got
        hit = self._cache.get((a, b))
        if hit is None:
            ga, gb = self.group_of.get(a), self.group_of.get(b)
            hit = self.fallback
            if ga is not None and gb is not None:
                hit = self.estimates.get((min(ga, gb), max(ga, gb)), self.fallback)
            self._cache[(a, b)] = hit
        return hit

    def estimated(self, a: str, b: str) -> bool:
        return self.network.link(a, b) is None


@dataclass(frozen=True)
class PeerWork:
    """One peer's part of a stage: its micro-batches and per micro-batch compute seconds."""

    id: str
    mbs: tuple[int, ...]
    f: float
    b: float
    w: float
    memory_bytes: float


@dataclass(frozen=True)
class StageWork:
    peers: tuple[PeerWork, ...]
    owner: tuple[int, ...]  # micro-batch -> index into peers
    param_bytes: float
    state_bytes: float  # weights + gradients + optimizer state
    stash_bytes: float  # activations kept per micro-batch
    act_bytes: float  # uncompressed bytes per micro-batch sent to the next stage (0 for the last)
    # peers that differ in nothing the cost model reads, counted once: (count, first of them)
    kinds: tuple[tuple[int, PeerWork], ...] = ()
    # the kinds that own micro-batches, as arrays: micro-batches each, and F + B + W seconds of one
    busy_n: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    busy_fbw: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    # held once whatever the micro-batches in flight: under full recomputation, the one layer whose
    # forward is being recomputed inside a backward keeps its whole stash meanwhile
    stash_once: float = 0.0
    # after its last backward and all-reduce (slowest peer): an offloaded optimizer's copies and host
    # step, else the optimizer's step on the device (``PeerInfo.step_s_per_param_byte``)
    step_tail_s: float = 0.0


@dataclass(frozen=True)
class HopLinks:
    """The links a hop uses, summarized so that any message size costs O(1).

    Per direction: ``busy_coef`` = max over directed links of (messages / bandwidth), so the
    busiest link is busy ``bytes * busy_coef``; one message takes on average
    ``half_rtt + bytes * inv_bw`` (means over micro-batches).
    """

    busy_coef_f: float
    busy_coef_b: float
    worst_f: str
    worst_b: str
    half_rtt_f: float
    half_rtt_b: float
    inv_bw_f: float
    inv_bw_b: float


@dataclass(frozen=True)
class Layout:
    """What a plan's stages, micro-batch size and count fix, whatever its schedule and compression."""

    stages_key: tuple
    micro_batch_size: int
    num_micro_batches: int
    stages: tuple[StageWork, ...]
    hops: tuple[HopLinks, ...]
    allreduce_layers: tuple[Optional["RingLayers"], ...]  # per stage: its ring all-reduce by layer (None: one peer)
    wire_dtype_bytes: int = 4  # the profile's: what a hop's codec saves against (types.wire_ratio)
    split_bw: bool = False  # priced for a schedule with B and W apart (where a stage recomputes, it matters)

    def matches(self, plan: Plan) -> bool:
        return (self.stages_key == plan.stages and self.micro_batch_size == plan.micro_batch_size
                and self.num_micro_batches == plan.num_micro_batches
                and (self.split_bw == splits_bw(plan.schedule) or not recomputes(plan)))


def splits_bw(schedule: str) -> bool:
    """Whether ``schedule`` runs a micro-batch's B and W as two backward passes (zero bubble): a
    recomputing stage then runs its forward again in each (``pipeline.memory``)."""
    return schedule == "zb-h1"


def recomputes(plan: Plan) -> bool:
    return any(st.recompute != "none" for st in plan.stages)


def build_layout(plan: Plan, snapshot: Snapshot, profile: ModelProfile, links: LinkTable,
                 op_overhead_s: float = 0.0) -> Layout:
    """Per peer work, per hop links and per stage all-reduce of ``plan`` (ValueError if it names
    peers the snapshot lacks or does not cover the model's layers)."""
    if plan.num_layers != profile.num_layers:
        raise ValueError(f"plan covers {plan.num_layers} layers, the model has {profile.num_layers}")
    peers = snapshot.by_id()
    b, m, p = plan.micro_batch_size, plan.num_micro_batches, plan.num_stages
    # parts shared by plans that differ elsewhere (the planner evaluates many neighbours)
    cache = links.layout_cache.setdefault((id(profile), op_overhead_s), {})
    out = []
    split = splits_bw(plan.schedule)
    for s, st in enumerate(plan.stages):
        key = ("stage", st, b, m, s == p - 1, split and st.recompute != "none")
        sw = cache.get(key)
        if sw is None:
            sw = cache[key] = _stage_work(st, b, m, s == p - 1, peers, profile, op_overhead_s, split)
        out.append(sw)
    hops = []
    for h in range(p - 1):
        key = ("hop", plan.stages[h].peers, plan.stages[h].shares, plan.stages[h + 1].peers,
               plan.stages[h + 1].shares, m)
        hl = cache.get(key)
        if hl is None:
            hl = cache[key] = _hop_links(out[h], out[h + 1], m, links)
        hops.append(hl)
    ars = []
    for st, sw in zip(plan.stages, out):
        key = ("ar", st.peers, st.layers, st.shard)
        ar = cache.get(key)
        if ar is None:
            lay = profile.layers[st.layers[0]:st.layers[1]]
            share = sharded_state_share(st) if st.shard else 0.0
            ar = cache[key] = ring_layers(st.peers, lay, profile.grad_wire_bytes_per_param_byte, links, share)
        ars.append(ar)
    return Layout(plan.stages, b, m, tuple(out), tuple(hops), tuple(ars), profile.wire_dtype_bytes, split)


def held_activations(profile: ModelProfile) -> tuple[list[float], list[float]]:
    """Per layer, per sample: its input and its output as a stage holds them (what full
    recomputation keeps): the input as measured (``input_bytes``: under autocast the fp32 residual
    stream, twice a bf16 wire's bytes; the first layer's, its token ids), else the previous layer's
    wire size (the first layer's: nothing); the output is the next layer's input (the last one's,
    its own ``activation_bytes_out``). A stage's own input arrives from the wire instead."""
    layers = profile.layers
    held_in = [x.input_bytes or (layers[i - 1].activation_bytes_out if i else 0.0) for i, x in enumerate(layers)]
    return held_in, held_in[1:] + [layers[-1].activation_bytes_out]


def recomputed_kept(profile: ModelProfile) -> np.ndarray:
    """``[i, j]``: what layers ``i..j-1`` keep per sample under full recomputation, for every cut
    at once (``recomputed_stash``'s first figure over ``b``; the planner's fast search, ``dp``)."""
    held_in, held_out = held_activations(profile)
    first = np.array([held_in[0]] + [x.activation_bytes_out for x in profile.layers])  # [i]: off the wire
    cum_in = np.concatenate([[0.0], np.cumsum(held_in)])  # [k]: inputs of layers 0..k-1
    through_first = np.concatenate([cum_in[1:], [cum_in[-1]]])  # [i]: inputs of layers 0..i
    last_out = np.array([0.0] + held_out)  # [j]: layer j-1's output
    return first[:, None] + (cum_in[None, :] - through_first[:, None]) + last_out[None, :]


def recomputed_stash(profile: ModelProfile, lo: int, hi: int, b: int) -> tuple[float, float]:
    """For micro-batches of ``b`` samples, what layers ``[lo, hi)`` keep of a forward under full
    recomputation (each layer's input, and the last one's output: one activation per layer, as the
    stage holds it, ``held_activations``) and what the layer being recomputed holds once (the
    largest layer stash, its fixed part included)."""
    layers = profile.layers
    held_in, held_out = held_activations(profile)
    first = layers[lo - 1].activation_bytes_out if lo > 0 else held_in[0]  # the stage's input: off the wire
    kept = first + sum(held_in[lo + 1:hi]) + held_out[hi - 1]
    return kept * b, max(x.stash_bytes * b + x.stash_fixed_bytes for x in layers[lo:hi])


def shard_owners(sizes: list[float], peers: list[str]) -> list[str]:
    """The replica that owns each parameter's optimizer state in a sharded stage (``sizes``: the
    stage's parameters' bytes, in order): largest first, to the replica that owns the fewest bytes
    so far (the first of the stage's order on a tie). Every replica derives the same owners from
    the map and the model."""
    load = {p: 0.0 for p in peers}
    out = [""] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(peers, key=lambda q: (load[q], peers.index(q)))
        out[i] = p
        load[p] += sizes[i]
    return out


def sharded_state_share(st: Stage) -> float:
    """The fraction of the stage's optimizer state one replica holds: 1/replicas sharded (its
    parameters are dealt largest first, ``shard_owners``: even to within the smaller ones, which the
    profile's layers do not tell apart), else 1."""
    return 1.0 / len(st.peers) if st.shard and len(st.peers) > 1 else 1.0


def _stage_work(st: Stage, b: int, m: int, last: bool, peers: dict, profile: ModelProfile,
                op_overhead_s: float, split: bool = False) -> StageWork:
    lo, hi = st.layers
    layers = profile.layers[lo:hi]
    fw = sum(x.fwd_flops for x in layers) * b
    bi = sum(x.bwd_input_flops for x in layers) * b
    bw = sum(x.bwd_weight_flops for x in layers) * b
    params = sum(x.param_bytes for x in layers)
    # what the layers keep, and the stage's output (kept for its backward, not saved by a layer of its own)
    stash = (sum(x.stash_bytes for x in layers) + layers[-1].activation_bytes_out) * b + \
        sum(x.stash_fixed_bytes for x in layers)
    once = 0.0
    if st.recompute == "full":  # the forward again in each backward pass: B (or fused BW), and W when apart
        stash, once = recomputed_stash(profile, lo, hi, b)
        bi += fw
        if split:
            bw += fw
    owner = microbatch_owners(st.shares, m)
    mbs: list[list[int]] = [[] for _ in st.peers]
    for j, i in enumerate(owner):
        mbs[i].append(j)
    works = []
    for i, pid in enumerate(st.peers):
        info = peers.get(pid)
        if info is None:
            raise ValueError(f"plan names peer {pid!r}, which the snapshot does not have")
        works.append(PeerWork(pid, tuple(mbs[i]), fw / info.flops + op_overhead_s,
                              bi / info.flops + op_overhead_s, bw / info.flops + op_overhead_s, info.memory_bytes))
    act = 0.0 if last else profile.layers[hi - 1].activation_bytes_out * b
    kinds: dict[tuple, list] = {}
    for pw in works:
        k = kinds.setdefault((len(pw.mbs), pw.f, pw.b, pw.w, pw.memory_bytes), [0, pw])
        k[0] += 1
    owning = [pw for _, pw in kinds.values() if pw.mbs]
    if profile.host_copy_bytes_per_param_byte or profile.host_step_s_per_param_byte:  # an offloaded optimizer
        # its host step as the peer measured it on its own CPU, else the optimizer's price
        tail = max(params * (profile.host_copy_bytes_per_param_byte / peers[pw.id].host_bytes_per_s
                             + (peers[pw.id].host_step_s_per_param_byte or profile.host_step_s_per_param_byte))
                   for pw in works)
    else:  # the optimizer's step on the device, as each peer measured it
        tail = max(params * peers[pw.id].step_s_per_param_byte for pw in works)
    # sharded (ZeRO-1): a replica keeps the optimizer state of the layers it owns only
    opt_share = sharded_state_share(st)
    state = params * (profile.state_bytes_per_param_byte - profile.optimizer_bytes_per_param_byte * (1 - opt_share))
    if opt_share < 1.0:
        tail *= opt_share  # a sharded optimizer steps (and copies) its own share only
    return StageWork(tuple(works), tuple(owner), params, state, stash, act,
                     tuple((c, pw) for c, pw in kinds.values()),
                     np.array([float(len(pw.mbs)) for pw in owning]), np.array([pw.f + pw.b + pw.w for pw in owning]),
                     once, tail)


def _hop_links(a: StageWork, c: StageWork, m: int, links: LinkTable) -> HopLinks:
    coef_f = coef_b = 0.0
    worst_f = worst_b = ""
    hr_f = hr_b = ib_f = ib_b = 0.0
    for (i, k), cnt in Counter(zip(a.owner, c.owner)).items():
        src, dst = a.peers[i].id, c.peers[k].id
        lf, lb = links.get(src, dst), links.get(dst, src)
        if cnt / lf.bandwidth > coef_f:
            coef_f, worst_f = cnt / lf.bandwidth, f"{src}->{dst}"
        if cnt / lb.bandwidth > coef_b:
            coef_b, worst_b = cnt / lb.bandwidth, f"{dst}->{src}"
        hr_f += cnt * lf.rtt_s / 2
        hr_b += cnt * lb.rtt_s / 2
        ib_f += cnt / lf.bandwidth
        ib_b += cnt / lb.bandwidth
    return HopLinks(coef_f, coef_b, worst_f, worst_b, hr_f / m, hr_b / m, ib_f / m, ib_b / m)


@dataclass(frozen=True)
class RingLayers:
    """A stage's ring all-reduce split by layer, in the order the backward finishes them (last
    layer first): each layer's gradients go out as soon as they are final (``train.trainer``'s
    ``GradientSum``). Per layer: the fraction of the stage's W (``done_w``) or fused B+W
    (``done_bw``) op done by then, and the seconds its bytes hold the ring's slowest edge
    (``piece_s``: 2(n-1) chunks of bytes / n); ``latency_s``: the ring's 2(n-1) one-way delays."""

    done_w: tuple[float, ...]
    done_bw: tuple[float, ...]
    piece_s: tuple[float, ...]
    latency_s: float
    # sharded optimizer state: the pieces are the gradients' reduce-scatter ((n-1) chunks), and after
    # the step the owners send their new weights to the others, unhidden (the all-gather)
    gather_s: float = 0.0

    def tail_s(self, backward_s: float, fused: bool) -> float:
        """Seconds the all-reduce (and a sharded stage's all-gather) goes on after the stage's last
        backward op (of ``backward_s``)."""
        return overlapped_tail(self.done_bw if fused else self.done_w, self.piece_s, self.latency_s,
                               backward_s) + self.gather_s


def overlapped_tail(done: Sequence[float], piece_s: Sequence[float], latency_s: float, backward_s: float,
                    ready_s: Optional[Sequence[float]] = None) -> float:
    """When pieces become ready at ``backward_s * done[i]`` (or at ``ready_s[i]``) and go over one
    link one after another, each taking ``piece_s[i]``, the last arriving ``latency_s`` later:
    how long after ``backward_s`` that is (never below 0)."""
    free = 0.0
    for i, d in enumerate(piece_s):
        r = backward_s * done[i] if ready_s is None else ready_s[i]
        free = (free if free > r else r) + d
    return max(0.0, free + latency_s - backward_s)


def ring_layers(peers: Sequence[str], layers: Sequence, wire_per_param_byte: float,
                links: LinkTable, shard_share: float = 0.0) -> Optional[RingLayers]:
    """``RingLayers`` of a stage of ``peers`` holding ``layers`` (profile.LayerProfile), None for
    one peer; ``shard_share``: the busiest owner's share of a sharded stage (0: not sharded)."""
    n = len(peers)
    if n < 2:
        return None
    nbytes = sum(x.param_bytes for x in layers) * wire_per_param_byte
    edges = [links.get(peers[i], peers[(i + 1) % n]) for i in range(n)]
    slow = max(edges, key=lambda e: e.transfer_s(nbytes / n))
    order = list(reversed(layers))

    def done(work):  # in the order the layers finish: last first
        return tuple(reversed(backward_done_fractions(work)))

    w = done([x.bwd_weight_flops for x in layers])
    bw = done([x.bwd_input_flops + x.bwd_weight_flops for x in layers])
    steps = (n - 1) if shard_share else 2 * (n - 1)
    pieces = tuple(steps * x.param_bytes * wire_per_param_byte / n / slow.bandwidth for x in order)
    gather = 0.0
    if shard_share:  # the busiest owner sends its layers' weights to each other replica
        weights = sum(x.param_bytes for x in layers)
        gather = (n - 1) * shard_share * weights / slow.bandwidth + slow.rtt_s / 2
    return RingLayers(w, bw, pieces, steps * slow.rtt_s / 2, gather)
