"""The outer optimizer of islands (DiLoCo), for the layers one peer holds: pure tensor arithmetic.

Each island trains its round with the inner optimizer; at a round's end a peer takes its layers'
*progress* over the round (weights now minus weights at the round's start), and the islands
exchange it compressed as the pseudo-gradient ``-progress`` (``plan.islands``). Rounds overlap the
exchange (the delayed merge): the pseudo-gradients of round ``r`` travel while round ``r + 1``
computes; at the end of round ``r + 1`` every island applies them to the shared *anchor* with
Nesterov momentum (the same arithmetic on the same decoded values in the same order everywhere,
so every island holds the same anchor), and puts its weights at ``anchor + its progress of round
r + 1``: the local steps are replayed on top of the merged weights, none is lost, and each
island's progress enters the anchor exactly once.

What goes on the wire is encoded with error feedback (``compress.codecs.ErrorFeedback``): what the
codec drops of one round's pseudo-gradient is added to the next round's, so nothing is lost, only
delayed. Every island averages the *decoded* contributions, its own included, so they agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ..robust.aggregate import ClipReport, robust_mean

from ..compress import codecs

OUTER_LR = 0.7  # DiLoCo's outer Nesterov learning rate and momentum
OUTER_MOMENTUM = 0.9


@dataclass(frozen=True)
class Contribution:
    """One island's pseudo-gradient of one layer for one round, as everyone decodes it."""

    tokens: int
    delta: torch.Tensor  # flat float32, the layer's parameters in order


def flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters of one layer as one flat float32 vector (a copy, on the CPU)."""
    if not params:
        return torch.zeros(0)
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in params])


def unflat_(params: Sequence[torch.Tensor], vec: torch.Tensor) -> None:
    """Writes ``vec`` (``flat``'s layout) into ``params`` in place."""
    i = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(vec[i:i + n].view_as(p).to(p.dtype))
            i += n


class OuterLayers:
    """The outer state of one peer's layers: the anchor (the islands' shared weights), the weights
    at the last round's end (``base``), Nesterov momentum, and the error feedback of the exchange.
    ``layers``: the parameter lists of the layers, by layer index."""

    def __init__(self, layers: Mapping[int, Sequence[torch.Tensor]], codec: str, lr: float = OUTER_LR,
                 momentum: float = OUTER_MOMENTUM, robust: bool = False):
        codecs.parse_spec(codec)
        self.codec, self.lr, self.mu = codec, lr, momentum
        self.robust = robust  # CenteredClip of the islands' pseudo-gradients (``robust.aggregate``)
        self.reports: list[ClipReport] = []  # each robust merge's, per layer (ratios by position in the round)
        self.params = {i: list(ps) for i, ps in layers.items()}
        self.anchor = {i: flat(ps) for i, ps in self.params.items()}
        self.base = {i: a.clone() for i, a in self.anchor.items()}
        self.momentum = {i: torch.zeros_like(a) for i, a in self.anchor.items()}
        self.feedback = codecs.ErrorFeedback()
        self.merged_rounds = 0

    def sizes(self) -> dict[int, int]:
        return {i: a.numel() for i, a in self.anchor.items()}

    def progress(self) -> dict[int, torch.Tensor]:
        """Each layer's weights now minus its weights at the last round's end."""
        return {i: flat(ps) - self.base[i] for i, ps in self.params.items()}

    def encode(self, progress: Mapping[int, torch.Tensor]) -> dict[int, tuple[dict, list, torch.Tensor]]:
        """Each layer's pseudo-gradient (``-progress``) encoded with error feedback: (meta, buffers,
        the decoded tensor every island will use)."""
        out = {}
        for i, p in progress.items():
            meta, bufs = self.feedback.encode(i, self.codec, -p)
            dec = codecs.decode(meta, [bytes(b) for b in bufs], (p.numel(),), max_bytes=1 << 40)
            out[i] = (meta, bufs, dec.reshape(-1))
        return out

    def merge(self, contributions: Mapping[int, Sequence[Contribution]]) -> None:
        """Applies one round's contributions (per layer, in island order) to the anchor: their
        token-weighted average as the outer gradient, Nesterov momentum, outer learning rate."""
        for i, contribs in contributions.items():
            tokens = sum(c.tokens for c in contribs)
            if tokens <= 0:
                continue
            if self.robust:  # each island's pseudo-gradient is judged as it is (a round's progress)
                g, report = robust_mean({f"{j:04d}": c.delta * c.tokens for j, c in enumerate(contribs)},
                                        {f"{j:04d}": float(c.tokens) for j, c in enumerate(contribs)},
                                        drop_opposed=True)
                self.reports.append(report)
            else:
                g = torch.zeros_like(self.anchor[i])
                for c in contribs:
                    g.add_(c.delta, alpha=c.tokens / tokens)
            m = self.momentum[i].mul_(self.mu).add_(g)
            self.anchor[i].sub_(g.add(m, alpha=self.mu), alpha=self.lr)
        self.merged_rounds += 1

    def replay(self, progress: Mapping[int, torch.Tensor]) -> None:
        """Puts each layer at ``anchor + progress`` (the local steps since the last round's end on
        top of the merged weights) and makes that the new base."""
        for i, ps in self.params.items():
            new = self.anchor[i] + progress[i]
            unflat_(ps, new)
            self.base[i] = new

    def reset_to_anchor(self) -> None:
        """The end of the run: every island's weights become the anchor."""
        for i, ps in self.params.items():
            unflat_(ps, self.anchor[i])
            self.base[i] = self.anchor[i].clone()

    def state(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """(anchor, momentum) per layer: what a peer that takes these layers over starts from."""
        return {i: (self.anchor[i].numpy().copy(), self.momentum[i].numpy().copy()) for i in self.anchor}

    def load(self, layer: int, anchor: torch.Tensor, momentum: torch.Tensor, keep_feedback: bool = False) -> None:
        """Starts ``layer`` from a saved outer state: weights, anchor and base at ``anchor``; the
        exchange's error feedback is cleared, unless ``keep_feedback`` (a round merged elsewhere:
        this island's own contribution was in it, and its replicas' feedback must stay alike)."""
        if anchor.shape != self.anchor[layer].shape or momentum.shape != anchor.shape:
            raise ValueError(f"outer state of layer {layer} has {anchor.numel()} values, the layer "
                             f"{self.anchor[layer].numel()}")
        self.anchor[layer] = anchor.clone()
        self.base[layer] = anchor.clone()
        self.momentum[layer] = momentum.clone()
        unflat_(self.params[layer], anchor)
        if not keep_feedback:
            self.feedback.clear(layer)
