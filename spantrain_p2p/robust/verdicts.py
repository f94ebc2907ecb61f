"""From clip reports to a verdict: which peer is attacking, by evidence that honest float noise does
not produce.

Two kinds of evidence:
- *far*: the contribution's distance from the robust centre is more than ``FAR_RATIO`` radii (the
  radius is 3 median distances and an honest replica's mean lies within about one: far means 9
  median distances or more, what scaled or random vectors give); convicted when far in
  ``CONVICT_OF`` of its last ``WINDOW`` judged steps: one odd step (an outlier batch, seen up to
  ~4 radii) convicts nobody;
- *opposed*: its cosine with the robust centre is under ``OPPOSED_SHARE`` of the step's median
  cosine (an honest gradient points the others' way; a sign flip, inner-product manipulation or a
  free rider's zeros do not); convicted when opposed in ``OPPOSED_OF`` of its last ``WINDOW`` steps.
What is neither (a little-is-enough shift, a stale gradient) is clipped or bounded but not judged:
its damage is at most one honest contribution's worth per step.

``Verdicts`` is plain bookkeeping, the same on every honest replica (they see the same parts).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .aggregate import DROP_RATIO, ClipReport, median_of

FAR_RATIO = DROP_RATIO  # what is dropped from a step counts as far
WINDOW = 5
CONVICT_OF = 3
# a contribution *opposed* to the others: its cosine with the robust centre under half the median
# cosine of the step's contributions (honest ones cluster: 0.2-0.9 in the built-in model's runs,
# a sign flip sits near 0 or below); convicted when opposed in OPPOSED_OF of the last WINDOW steps
OPPOSED_SHARE = 0.5
OPPOSED_OF = 4
# a replica whose received activations or gradients were odd this step (its gate named or refused
# one: its part is then off through its neighbour's fault) is not judged for the step, at most
# EXCUSES times in its last EXCUSE_WINDOW judged steps (a liar cannot excuse itself for ever)
EXCUSES = 10
EXCUSE_WINDOW = 20


@dataclass
class Verdicts:
    far_ratio: float = FAR_RATIO
    window: int = WINDOW
    convict_of: int = CONVICT_OF
    opposed_of: int = OPPOSED_OF
    # *against*: a cosine <= 0 with the centre while the step's median is positive (what
    # ``robust_sum(drop_opposed=True)`` drops); convicted when against in ``against_of`` of the
    # last ``window`` (0: not judged apart from *opposed*)
    against_of: int = 0
    against: dict[str, deque] = field(default_factory=dict)
    opposed: dict[str, deque] = field(default_factory=dict)
    history: dict[str, deque] = field(default_factory=dict)
    convicted: dict[str, int] = field(default_factory=dict)  # peer -> the step it was convicted at
    clipped_steps: dict[str, int] = field(default_factory=dict)  # peer -> steps it was clipped in
    max_ratio: dict[str, float] = field(default_factory=dict)
    recent: dict[str, deque] = field(default_factory=dict)  # each peer's last ratios, for people
    judged_steps: dict[str, int] = field(default_factory=dict)
    recent_cos: dict[str, deque] = field(default_factory=dict)
    excuses: dict[str, deque] = field(default_factory=dict)  # peer -> the steps it was excused at

    def add(self, step: int, report: ClipReport, excused: set[str] = frozenset()) -> list[str]:
        """Records one step's report (of every bucket, merged by the caller); the peers newly convicted.
        ``excused``: the replicas that said their inputs were odd this step."""
        new = []
        mid = median_of(list(report.cos.values()))
        for peer, ratio in report.ratio.items():
            if peer in excused:
                ex = self.excuses.setdefault(peer, deque())
                while ex and ex[0] <= step - EXCUSE_WINDOW:
                    ex.popleft()
                if len(ex) < EXCUSES:
                    ex.append(step)
                    continue
            # (step, verdict) pairs: a step redone (its epoch abandoned, re-planned) is judged anew,
            # not once more: the same data's outlier judged three times is still one outlier
            h = self.history.setdefault(peer, deque(maxlen=self.window))
            o = self.opposed.setdefault(peer, deque(maxlen=self.window))
            a = self.against.setdefault(peer, deque(maxlen=self.window))
            for q in (h, o, a):
                while q and q[-1][0] >= step:
                    q.pop()
            h.append((step, ratio > self.far_ratio))
            c = report.cos.get(peer)
            o.append((step, c is not None and mid > 0 and c < OPPOSED_SHARE * mid))
            a.append((step, c is not None and mid > 0 and c <= 0.0))
            if c is not None:
                self.recent_cos.setdefault(peer, deque(maxlen=20)).append(round(c, 2))
            if ratio > 1.0:
                self.clipped_steps[peer] = self.clipped_steps.get(peer, 0) + 1
            self.max_ratio[peer] = max(self.max_ratio.get(peer, 0.0), ratio)
            self.recent.setdefault(peer, deque(maxlen=20)).append(round(ratio, 2))
            self.judged_steps[peer] = self.judged_steps.get(peer, 0) + 1
            if peer not in self.convicted and (sum(x for _, x in h) >= self.convict_of or
                                               sum(x for _, x in o) >= self.opposed_of or
                                               0 < self.against_of <= sum(x for _, x in a)):
                self.convicted[peer] = step
                new.append(peer)
        return new

    def summary(self) -> dict:
        return {"convicted": dict(self.convicted), "clipped_steps": dict(self.clipped_steps),
                "judged_steps": dict(self.judged_steps),
                "max_ratio": {p: round(r, 2) for p, r in self.max_ratio.items()},
                "recent_ratio": {p: list(r) for p, r in self.recent.items()},
                "recent_cos": {p: list(r) for p, r in self.recent_cos.items()}}


def merge(reports: list[ClipReport]) -> ClipReport:
    """One step's reports of several buckets as one: each peer's largest ratio."""
    ratio: dict[str, float] = {}
    cos: dict[str, float] = {}
    for r in reports:
        for p, x in r.ratio.items():
            ratio[p] = max(ratio.get(p, 0.0), x)
        for p, x in r.cos.items():
            cos[p] = cos.get(p, 0.0) + x / len(reports)  # the buckets' mean
    return ClipReport(max((r.radius for r in reports), default=0.0), ratio,
                      tuple(sorted(p for p, x in ratio.items() if x > 1.0)), cos)
