"""Islands: region groups that train as replicas and meet once a round over the slow links.

A step-synchronous plan can only use a far region for pipeline stages, where its activations cross
the slow links every micro-batch. With islands (DiLoCo's way), each network group runs a plan of
its own on its own share of the data with the inner optimizer; once a round the islands exchange
their pseudo-gradients (parameter change over the round), compressed, and apply an outer optimizer
(``islands.outer``), so every island starts the next round from the same weights.

The exchange of round ``r`` runs while round ``r + 1`` computes and is applied at its end (the
delayed merge, Streaming DiLoCo's overlap): it is hidden when it takes at most a round. Islands of
unequal speed take unequal numbers of steps per round (``steps_per_round``), so a round is about
the same time window on each, and each island's contribution counts by the tokens it processed.

Pure functions over the planner's data: ``plan_islands`` (each group's own plan, the exchange's
codec and bytes, the steps per round that keep the exchange hidden, predicted samples/s),
``exchange_cost``, ``round_lengths``, ``data_steps`` (which samples each island trains on: no two
islands the same), and ``choose`` (``--sync auto``: the faster of the global plan and islands).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .layout import LinkTable
from .types import ModelProfile, Plan, Snapshot, Stage, compression_ratio

SYNC_MODES = ("global", "islands", "auto")  # and "islands:H": at most H steps per round on the fastest island
# pseudo-gradient codecs, least lossy first (error feedback keeps what each drops for the next round)
EXCHANGE_CODECS = ("int8", "int:4", "topk:0.1", "topk:0.03", "topk:0.01")
ROUND_MARGIN = 1.25  # the exchange must fit in a round with this much room (jitter, the merge itself)
MAX_STEPS_PER_ROUND = 100  # a longer round drifts the islands apart: a lossier codec is preferred


def parse_sync(spec: str) -> tuple[str, int]:
    """``"global"``, ``"islands"``, ``"islands:H"``, ``"auto"`` -> (mode, H); H 0: the planner's choice."""
    if not isinstance(spec, str):
        raise ValueError("--sync must be a string")
    mode, _, h = spec.partition(":")
    if mode not in SYNC_MODES or (h and mode != "islands"):
        raise ValueError(f"--sync {spec!r}: expected global, islands, islands:H or auto")
    if not h:
        return mode, 0
    try:
        n = int(h)
    except ValueError:
        n = 0
    if not 1 <= n <= 100_000:
        raise ValueError(f"--sync {spec!r}: H must be a whole number of steps from 1 to 100000")
    return mode, n


def exchange_ratio(codec: str) -> float:
    """Wire bytes per fp32 byte of a pseudo-gradient under ``codec``: ``types.compression_ratio``'s,
    top-k only up to R = 0.5 (the codecs' bound)."""
    try:
        if not (isinstance(codec, str) and codec.startswith("topk:") and float(codec[5:]) > 0.5):
            return compression_ratio(codec)
    except ValueError:
        pass
    raise ValueError(f"unknown exchange codec {codec!r}; e.g. {', '.join(EXCHANGE_CODECS)}")


def layer_owners(stages: Sequence[Stage], num_layers: int) -> list[tuple[str, ...]]:
    """For each layer, the peers of ``stages`` (one pipeline) that hold it (its stage's replicas)."""
    owners: list[tuple[str, ...]] = [()] * num_layers
    for st in stages:
        for layer in range(*st.layers):
            owners[layer] = tuple(st.peers)
    return owners


def exchange_routes(islands: Sequence[Plan], num_layers: int) -> list[tuple[str, str, int, int]]:
    """Every message of one round's exchange: (sender, receiver, sending island, layer). An island's
    first replica of each stage sends each of its layers to every peer of the other islands that
    holds that layer (its replicas compute the same pseudo-gradient; every replica needs the others')."""
    owners = [layer_owners(p.stages, num_layers) for p in islands]
    routes = []
    for i, own in enumerate(owners):
        for layer in range(num_layers):
            sender = own[layer][0]
            for j, other in enumerate(owners):
                if j != i:
                    routes.extend((sender, dst, i, layer) for dst in other[layer])
    return routes


def exchange_cost(islands: Sequence[Plan], profile: ModelProfile, links: LinkTable,
                  codec: str) -> tuple[float, float]:
    """(seconds, bytes) of one round's exchange: every message of ``exchange_routes`` at the codec's
    size; a peer sends its messages one after another, each taken when its reply is back (its
    bytes' time plus a round trip), and takes its own in one after another, so the exchange
    lasts as long as the busiest peer's sending or receiving."""
    ratio = exchange_ratio(codec)
    busy: dict[tuple[str, str], float] = {}
    total = 0.0
    for src, dst, _i, layer in exchange_routes(islands, profile.num_layers):
        nbytes = profile.layers[layer].param_bytes * ratio
        link = links.get(src, dst)
        t = nbytes / link.bandwidth
        busy[("out", src)] = busy.get(("out", src), 0.0) + t + link.rtt_s
        busy[("in", dst)] = busy.get(("in", dst), 0.0) + t
        total += nbytes
    return (max(busy.values(), default=0.0), total)


def round_lengths(step_s: Sequence[float], exchange_s: float, max_steps: int = MAX_STEPS_PER_ROUND,
                  margin: float = ROUND_MARGIN, fixed_steps: int = 0) -> tuple[tuple[int, ...], float]:
    """(steps per round of each island, round seconds): the shortest round that hides the exchange
    (``margin`` x its time), at least one step of the slowest island, each island as many steps as
    fit in it (so the fast ones do not wait). ``max_steps`` caps the fastest island's steps (the
    round then no longer hides the exchange: see ``hidden_fraction``); ``fixed_steps`` sets them
    (``--sync islands:H``)."""
    if not step_s or min(step_s) <= 0 or not all(math.isfinite(s) for s in step_s):
        raise ValueError("every island needs a finite, positive step time")
    fastest = min(step_s)
    if fixed_steps:
        window = fixed_steps * fastest
    else:
        window = min(exchange_s * margin, max_steps * fastest)
    window = max(window, max(step_s))
    steps = tuple(max(1, int(window / s + 1e-3)) for s in step_s)  # (a step 0.1 % over the window fits)
    return steps, max(h * s for h, s in zip(steps, step_s))


def round_period(steps: Sequence[int], step_s: Sequence[float], exchange_s: float) -> float:
    """Seconds per round in the steady state: the slowest island's round, or the exchange where it
    takes longer (the islands then wait for the previous round's contributions)."""
    return max(max(h * s for h, s in zip(steps, step_s)), exchange_s)


def hidden_fraction(steps: Sequence[int], step_s: Sequence[float], exchange_s: float) -> float:
    """Of the exchange's time, the fraction the islands spend computing rather than waiting."""
    compute = max(h * s for h, s in zip(steps, step_s))
    return 1.0 if exchange_s <= compute else compute / exchange_s


@dataclass(frozen=True)
class IslandsPlan:
    """Each island's plan, its steps per round, and the exchange between them (predicted)."""

    islands: tuple[Plan, ...]
    steps_per_round: tuple[int, ...]
    codec: str
    exchange_s: float  # one round's exchange
    exchange_bytes: float  # one round's bytes over the links between islands (all of them)
    samples_per_step: int  # of a data step (the job's)
    left_out: tuple[str, ...] = ()  # peers of groups that cannot hold the model alone
    notes: tuple[str, ...] = field(default=(), compare=False)
    split: int = 1  # optimizer steps an island takes a data step in (``--island-split``): its plans' steps

    @property
    def step_s(self) -> tuple[float, ...]:
        """Each island's time for one data step (``split`` steps of its plan)."""
        return tuple(p.step_s * self.split for p in self.islands)

    @property
    def round_s(self) -> float:
        return round_period(self.steps_per_round, self.step_s, self.exchange_s)

    @property
    def hidden(self) -> float:
        return hidden_fraction(self.steps_per_round, self.step_s, self.exchange_s)

    @property
    def samples_per_round(self) -> int:
        return sum(self.steps_per_round) * self.samples_per_step

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_round / self.round_s

    @property
    def bytes_per_sample(self) -> float:
        return self.exchange_bytes / self.samples_per_round

    def figures(self) -> dict:
        return {"islands": len(self.islands), "steps_per_round": list(self.steps_per_round), "codec": self.codec,
                "split": self.split,
                "island_step_s": [round(s, 6) for s in self.step_s], "round_s": round(self.round_s, 6),
                "exchange_s": round(self.exchange_s, 6), "hidden": round(self.hidden, 4),
                "exchange_bytes_per_round": round(self.exchange_bytes), "bytes_per_sample": round(self.bytes_per_sample, 1),
                "samples_per_s": round(self.samples_per_s, 4), "left_out": list(self.left_out)}


def candidate_islands(snapshot: Snapshot, groups: Sequence[Sequence[str]],
                      plan_group: Callable[[Snapshot], Plan]) -> tuple[list[Plan], list[str], list[str]]:
    """Islands the network ``groups`` can form: each group's own plan, then, where that plan leaves
    peers of the group idle (a slow group's pipeline would cross its own slow links), a plan of the
    idle ones, and so on (a group of workstations each holding the model becomes several islands).
    Returns (the plans, fastest first; peers left out; notes)."""
    plans, left, notes = [], [], []
    for g in groups:
        rest = sorted(set(g))
        while rest:
            members = set(rest)
            region = Snapshot(tuple(p for p in snapshot.peers if p.id in members), snapshot.network)
            try:
                p = plan_group(region)
                if not math.isfinite(p.step_s):
                    raise ValueError(p.bottleneck)
            except ValueError as e:
                left.extend(rest)
                notes.append(f"{len(rest)} peer(s) left out: {str(e)[:120]}")
                break
            plans.append(p)
            used = set(p.peers())
            rest = [x for x in rest if x not in used]
    plans.sort(key=lambda p: p.step_s)
    return plans, left, notes


def plan_islands(snapshot: Snapshot, profile: ModelProfile, groups: Sequence[Sequence[str]], links: LinkTable,
                 plan_group: Callable[[Snapshot], Plan], fixed_steps: int = 0,
                 codecs: Sequence[str] = EXCHANGE_CODECS, split: int = 1) -> Optional[IslandsPlan]:
    """The fastest islands over the network ``groups`` (``candidate_islands``, each planned alone by
    ``plan_group``), or None where fewer than two can hold the model. The fastest ``k`` candidates
    for every ``k`` from 2 (a slow island can cost more exchange than it gives), each with the
    least lossy of ``codecs`` whose round hides the exchange within ``MAX_STEPS_PER_ROUND`` steps
    of the fastest island, or within ``fixed_steps`` where the job sets them (the most compressed
    where none does). ``split``: an island takes a data step as this many steps of ``plan_group``'s
    plans (which plan a step of 1/``split`` of a data step's samples)."""
    plans, left, notes = candidate_islands(snapshot, groups, plan_group)
    if len(plans) < 2 and len(snapshot.peers) > 1:  # one group (a few peers left after failures, a
        # grouping that joins them): the finest islands are the peers that hold the model alone
        plans, left, notes = candidate_islands(snapshot, [[p.id] for p in snapshot.peers], plan_group)
    if len(plans) < 2:
        return None
    samples = plans[0].micro_batch_size * plans[0].num_micro_batches * split
    best = None
    for k in range(2, len(plans) + 1):
        chosen = plans[:k]
        idle = tuple(sorted([*left, *(x for p in plans[k:] for x in p.peers())]))
        for codec in codecs:
            ex_s, ex_b = exchange_cost(chosen, profile, links, codec)
            steps, _ = round_lengths([p.step_s * split for p in chosen], ex_s, fixed_steps=fixed_steps)
            cand = IslandsPlan(tuple(chosen), steps, codec, ex_s, ex_b, samples, idle, tuple(notes), split)
            if cand.hidden >= 1.0 or codec == codecs[-1]:
                break
        if best is None or cand.samples_per_s > best.samples_per_s * 1.01:  # another island must pay
            best = cand
    return best


def data_steps(steps_per_round: Sequence[int], island: int, total_steps: int, start_round: int = 0,
               first_data_step: int = 0):
    """Which data steps island ``island`` trains on, round by round: yields (round, the round's first
    data step, [this island's data steps]).

    Round ``start_round`` begins at ``first_data_step`` and each round covers the next ``sum(H)`` data
    steps, each island its own contiguous run of ``H[i]`` of them (the first island the first run),
    so no two islands train on the same samples and all of them together go through the job's data
    in order. Every island runs the same rounds (the last may give an island fewer steps, or none),
    until ``total_steps``."""
    per_round = sum(steps_per_round)
    offset = sum(steps_per_round[:island])
    rounds = -(-max(0, total_steps - first_data_step) // per_round)
    for n in range(rounds):
        base = first_data_step + n * per_round
        first = base + offset
        yield start_round + n, base, list(range(first, min(first + steps_per_round[island], total_steps)))


def choose(global_plan: Optional[Plan], islands: Optional[IslandsPlan], mode: str) -> tuple[str, str]:
    """(``"global"`` or ``"islands"``, why) for ``--sync`` mode ``global``, ``islands`` or ``auto``."""
    g = global_plan.samples_per_s if global_plan is not None and math.isfinite(global_plan.step_s) else 0.0
    i = islands.samples_per_s if islands is not None else 0.0
    if mode == "global" or (mode == "auto" and islands is None):
        why = "asked for" if mode == "global" else "fewer than two network groups can hold the model alone"
        return "global", f"global: {why}"
    if mode == "islands":
        if islands is None:
            raise ValueError("--sync islands needs two network groups that can each hold the model")
        return "islands", f"islands: asked for ({i:.4g} samples/s predicted; global {g:.4g})"
    if i > g:
        return "islands", f"islands: {i:.4g} samples/s predicted vs {g:.4g} for the global plan ({i / g if g else math.inf:.2f}x)"
    return "global", f"global: {g:.4g} samples/s predicted vs {i:.4g} with islands"
