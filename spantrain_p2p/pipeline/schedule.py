"""Pipeline schedules as data: one list of actions per stage, printable, diffable, checkable.

A stage's list is everything it does in one training step, in order: compute actions
(``F`` forward, ``B`` input-grad, ``W`` weight-grad, ``BW`` = ``B`` and ``W`` fused) and
explicit communication (``RECV_F``/``SEND_F`` for activations going downstream,
``RECV_B``/``SEND_B`` for their gradients going upstream). Micro-batches are numbered
``0 .. m-1``. The executor runs a list in order, with blocking receives and non-blocking
sends; messages are matched by (kind, micro-batch), not by arrival order.

Text form (as torchtitan does with CSV): ``to_text`` writes ``"RECV_F0 F0 SEND_F0 ..."``,
``from_text`` reads it back.

Schedules:

- ``gpipe``: all forwards, then all fused backwards. Holds all ``m`` micro-batches.
- ``1f1b``: ``p - s - 1`` warm-up forwards on stage ``s``, then one forward / one fused
  backward, then the cool-down backwards. Holds at most ``p - s`` micro-batches.
- ``zb-h1``: Zero Bubble Pipeline Parallelism (Qi et al. 2023), handcrafted schedule ZB-H1.
  The backward is split; ``B`` is sent upstream at once, ``W`` waits. Stage ``s`` does
  ``p - s`` warm-up forwards, then repeats ``B(j)``, ``W(j - s)``, ``F(next)``: ``W`` of a
  micro-batch runs ``s`` backward slots after its ``B``, in what 1F1B leaves as the
  cool-down bubble, and the ``W`` still owed run at the end. At most ``p - s`` micro-batches
  wait for their ``B`` (as in 1F1B) and at most ``s + 1`` wait for their ``W``, so no stage
  keeps activations for more than ``p`` micro-batches, 1F1B's peak. With unit times its
  bubble is ``(p-1)(t_f + t_b - t_w)`` against 1F1B's ``(p-1)(t_f + t_b + t_w)``.

``fuse_adjacent_backward`` runs a ``B`` followed at once by its own ``W`` as one ``BW`` (on a
first stage of ``zb-h1``, whose ``W`` lags by nothing and whose ``B`` sends nothing): the peers'
lists (``assignment.peer_lists``, which the simulator runs too) are fused, the schedules here are
the paper's.

``validate`` checks a whole pipeline (order of each micro-batch's work, sends matching
receives, no deadlock); ``simulate`` times it with per-stage compute times.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence, Union

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]


class Op(str, Enum):
    F = "F"  # forward of one micro-batch
    B = "B"  # backward, input-grad only (sent upstream)
    W = "W"  # backward, weight-grad only
    BW = "BW"  # full backward: B and W fused (GPipe, 1F1B)
    SEND_F = "SEND_F"  # send the activation downstream
    RECV_F = "RECV_F"  # receive the activation from upstream
    SEND_B = "SEND_B"  # send the input-grad upstream
    RECV_B = "RECV_B"  # receive the grad from downstream


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.W, Op.BW})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})

# Longest names first, so that "BW3" is BW and "SEND_F3" is not read as something shorter.
_ACTION_RE = re.compile(
    "^(" + "|".join(sorted((o.value for o in Op), key=len, reverse=True)) + r")(\d+)$"
)


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):
            try:
                object.__setattr__(self, "op", Op(self.op))
            except ValueError:
                raise ValueError(f"unknown op {self.op!r}") from None
        if isinstance(self.mb, bool) or not isinstance(self.mb, int) or self.mb < 0:
            raise ValueError(f"micro-batch index must be an int >= 0, got {self.mb!r}")

    def __str__(self) -> str:
        return f"{self.op.value}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``Action.parse("SEND_B3") == Action(Op.SEND_B, 3)``; ValueError on anything else."""
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. 'F3', 'BW0', 'SEND_B2')")
        return cls(Op(m.group(1)), int(m.group(2)))


SCHEDULE_NAMES = ("gpipe", "1f1b", "zb-h1")  # every schedule there is, declared here only
AUTO = "auto"  # a job's schedule when the planner picks it


def resolve_schedule(name: str) -> str:
    """The schedule a job's ``name`` runs where no plan chose one: ``auto`` is ``gpipe``."""
    return "gpipe" if name == AUTO else name


# ---------------------------------------------------------------------------- generators


def _check_sizes(num_stages: int, num_microbatches: int, stage: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("stage", stage)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, got {stage}")


class _Builder:
    """Appends compute actions of one stage with their receives and sends around them."""

    def __init__(self, num_stages: int, stage: int) -> None:
        self.first = stage == 0
        self.last = stage == num_stages - 1
        self.actions: list[Action] = []

    def forward(self, mb: int) -> None:
        if not self.first:
            self.actions.append(Action(Op.RECV_F, mb))
        self.actions.append(Action(Op.F, mb))
        if not self.last:
            self.actions.append(Action(Op.SEND_F, mb))

    def backward(self, mb: int, op: Op) -> None:
        """``op`` is ``BW`` (fused) or ``B`` (input-grad only; ``W`` comes later)."""
        if not self.last:
            self.actions.append(Action(Op.RECV_B, mb))
        self.actions.append(Action(op, mb))
        if not self.first:
            self.actions.append(Action(Op.SEND_B, mb))

    def weight_grad(self, mb: int) -> None:
        self.actions.append(Action(Op.W, mb))


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """All forwards, then all fused backwards, micro-batches in index order."""
    _check_sizes(num_stages, num_microbatches, stage)
    b = _Builder(num_stages, stage)
    for mb in range(num_microbatches):
        b.forward(mb)
    for mb in range(num_microbatches):
        b.backward(mb, Op.BW)
    return b.actions


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-flush): ``p - s - 1`` warm-up forwards, then F/BW pairs, then cool-down."""
    _check_sizes(num_stages, num_microbatches, stage)
    b = _Builder(num_stages, stage)
    warmup = min(num_stages - stage - 1, num_microbatches)
    for mb in range(warmup):
        b.forward(mb)
    for mb in range(warmup, num_microbatches):
        b.forward(mb)
        b.backward(mb - warmup, Op.BW)
    for mb in range(num_microbatches - warmup, num_microbatches):
        b.backward(mb, Op.BW)
    return b.actions


def zb_h1(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """ZB-H1: ``p - s`` warm-up forwards, then ``B(j) W(j - s) F(next)``; owed ``W`` at the end."""
    _check_sizes(num_stages, num_microbatches, stage)
    b = _Builder(num_stages, stage)
    warmup = min(num_stages - stage, num_microbatches)
    for mb in range(warmup):
        b.forward(mb)
    next_f, next_w = warmup, 0
    for mb in range(num_microbatches):
        b.backward(mb, Op.B)
        if mb - next_w >= stage:  # W lags its B by `stage` backward slots
            b.weight_grad(next_w)
            next_w += 1
        if next_f < num_microbatches:
            b.forward(next_f)
            next_f += 1
    for mb in range(next_w, num_microbatches):
        b.weight_grad(mb)
    return b.actions


_GENERATORS: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
}


def schedule(name: str, num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """The action list of ``stage`` for the schedule ``name`` (one of ``SCHEDULE_NAMES``)."""
    try:
        generator = _GENERATORS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}"
        ) from None
    return generator(num_stages, num_microbatches, stage)


def fuse_adjacent_backward(actions: Sequence[Action]) -> list[Action]:
    """``actions`` with each ``B`` that is followed at once by the ``W`` of its micro-batch (nothing
    between: no send) made one ``BW``. The weight gradients come out bit for bit the same, the
    split's own work does not happen, and nothing waits longer: no action ran between the two.
    (With torch's split, which keeps where each weight enters the graph and passes over it again in
    W, the side-by-side's first stage took 37.3 ms of CPU a micro-batch split against 30.9 fused,
    ``scripts/first_stage_backward.py`` on 2026-11-29; the linear layers' own split,
    ``split_backward``, costs little more than a fused backward, which still saves B's second
    autograd call a layer.)"""
    out: list[Action] = []
    for a in actions:
        if a.op is Op.W and out and out[-1].op is Op.B and out[-1].mb == a.mb:
            out[-1] = Action(Op.BW, a.mb)
        else:
            out.append(a)
    return out


def all_stages(name: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The whole pipeline: ``[schedule(name, p, m, s) for s in range(p)]``."""
    return [schedule(name, num_stages, num_microbatches, s) for s in range(num_stages)]


# ------------------------------------------------------------------------------ text form


def backward_done_fractions(work: Sequence[float]) -> list[float]:
    """Per layer (``work`` in layer order), the fraction of a backward op done once that layer
    is: the op runs the layers last to first, each taking its share of ``work`` (evenly if none)."""
    n = len(work)
    total = sum(work)
    out, acc = [0.0] * n, 0.0
    for i in reversed(range(n)):
        acc += work[i] if total > 0 else 1.0
        out[i] = acc / (total if total > 0 else n)
    return out


def to_text(actions: Sequence[Action]) -> str:
    """Space-separated actions, e.g. ``"F0 SEND_F0 F1 SEND_F1 RECV_B0 BW0"``."""
    return " ".join(str(a) for a in actions)


def from_text(text: str) -> list[Action]:
    """Inverse of ``to_text`` (any whitespace separates); ValueError names the bad token."""
    return [Action.parse(token) for token in text.split()]


# ------------------------------------------------------------------------------- memory


def peak_held(actions: Sequence[Action], opens: frozenset, closes: frozenset) -> int:
    """Most micro-batches at once between an op in ``opens`` and an op in ``closes``."""
    held = peak = 0
    for a in actions:
        if a.op in opens:
            held += 1
            peak = max(peak, held)
        elif a.op in closes:
            held -= 1
    return peak


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches forwarded but not yet back-propagated (``B`` or ``BW`` not done)."""
    return peak_held(actions, frozenset({Op.F}), frozenset({Op.B, Op.BW}))


def peak_stashed(actions: Sequence[Action]) -> int:
    """Most micro-batches whose activations are kept at once: from F until the backward that ends
    them (W, or a fused BW)."""
    return peak_held(actions, frozenset({Op.F}), frozenset({Op.W, Op.BW}))


def peak_pending_weight_grads(actions: Sequence[Action]) -> int:
    """Most micro-batches whose ``B`` is done and ``W`` is not (0 for fused schedules)."""
    return peak_held(actions, frozenset({Op.B}), frozenset({Op.W}))


# ----------------------------------------------------------------------------- checking


_KIND = {Op.SEND_F: "F", Op.RECV_F: "F", Op.SEND_B: "B", Op.RECV_B: "B"}


def _run(
    schedules: Sequence[Sequence[Action]],
    duration: Callable[[int, Op], float],
    latency: Callable[[int, int], float],
) -> tuple[list[float], list[float]]:
    """Execute every stage's list in order: blocking receives, non-blocking sends.

    Returns (finish time, busy time) per stage. Assumes the per-stage checks of
    ``validate`` passed (sends go to an existing neighbour). ValueError on deadlock.
    """
    p = len(schedules)
    pos = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    arrived: dict[tuple[int, str, int], float] = {}  # (stage, kind, mb) -> arrival time
    ready = deque(range(p))
    queued = [True] * p
    while ready:
        s = ready.popleft()
        queued[s] = False
        actions = schedules[s]
        while pos[s] < len(actions):
            a = actions[pos[s]]
            if a.op in (Op.RECV_F, Op.RECV_B):
                key = (s, _KIND[a.op], a.mb)
                if key not in arrived:
                    break
                clock[s] = max(clock[s], arrived.pop(key))
            elif a.op in (Op.SEND_F, Op.SEND_B):
                dst = s + 1 if a.op is Op.SEND_F else s - 1
                arrived[(dst, _KIND[a.op], a.mb)] = clock[s] + latency(s, dst)
                if not queued[dst]:
                    ready.append(dst)
                    queued[dst] = True
            else:
                d = duration(s, a.op)
                clock[s] += d
                busy[s] += d
            pos[s] += 1
    stuck = [s for s in range(p) if pos[s] < len(schedules[s])]
    if stuck:
        waits = ", ".join(f"stage {s} waits at {schedules[s][pos[s]]} (action {pos[s]})"
                          for s in stuck)
        raise ValueError(f"deadlock: {waits}")
    return clock, busy


def _check_stage(actions: Sequence[Action], s: int, p: int, m: int) -> None:
    where = f"stage {s}"
    first: dict[tuple[Op, int], int] = {}
    for i, a in enumerate(actions):
        if not isinstance(a, Action):
            raise ValueError(f"{where}: action {i} is {a!r}, not an Action")
        if a.mb >= m:
            raise ValueError(f"{where}: {a} (action {i}) names micro-batch {a.mb}, but the "
                             f"pipeline has micro-batches 0..{m - 1}")
        if (a.op, a.mb) in first:
            raise ValueError(f"{where}: {a} appears twice (actions {first[(a.op, a.mb)]} and {i})")
        first[(a.op, a.mb)] = i
        if s == 0 and a.op is Op.RECV_F:
            raise ValueError(f"{where}: {a} (action {i}) but the first stage reads its input "
                             "from data; there is no upstream stage")
        if s == 0 and a.op is Op.SEND_B:
            raise ValueError(f"{where}: {a} (action {i}) but the first stage has no upstream stage")
        if s == p - 1 and a.op is Op.SEND_F:
            raise ValueError(f"{where}: {a} (action {i}) but the last stage has no downstream stage")
        if s == p - 1 and a.op is Op.RECV_B:
            raise ValueError(f"{where}: {a} (action {i}) but the last stage starts its backward "
                             "from its loss; there is no downstream stage")

    def at(op: Op, mb: int) -> int | None:
        return first.get((op, mb))

    for mb in range(m):
        f = at(Op.F, mb)
        if f is None:
            raise ValueError(f"{where}: micro-batch {mb} has no F")
        b, w, bw = at(Op.B, mb), at(Op.W, mb), at(Op.BW, mb)
        if bw is not None and (b is not None or w is not None):
            raise ValueError(f"{where}: micro-batch {mb} has BW{mb} and also a split B/W")
        if bw is None and b is None and w is None:
            raise ValueError(f"{where}: micro-batch {mb} has no backward (BW, or B and W)")
        if bw is None and (b is None or w is None):
            missing = "W" if w is None else "B"
            raise ValueError(f"{where}: micro-batch {mb} has a split backward without {missing}{mb}")
        grad_in = bw if bw is not None else b  # the action that produces the input-grad
        if grad_in < f:
            raise ValueError(f"{where}: {actions[grad_in]} (action {grad_in}) comes before "
                             f"F{mb} (action {f})")
        if w is not None and w < b:
            raise ValueError(f"{where}: W{mb} (action {w}) comes before B{mb} (action {b})")
        if s > 0:
            r = at(Op.RECV_F, mb)
            if r is None:
                raise ValueError(f"{where}: F{mb} has no RECV_F{mb} (stage {s - 1} sends it)")
            if r > f:
                raise ValueError(f"{where}: RECV_F{mb} (action {r}) comes after F{mb} (action {f})")
            t = at(Op.SEND_B, mb)
            if t is None:
                raise ValueError(f"{where}: no SEND_B{mb}: stage {s - 1} would wait for it forever")
            if t < grad_in:
                raise ValueError(f"{where}: SEND_B{mb} (action {t}) comes before "
                                 f"{actions[grad_in]} (action {grad_in}) computes it")
        if s < p - 1:
            t = at(Op.SEND_F, mb)
            if t is None:
                raise ValueError(f"{where}: no SEND_F{mb}: stage {s + 1} would wait for it forever")
            if t < f:
                raise ValueError(f"{where}: SEND_F{mb} (action {t}) comes before F{mb} (action {f})")
            r = at(Op.RECV_B, mb)
            if r is None:
                raise ValueError(f"{where}: {actions[grad_in]} has no RECV_B{mb} "
                                 f"(stage {s + 1} sends it)")
            if r > grad_in:
                raise ValueError(f"{where}: RECV_B{mb} (action {r}) comes after "
                                 f"{actions[grad_in]} (action {grad_in})")


def validate(schedules: Sequence[Sequence[Action]]) -> None:
    """Check a whole pipeline (one action list per stage, stage 0 first).

    Every stage does each micro-batch ``0..m-1`` once: ``F``, then either ``BW`` or ``B``
    then ``W``; receives come before the compute that needs them and sends after the
    compute that makes them, so every send has its receive on the neighbouring stage; and
    executing each list in order, with blocking receives and non-blocking sends, finishes.
    Raises ValueError describing the first problem.
    """
    p = len(schedules)
    if p < 1:
        raise ValueError("a pipeline needs at least one stage")
    mbs = {a.mb for actions in schedules for a in actions if isinstance(a, Action)}
    if not mbs:
        raise ValueError("the pipeline has no actions")
    m = max(mbs) + 1
    for s, actions in enumerate(schedules):
        _check_stage(actions, s, p, m)
    _run(schedules, lambda s, op: 1.0, lambda src, dst: 0.0)


def _per_stage(name: str, value: PerStage, n: int) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value)] * n
    else:
        values = [float(v) for v in value]
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries, expected {n}")
    if any(v < 0 or v != v for v in values):
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return values


def simulate(
    schedules: Sequence[Sequence[Action]],
    t_f: PerStage,
    t_b: PerStage,
    t_w: PerStage,
    t_comm: PerStage = 0.0,
) -> dict:
    """Time a pipeline: each stage runs its list in order, sends arrive ``t_comm`` later.

    ``t_f``, ``t_b``, ``t_w``: seconds per micro-batch, scalars or lists indexed by stage
    (``BW`` takes ``t_b + t_w``). ``t_comm``: a scalar or one value per link (``p - 1``
    entries; link ``s`` joins stages ``s`` and ``s + 1``), the same in both directions.
    Returns ``makespan``, ``stage_busy`` and ``stage_bubble`` (idle seconds per stage) and
    ``bubble_fraction = 1 - sum(busy) / (p * makespan)``. Validates the pipeline first.
    """
    validate(schedules)
    p = len(schedules)
    tf, tb, tw = (_per_stage(n, v, p) for n, v in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)))
    link = _per_stage("t_comm", t_comm, p - 1) if p > 1 else []
    cost = {Op.F: tf, Op.B: tb, Op.W: tw}

    def duration(s: int, op: Op) -> float:
        return tb[s] + tw[s] if op is Op.BW else cost[op][s]

    finish, busy = _run(schedules, duration, lambda src, dst: link[min(src, dst)])
    makespan = max(finish)
    return {
        "makespan": makespan,
        "stage_busy": busy,
        "stage_bubble": [makespan - b for b in busy],
        "bubble_fraction": 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0,
    }
