"""Who runs which micro-batch, and each peer's action list: what the runtime runs, and what the
cost model and the simulator (``plan.layout``, ``sim``) model, from these same functions.

- ``microbatch_counts`` / ``microbatch_owners`` / ``assign_microbatches``: which peer of a stage
  runs which micro-batch. Counts by largest remainder of ``share * m``; each peer's micro-batches
  spread evenly over the step (peer ``i`` with ``c`` of them takes the slots nearest to
  ``(k + 0.5) * m / c``), so no peer waits for a clump of another's.
- ``stage_warmups`` / ``stage_actions`` / ``peer_lists`` / ``peer_actions``: each peer's action
  list. A stage of several data-parallel peers runs its schedule's list over all ``m``
  micro-batches with a warm-up scaled to its replicas (never growing downstream), and each peer
  keeps the actions of its own micro-batches; sends and receives go to whichever peer of the
  neighbouring stage holds that micro-batch. A sub-sequence of a deadlock-free stage list, run by
  more devices, cannot deadlock. (Giving each replica the schedule generated for its own count
  instead can deadlock: stages of 1, 3 and 1 peers, m = 4, 1F1B or ZB-H1.)
- ``check_deadlock_free`` proves it for given lists by executing them abstractly: every peer
  runs its list in order, receives block until the matching send happened.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from . import schedule as sched


def microbatch_counts(shares: Sequence[float], m: int) -> list[int]:
    """``m`` micro-batches split by ``shares`` (largest remainder; ties to the earlier peer)."""
    n = len(shares)
    total = sum(shares)
    if n == 0 or total <= 0:
        raise ValueError("micro-batch shares must be positive")
    exact = [s / total * m for s in shares]
    counts = [int(math.floor(x)) for x in exact]
    left = m - sum(counts)
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def microbatch_owners(shares: Sequence[float], m: int) -> list[int]:
    """For each micro-batch ``0..m-1``, the index of the peer (in ``shares`` order) that runs it.

    Peer ``i`` with ``c`` micro-batches takes the slots nearest to ``(k + 0.5) * m / c``: its
    work is spread evenly over the step, so no peer waits for a clump of another's.
    """
    counts = microbatch_counts(shares, m)
    owner = np.repeat(np.arange(len(counts)), counts)
    pos = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c] or [np.zeros(0)])
    return owner[np.lexsort((owner, pos))].tolist()  # by position, then peer index


def assign_microbatches(peers: Sequence[str], shares: Sequence[float], num_microbatches: int) -> list[str]:
    """The peer that runs each micro-batch: ``microbatch_owners`` by peer id."""
    return [peers[i] for i in microbatch_owners(shares, num_microbatches)]


def dealt_shares(shares: Sequence[float], m: int) -> list[float]:
    """Each peer's fraction of ``m`` micro-batches as they are dealt (its count / ``m``): what the
    peers' warm-ups are scaled by, so the cost model and the simulator scale theirs the same way."""
    return [c / m for c in microbatch_counts(shares, m)]


def stage_warmups(schedule_name: str, shares: Sequence[Sequence[float]], m: int) -> list[int]:
    """Forwards each stage runs before its first backward.

    The schedule's own warm-up (1F1B: ``p - s - 1``, ZB-H1: ``p - s``) is meant for one device per
    stage; a stage of several peers splits its micro-batches among them, so its warm-up is
    scaled by ``1 / largest share`` to give each peer about the schedule's own number in flight.
    Warm-ups never grow downstream (stage ``s`` runs at least as many as ``s + 1``), which is
    what keeps the filtered per-peer lists free of deadlock.
    """
    p = len(shares)
    if schedule_name == "gpipe":
        return [m] * p
    out = [0] * p
    for s in range(p - 1, -1, -1):
        std = (p - s - 1) if schedule_name == "1f1b" else (p - s)
        if s == p - 1:
            out[s] = std
            continue
        scaled = int(math.ceil(std / max(shares[s]) - 1e-9))
        out[s] = min(max(std, scaled, out[s + 1] + 1), max(m, std))
    return out


def stage_actions(schedule_name: str, num_stages: int, stage: int, m: int, warmup: int) -> list[sched.Action]:
    """The whole stage's action list (``m`` micro-batches) with ``warmup`` forwards first.

    Built with ``pipeline.schedule``'s generators at a virtual pipeline depth that gives this
    warm-up while keeping the stage's receives and sends (first / middle / last stage).
    """
    p, s = num_stages, stage
    last = s == p - 1
    if schedule_name == "gpipe" or last:
        return sched.schedule(schedule_name, p, m, s)
    if schedule_name == "1f1b":
        if s == 0:
            return sched.schedule("1f1b", max(warmup, 1) + 1, m, 0)
        return sched.schedule("1f1b", max(warmup, 1) + 2, m, 1)
    if s == 0:
        return sched.schedule("zb-h1", max(warmup, 2), m, 0)
    return sched.schedule("zb-h1", max(warmup, 2) + s, m, s)


def peer_lists(schedule_name: str, num_stages: int, stage: int, m: int, warmup: int,
               owner: Sequence[int], n_peers: int) -> list[list[sched.Action]]:
    """Each peer's action list: the stage's list filtered to the micro-batches it owns
    (``owner[mb]``: index of the peer that runs micro-batch ``mb``), a ``B`` followed at once by its
    own ``W`` fused (``schedule.fuse_adjacent_backward``; the simulator runs these lists too)."""
    lists: list[list[sched.Action]] = [[] for _ in range(n_peers)]
    for a in stage_actions(schedule_name, num_stages, stage, m, warmup):
        lists[owner[a.mb]].append(a)
    return [sched.fuse_adjacent_backward(lst) for lst in lists]


def peer_actions(assignments: list[list[str]], schedule_name: str) -> dict[tuple[int, str], list[sched.Action]]:
    """{(stage, peer): actions with global micro-batch numbers}; assignments[k][mb] = peer of mb at stage k.

    The warm-ups come from each peer's count of micro-batches (its share as assigned)."""
    n = len(assignments)
    m = len(assignments[0]) if assignments else 0
    shares = [[assign.count(p) / m for p in dict.fromkeys(assign)] for assign in assignments]  # dealt: count / m
    warmups = stage_warmups(schedule_name, shares, m)
    out: dict[tuple[int, str], list[sched.Action]] = {}
    for k, assign in enumerate(assignments):
        peers = list(dict.fromkeys(assign))
        index = {p: i for i, p in enumerate(peers)}
        lists = peer_lists(schedule_name, n, k, m, warmups[k], [index[p] for p in assign], len(peers))
        out.update(((k, p), lst) for p, lst in zip(peers, lists))
    return out


def check_deadlock_free(assignments: list[list[str]], actions: dict[tuple[int, str], list[sched.Action]]) -> None:
    """ValueError naming where the peers would wait for each other forever."""
    sent: set[tuple[str, int, int]] = set()  # (kind, destination stage, mb)
    pos = {key: 0 for key in actions}
    progress = True
    while progress:
        progress = False
        for (k, peer), acts in actions.items():
            while pos[(k, peer)] < len(acts):
                a = acts[pos[(k, peer)]]
                if a.op is sched.Op.RECV_F and ("F", k, a.mb) not in sent:
                    break
                if a.op is sched.Op.RECV_B and ("B", k, a.mb) not in sent:
                    break
                if a.op is sched.Op.SEND_F:
                    sent.add(("F", k + 1, a.mb))
                elif a.op is sched.Op.SEND_B:
                    sent.add(("B", k - 1, a.mb))
                pos[(k, peer)] += 1
                progress = True
    stuck = [f"stage {k} peer {peer[:12]} at {actions[(k, peer)][i]}" for (k, peer), i in pos.items()
             if i < len(actions[(k, peer)])]
    if stuck:
        raise ValueError("deadlock: " + "; ".join(stuck[:4]))
