"""What one step of a stage holds while it runs and what it gives back: shared by the event loop's
way (``executor.StageExecutor.run_step``) and the compute thread's (``lane_step``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .memory import StashMeter


class StepFailed(RuntimeError):
    """A step could not complete; the message says why. No optimizer step was taken."""


@dataclass
class _Mb:
    inp: Optional[torch.Tensor] = None  # the activation received (stages after the first)
    out: Optional[torch.Tensor] = None
    grad_out: Optional[torch.Tensor] = None
    grad_in: Optional[torch.Tensor] = None
    # per layer: its input and output (each layer's graph ends at its input: a leaf) and, after
    # B, the gradient at its output (what its W needs)
    ins: Optional[list] = None
    outs: Optional[list] = None
    gouts: Optional[list] = None
    # per layer, after B (without recomputation): what W needs to compute the weight gradients alone
    # (``split_backward``'s, or under autocast ``torch.distributed.pipelining``'s param groups: where
    # its weights meet the gradients B passed)
    groups: Optional[list] = None
    held: int = 0  # the bytes its forward keeps (``memory.StashMeter``), held until its backward is done
    meter: Optional[StashMeter] = None  # where its stash is counted: the stage's (None), or a check's own


@dataclass
class StepResult:
    losses: list[float] = field(default_factory=list)  # per micro-batch, last stage only
    compute_s: float = 0.0
    # of the compute ops' time, what the compute thread waited, runnable, for a core (a host whose
    # cores are all busy: ``osproc.core_wait_s``); None where the kernel does not say
    core_wait_s: Optional[float] = None
    # what the peer did, in order: (action, micro-batch, unix start, unix end): F/B/W/BW its compute,
    # RECV_F/RECV_B the wait for a tensor, SEND_F/SEND_B a send from its start to its delivery
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)
    stash_peak_bytes: int = 0  # the most activation bytes kept for the backward at once (``memory.StashMeter``)
