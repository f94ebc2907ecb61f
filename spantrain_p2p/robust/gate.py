"""The statistical gate at a stage boundary: a receiver's cheap check of every activation and
activation gradient it takes from a neighbour, before it computes with it.

A tensor is judged by its RMS (one pass over it), in log space, against two references:
- **its sender's own past** at this boundary: the median of the last ``window`` tensors of that
  kind the sender had accepted (an honest stream drifts slowly; an attack that starts mid-run jumps);
- **the others crossing the same boundary**: the medians of this receiver's other senders and the
  medians its replicas share each step (``shared``/``take_shared``, through the gradient sum), once
  there are at least 3 of them (a median of 3 is not moved by one liar). This is what catches an
  attacker that scales from its very first message to a receiver it alone feeds. A sender with a
  tensor refused or pardoned in the last ``PARDON_STEPS`` steps is left out of both (its level,
  taken before the references had warmed up or when pardoned, said nothing of the others').
A tensor further than ``refuse`` (x or /) from either is refused, and so is an all-zero one (an
honest activation or gradient never is; fp16 sends an overflowed one as zeros: ``zeros_ok``); one
further than ``suspect`` is taken, and its sender named for the verifier (its replicas recompute
its work). Gradients are data-dependent: an honest micro-batch's was seen 17x its sender's recent
ones, so only what no data gives is refused. A tensor refused at a (step, micro-batch) is taken
when that step is redone with another peer sending it: then it was the data, not the sender. Where
the swarm keeps the sender (its other receivers do not accuse it: no eviction) and its tensors of
one step were refused ``PARDON_AFTER`` times (each refusal fails the step, and it is redone), the
step's next odd ones are taken (``pardoned``), one too large
scaled down to the refuse limit: an honest loss spike gives such a tensor at every redo (a gradient
57x its sender's recent ones, seen live), and refusing it for ever held the run at one step, epoch
after epoch. So are that sender's odd ones of that kind over the next ``PARDON_STEPS`` steps: a
sender the swarm kept through the re-plans once is not worth two more a step. An attacker two
receivers accuse each other with (its scaled activation refused, the receiver's gradient, the
answer to it, refused by the attacker: neither accusation evicts alone) broke two or three epochs
at every step, 100+ re-plans in a run (tests/test_robust.py); pardoned, it is named to its replicas'
checks, which convict it. Scaled to the limit it does no more than a tensor just inside it would; one too small
is taken as it is (it can only slow the learning down).

Norms catch scaled, zeroed and noise-flooded tensors; a forgery that keeps the norm passes (what
spot recomputation is for). Pure bookkeeping: no I/O."""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Mapping, Optional, Sequence

import torch

SUSPECT = 8.0  # x or / this far from a reference: its sender is checked (clean spread: attack_figures.py --clean-steps)
REFUSE = 32.0  # x or / this far: refused (the clean spread: 2.7x at most in 1,000 steps)
WINDOW = 48  # tensors of a sender's past kept per kind
WARMUP = 4  # tensors a sender's own past needs before it judges
SHARE_WARMUP = 1  # tensors a receiver shares a median of (the others' reference: from the first step on)
MIN_OTHERS = 3  # references from other senders needed before they judge
PARDON_AFTER = 2  # refusals of one sender's tensors at one step before they are taken, at most at the limit
PARDON_STEPS = 20  # steps after that one its odd tensors of the kind are taken so too (the verifier's NAMED_STEPS)
KINDS = ("act", "grad")
SHARED = 2 * len(KINDS) + 1  # the floats ``shared`` gives: [median, count] per kind, and the odd flag


def log_rms(t: torch.Tensor) -> float:
    """log of the tensor's root mean square (-inf for an all-zero one), in float32 arithmetic."""
    if t.numel() == 0:
        return float("-inf")
    r = float(torch.linalg.vector_norm(t.detach().float())) / math.sqrt(t.numel())
    return math.log(r) if r > 0 else float("-inf")


class Gate:
    def __init__(self, suspect: float = SUSPECT, refuse: float = REFUSE, window: int = WINDOW, warmup: int = WARMUP,
                 zeros_ok: bool = False):
        self.suspect_limit, self.refuse_limit = math.log(suspect), math.log(refuse)
        self.window, self.warmup, self.zeros_ok = window, warmup, zeros_ok
        self.hist: dict[tuple[str, str], deque] = {}  # (kind, sender) -> log RMS of its accepted tensors
        self.seen_at: dict[tuple[str, str], int] = {}  # (kind, sender) -> ``accepted`` when last taken
        self.shared_by: dict[str, dict[str, float]] = {}  # kind -> replica -> the median it shared
        self.refused: dict[str, int] = {}  # sender -> tensors refused
        self.suspected: dict[str, int] = {}  # sender -> tensors taken but named to the verifier
        self._refused_at: dict[tuple[str, int, int], str] = {}  # (kind, step, mb) -> the sender refused
        self._refusals: dict[tuple[str, int, str], int] = {}  # (kind, step, sender) -> its tensors refused
        self.pardoned: dict[tuple[str, int, int], float] = {}  # (kind, step, mb) -> the scale its tensor takes
        self._kept: dict[tuple[str, str], int] = {}  # (kind, sender) -> the step it was first pardoned at
        self.accepted = 0
        self.step = -1  # the latest step a tensor was judged at
        self._odd_at: dict[tuple[str, str], int] = {}  # (kind, sender) -> the step one of its tensors was last refused or pardoned at
        self.odd: set[int] = set()  # steps whose received tensors were named or refused (the excuse shared)
        self.max_dev: dict[str, float] = {}  # kind -> the largest |log ratio| a tensor taken unnamed had

    def _median(self, kind: str, src: str, warmup: Optional[int] = None) -> Optional[float]:
        h = self.hist.get((kind, src))
        return statistics.median(h) if h is not None and len(h) >= (self.warmup if warmup is None else warmup) else None

    def _odd_lately(self, kind: str, src: str) -> bool:
        """Whether a ``kind`` tensor of ``src`` was refused or pardoned within ``PARDON_STEPS`` steps: an
        odd sender, whose level says nothing of the others'. (In a suite run, 2026-12-01, an attacker
        scaling its gradients 100x stood as "the others' level" at stage-0 receivers fed by few
        senders, and the honest replicas' gradients were refused 183x below it and two of them
        evicted. Which way its level got in was not seen: a level gets in with the tensors taken
        before the references have warmed up, or with a pardon.)"""
        at = self._odd_at.get((kind, src))
        return at is not None and self.step - at <= PARDON_STEPS

    def references(self, kind: str, src: str) -> tuple[Optional[float], Optional[float]]:
        """(the sender's own past median, the median of the others' medians) at this boundary; the
        others are the senders heard from lately (a peer gone since says nothing of now), less those
        refused or pardoned lately."""
        own = self._median(kind, src)
        recent = self.accepted - 4 * self.window
        others = [m for (k, s), at in self.seen_at.items()
                  if k == kind and s != src and at >= recent and not self._odd_lately(k, s)
                  and (m := self._median(k, s)) is not None]
        others += list(self.shared_by.get(kind, {}).values())
        return own, (statistics.median(others) if len(others) >= MIN_OTHERS else None)

    def beyond(self, kind: str, src: str, t: torch.Tensor) -> bool:
        """Whether ``t`` (a ``kind`` tensor from ``src``) lies past the refusal limit from this peer's
        references, without remembering it: what a replica checking another's micro-batch asks of
        the input it fetched (a receiver took it scaled, or refused it: its work on it cannot be
        recomputed from the input as sent)."""
        lr = log_rms(t)
        if lr == float("-inf"):
            return not (self.zeros_ok or t.numel() == 0)
        return any(ref is not None and abs(lr - ref) > self.refuse_limit for ref in self.references(kind, src))

    def judge(self, kind: str, src: str, t: torch.Tensor, step: int = -1, mb: int = -1) -> Optional[tuple[str, str]]:
        """None if ``t`` (a ``kind`` tensor from ``src``, of ``step`` and micro-batch ``mb``) passes
        and is remembered; ("suspect", why) if it is taken but its sender should be checked;
        ("refuse", why) if it is refused; ("pardon", why) if it is taken scaled by
        ``pardoned[(kind, step, mb)]`` (``src``'s tensors of ``step`` refused ``PARDON_AFTER`` times
        before, its sender kept)."""
        lr = log_rms(t)
        self.step = max(self.step, step)
        if lr == float("-inf"):
            if self.zeros_ok or t.numel() == 0:
                return None
            return self._refuse(kind, src, step, mb, f"an all-zero {kind}")
        own, others = self.references(kind, src)
        worst = (0.0, None, "")
        for ref, what in ((own, "its own recent ones"), (others, "the others' at this boundary")):
            if ref is not None and abs(lr - ref) > abs(worst[0]):
                worst = (lr - ref, ref, what)
        dev, ref, what = worst
        why = "" if ref is None else (f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} of RMS {math.exp(lr):.3g}, {math.exp(abs(dev)):.3g}x "
                                      f"{'above' if dev > 0 else 'below'} {what} ({math.exp(ref):.3g})")
        pardon, lately = abs(dev) > self.refuse_limit, False
        if pardon:
            kept = self._kept.get((kind, src))
            lately = kept is not None and 0 < step - kept <= PARDON_STEPS
            if step < 0 or (self._refusals.get((kind, step, src), 0) < PARDON_AFTER and not lately):
                return self._refuse(kind, src, step, mb, why)
            # kept by the swarm through PARDON_AFTER re-plans, the same again: taken, at most at the
            # limit, and remembered as it came (a spike is one of the window: the level moves only if it stays)
            scale = min(1.0, math.exp(self.refuse_limit - dev))
            self._mark_odd(kind, src)
            self.pardoned[(kind, step, mb)] = scale
            if len(self.pardoned) > 64:
                self.pardoned.pop(next(iter(self.pardoned)))
            if lately:
                why = f"{why}, its {kind}s pardoned at step {kept}: taken scaled by {scale:.3g}"
            else:
                self._kept[(kind, src)] = step
                if len(self._kept) > 1024:
                    self._kept.pop(next(iter(self._kept)))
                why = f"{why}, refused {PARDON_AFTER} times: taken scaled by {scale:.3g}"
        if not (pardon and lately):  # (a sender odd step after step does not set its own level)
            self.hist.setdefault((kind, src), deque(maxlen=self.window)).append(lr)
        self.accepted += 1
        self.seen_at[(kind, src)] = self.accepted
        if abs(dev) > self.suspect_limit:
            self.suspected[src] = self.suspected.get(src, 0) + 1
            self.odd.add(step)
            return ("pardon" if pardon else "suspect"), why
        self.max_dev[kind] = max(self.max_dev.get(kind, 0.0), abs(dev))
        return None

    def _refuse(self, kind: str, src: str, step: int, mb: int, why: str) -> Optional[tuple[str, str]]:
        first = self._refused_at.setdefault((kind, step, mb), src)
        if first != src and step >= 0:  # the step redone, another sender, the same tensor: the data's
            return None
        self.odd.add(step)
        self._mark_odd(kind, src)
        self.refused[src] = self.refused.get(src, 0) + 1
        if step >= 0:
            key = (kind, step, src)
            self._refusals[key] = self._refusals.get(key, 0) + 1
        for d in (self._refused_at, self._refusals):
            if len(d) > 1024:
                d.pop(next(iter(d)))
        return "refuse", why

    def _mark_odd(self, kind: str, src: str) -> None:
        """``src``'s ``kind`` tensor judged now (``self.step``, set by ``judge``) was refused or pardoned."""
        self._odd_at[(kind, src)] = self.step
        if len(self._odd_at) > 1024:
            self._odd_at.pop(next(iter(self._odd_at)))

    def forget(self, peers) -> None:
        """Drops what ``peers`` (evicted) sent and shared from the references: an attacker's level,
        taken while it was pardoned, no longer says what the others' is."""
        gone = set(peers)
        if not gone:
            return
        for key in [k for k in self.hist if k[1] in gone]:
            del self.hist[key]
            self.seen_at.pop(key, None)
        for by in self.shared_by.values():
            for p in gone & set(by):
                del by[p]

    # ---- what replicas of a stage share ---------------------------------------------------------
    def shared(self, step: int = -1) -> list[float]:
        """What this receiver tells its replicas at ``step``'s gradient sum: [median, count] for each of
        ``KINDS`` (0, 0 where it has seen nothing yet), and 1.0 if a tensor it received for the step
        was odd (its own part may then be off through no fault of its own: not judged this step)."""
        out = []
        for kind in KINDS:
            ms = [m for (k, s) in self.hist if k == kind and not self._odd_lately(k, s)
                  and (m := self._median(k, s, SHARE_WARMUP)) is not None]
            out += [statistics.median(ms), float(len(ms))] if ms else [0.0, 0.0]
        return out + [1.0 if step in self.odd else 0.0]

    def take_shared(self, by_peer: Mapping[str, Sequence[float]], me: str = "") -> set[str]:
        """What the replicas shared this step (``shared``; ``me``'s own is not a reference),
        malformed ones ignored; returns the replicas that said their inputs were odd."""
        for i, kind in enumerate(KINDS):
            got = {}
            for peer, v in by_peer.items():
                if peer == me:
                    continue
                if len(v) == SHARED and v[2 * i + 1] >= 1 and math.isfinite(v[2 * i]) and abs(v[2 * i]) < 200:
                    got[peer] = float(v[2 * i])
            self.shared_by[kind] = got
        if len(self.odd) > 64:
            self.odd = set(sorted(self.odd)[-32:])
        return {p for p, v in by_peer.items() if len(v) == SHARED and v[-1] == 1.0}

    def status(self) -> dict:
        return {"accepted": self.accepted, "refused": dict(self.refused), "suspected": dict(self.suspected),
                "max_deviation": {k: round(math.exp(v), 3) for k, v in self.max_dev.items()}}
