"""From clip reports to a verdict: which peer is attacking, by evidence that honest float noise does
not produce.

A contribution is *far* in a step when its distance from the robust centre is more than
``FAR_RATIO`` radii (the radius is 3 median distances and an honest replica's mean lies within about
one: far means 9 median distances or more, what scaled or random vectors give, never float noise). A peer is *convicted* when it
was far in ``CONVICT_OF`` of its last ``WINDOW`` judged steps: one odd step (a rare outlier batch)
convicts nobody. What is not far (a sign flip of an honest-sized gradient, a little-is-enough
shift) is clipped or bounded but not judged: its damage is at most one honest contribution's worth
per step.

``Verdicts`` is plain bookkeeping, the same on every honest replica (they see the same parts).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .aggregate import ClipReport

FAR_RATIO = 3.0
WINDOW = 5
CONVICT_OF = 3


@dataclass
class Verdicts:
    far_ratio: float = FAR_RATIO
    window: int = WINDOW
    convict_of: int = CONVICT_OF
    history: dict[str, deque] = field(default_factory=dict)
    convicted: dict[str, int] = field(default_factory=dict)  # peer -> the step it was convicted at
    clipped_steps: dict[str, int] = field(default_factory=dict)  # peer -> steps it was clipped in
    max_ratio: dict[str, float] = field(default_factory=dict)

    def add(self, step: int, report: ClipReport) -> list[str]:
        """Records one step's report (of every bucket, merged by the caller); the peers newly convicted."""
        new = []
        for peer, ratio in report.ratio.items():
            h = self.history.setdefault(peer, deque(maxlen=self.window))
            far = ratio > self.far_ratio
            h.append(far)
            if ratio > 1.0:
                self.clipped_steps[peer] = self.clipped_steps.get(peer, 0) + 1
            self.max_ratio[peer] = max(self.max_ratio.get(peer, 0.0), ratio)
            if peer not in self.convicted and sum(h) >= self.convict_of:
                self.convicted[peer] = step
                new.append(peer)
        return new

    def summary(self) -> dict:
        return {"convicted": dict(self.convicted), "clipped_steps": dict(self.clipped_steps),
                "max_ratio": {p: round(r, 2) for p, r in self.max_ratio.items()}}


def merge(reports: list[ClipReport]) -> ClipReport:
    """One step's reports of several buckets as one: each peer's largest ratio."""
    ratio: dict[str, float] = {}
    for r in reports:
        for p, x in r.ratio.items():
            ratio[p] = max(ratio.get(p, 0.0), x)
    return ClipReport(max((r.radius for r in reports), default=0.0), ratio,
                      tuple(sorted(p for p, x in ratio.items() if x > 1.0)))
