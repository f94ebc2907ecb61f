"""Dynamic loss scaling for fp16 (``--precision fp16``), taken swarm-wide.

fp16's range is narrow: small gradients flush to zero. As with ``torch.amp.GradScaler``, the last
stage multiplies the loss by a scale S, so every gradient, the ones crossing the wire included, is
S times larger; before the optimizer step each stage divides its weight gradients by S. A step
whose gradients overflowed (inf or NaN anywhere) must be skipped: by *every* stage, or the stages'
weights stop belonging to the same model, and the scale that every stage divides by must stay the
same. One stage cannot see another's overflow (an overflow in the first stage's weight gradients
reaches nobody), so after the gradient sum each peer sends its flag to one collector (the first
peer of stage 0, the last to finish its backward), which answers every peer with the OR of all
flags: the same verdict everywhere, at the cost of one hop out and one back on the critical path
of stage 0 alone (the later stages wait for its next activations anyway). Megatron and DeepSpeed
all-reduce the same flag across their pipeline stages.

Every peer then updates the same scale from the same verdict (GradScaler's rule: halve it on an
overflow, double it after ``interval`` clean steps in a row), so the scale needs no message of its
own; it travels in layer snapshots and checkpoints (``STATE_KEYS``) so that a recovered or resumed
stage starts from the scale the others have.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

DEFAULT_INIT = 2.0 ** 16  # GradScaler's defaults
GROWTH, BACKOFF = 2.0, 0.5
DEFAULT_INTERVAL = 2000
MIN_SCALE, MAX_SCALE = 2.0 ** -24, 2.0 ** 64  # a scale outside this range is a bug or a hostile record
STATE_KEYS = ("s:loss_scale", "s:loss_scale_growth")  # entries of a layer's state (models.state)


@dataclass
class LossScale:
    """The scale and how many clean steps in a row it has seen (``update`` is GradScaler's rule)."""

    scale: float = DEFAULT_INIT
    growth_tracker: int = 0
    interval: int = DEFAULT_INTERVAL

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(MIN_SCALE, self.scale * BACKOFF)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.interval:
            self.scale = min(MAX_SCALE, self.scale * GROWTH)
            self.growth_tracker = 0

    def state(self) -> list[tuple[str, torch.Tensor]]:
        """The scale as layer-state entries (float32 holds both exactly: powers of two, and counts
        below 2^24)."""
        return [(STATE_KEYS[0], torch.tensor(self.scale, dtype=torch.float32)),
                (STATE_KEYS[1], torch.tensor(float(self.growth_tracker), dtype=torch.float32))]

    def load(self, entries: dict[str, torch.Tensor]) -> bool:
        """Takes the scale from a layer's state entries; False if they hold none (or a bad one)."""
        if not all(k in entries for k in STATE_KEYS):
            return False
        scale, growth = float(entries[STATE_KEYS[0]]), float(entries[STATE_KEYS[1]])
        if not (MIN_SCALE <= scale <= MAX_SCALE and 0 <= growth < self.interval and growth == int(growth)):
            return False
        self.scale, self.growth_tracker = scale, int(growth)
        return True


def scaled(loss: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """``loss`` times the scale, as ``GradScaler.scale`` computes it (a float32 tensor factor)."""
    return loss if scale is None else loss * torch.tensor(scale, dtype=torch.float32, device=loss.device)


def nonfinite(tensors: Iterable[Optional[torch.Tensor]]) -> bool:
    """Whether any of ``tensors`` holds an inf or a NaN."""
    return any(t is not None and not bool(torch.isfinite(t).all()) for t in tensors)


def unscale_(params: list[torch.nn.Parameter], scale: float) -> None:
    """Divides the gradients by the scale in place, as ``GradScaler.unscale_`` does (times the
    float32 reciprocal computed in float64)."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float64).float()
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inv.to(p.grad.device))


def sanitized(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(``t`` with infs and NaNs as zeros, whether it had any): an overflowed tensor still crosses
    the wire (which refuses non-finite values), and its sender's flag skips the step everywhere."""
    if bool(torch.isfinite(t).all()):
        return t, False
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0), True


def check_init(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or not MIN_SCALE <= scale <= MAX_SCALE:
        raise ValueError(f"loss scale must be a number in [2^-24, 2^64], not {scale!r}")
    return float(scale)
