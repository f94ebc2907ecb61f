"""How long a pipeline's tensors take from one stage to the next while the next waits for them, and
how much of a step only one stage computes: from the peers' step timelines (``Trainer.timelines``,
in each peer's report), one peer a stage (issue 31).

A hop: stage k ends the op that makes a tensor (F: its activation to k + 1; B or BW: its input
gradient to k - 1), its event loop starts the send (SEND_F, SEND_B), and the stage it goes to ends
its wait for it (RECV_F, RECV_B). Only hops whose receiver was already waiting when the tensor was
made are counted: the others cost nothing. Each is split at the send's start: the sender's own turn
(its loop waking to send) and the rest (the bytes, the receiver's loop waking to take them); where the
receiver's timeline has its tensors' arrivals (``arrivals``: [kind, micro-batch, first byte, whole,
filed], from its data plane), the rest splits again: to the first byte at the receiver, to the whole
frame, to the tensor checked and filed, and on to the waiting op taking it. On a
host whose cores are all busy these are where a pipeline waits on its transport; a core with one
stage computing and none other runnable is idle, which ``single_s`` (a step's wall time with at most
one compute op under way over all stages) bounds.

All times are the peers' wall clocks (unix): peers of one host, or hosts whose clocks agree.
"""
from __future__ import annotations

import statistics
from typing import Optional

from .cpu_use import COMPUTE_OPS
_MADE_BY = {"RECV_F": (("F",), -1, "SEND_F"), "RECV_B": (("B", "BW"), +1, "SEND_B")}
_KIND = {"RECV_F": "act", "RECV_B": "grad"}
# the parts of send_to_taken where the receiver kept arrivals, each (name, what it is) from one moment
# to the next of: the send's start, the first byte there, the whole frame, filed, taken
PARTS = (("send_to_first_byte", "to the receiver's first byte"), ("first_byte_to_whole", "to the whole frame"),
         ("whole_to_filed", "checked and filed"), ("filed_to_taken", "to the waiting op"))


def _first(ops: list, names: tuple[str, ...], mb: int) -> Optional[list]:
    return next((o for o in ops if o[0] in names and o[1] == mb), None)


def _summary(xs: list[float], steps: int) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 3) if xs else None,
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3) if xs else None,
            "per_step_ms": round(sum(xs) / steps * 1e3, 2) if steps else None}


def hop_times(timelines: dict[int, list[dict]]) -> dict:
    """``timelines``: per stage, its one peer's step timelines. Over the steps every stage has:
    the hops whose receiver waited (``count``), the time from the tensor made to it taken
    (``made_to_taken``), split at the send's start (``made_to_send``, ``send_to_taken``), each as
    median, 90th percentile and sum a step; where the receivers kept their tensors' arrivals,
    ``send_to_taken``'s parts too (``PARTS``, over the hops that have them: ``split``); and
    ``single_s``, the median step's wall time with at most one compute op under way (``idle_s``: with none)."""
    by_stage = {k: {tl["step"]: tl for tl in tls} for k, tls in timelines.items()}
    common = set.intersection(*(set(v) for v in by_stage.values())) if by_stage else set()
    steps = sorted(common)
    made_to_taken, made_to_send, send_to_taken = [], [], []
    parts: dict[str, list[float]] = {name: [] for name, _what in PARTS}
    for s in steps:
        for k, tls in by_stage.items():
            arrived = {(a[0], a[1]): a[2:5] for a in tls[s].get("arrivals") or ()}
            for op, mb, start, end in tls[s]["ops"]:
                if op not in _MADE_BY:
                    continue
                makers, step_to, send_name = _MADE_BY[op]
                src = by_stage.get(k + step_to)
                if src is None:
                    continue
                made = _first(src[s]["ops"], makers, mb)
                sent = _first(src[s]["ops"], (send_name,), mb)
                if made is None or start >= made[3]:
                    continue  # not made yet when it began waiting: only then does the hop cost
                made_to_taken.append(max(0.0, end - made[3]))
                if sent is not None:
                    made_to_send.append(max(0.0, sent[2] - made[3]))
                    send_to_taken.append(max(0.0, end - sent[2]))
                    came = arrived.get((_KIND[op], mb))
                    if came is not None:
                        moments = (sent[2], *came, end)
                        for (name, _what), a, b in zip(PARTS, moments, moments[1:]):
                            parts[name].append(max(0.0, b - a))
    split = len(parts[PARTS[0][0]])
    return {"steps": len(steps), "count": len(made_to_taken),
            "made_to_taken": _summary(made_to_taken, len(steps)),
            "made_to_send": _summary(made_to_send, len(steps)),
            "send_to_taken": _summary(send_to_taken, len(steps)),
            "split": split, **({name: _summary(v, len(steps)) for name, v in parts.items()} if split else {}),
            **_single(by_stage, steps)}


def _single(by_stage: dict[int, dict[int, dict]], steps: list[int]) -> dict:
    """Per step (from the first stage's start of it to its start of the next), the wall seconds with
    at most one compute op under way, and with none; their medians."""
    first = min(by_stage) if by_stage else None
    singles, idles = [], []
    for s, nxt in zip(steps, steps[1:]):
        lo, hi = by_stage[first][s]["start"], by_stage[first][nxt]["start"]
        events = sorted((t, d) for tls in by_stage.values() for step in (s, nxt) for op, _mb, a, b in tls[step]["ops"]
                        if op in COMPUTE_OPS for t, d in ((a, 1), (b, -1)))
        running, last, single, idle = 0, lo, 0.0, 0.0
        for t, d in events:
            a, b = max(last, lo), min(t, hi)
            if b > a:
                single += (b - a) if running <= 1 else 0.0
                idle += (b - a) if running == 0 else 0.0
            running, last = running + d, max(last, t)
        if hi > last:
            single += hi - max(last, lo) if running <= 1 else 0.0
            idle += hi - max(last, lo) if running == 0 else 0.0
        singles.append(single)
        idles.append(idle)
    return {"single_s": round(statistics.median(singles), 4) if singles else None,
            "idle_s": round(statistics.median(idles), 4) if idles else None}
