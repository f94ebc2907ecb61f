"""A tiny user model following the layer-list contract of ``spantrain_p2p.models.model``.

Load it with ``load_user_model("spantrain_p2p.models.example_user_model:tiny_mlp", dim=32)``.
It sees one previous byte besides the current one, so it learns bigram-to-trigram statistics.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import seeded_layer


class ByteEmbed(nn.Module):
    """Token ids ``[B, T]`` -> ``[B, T, D]``: current byte, previous byte and position embeddings."""

    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.cur = nn.Embedding(vocab, dim)
        self.prev = nn.Embedding(vocab + 1, dim)  # index ``vocab`` stands for "no previous byte"
        self.pos = nn.Embedding(seq_len, dim)
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        prev = F.pad(ids[:, :-1], (1, 0), value=self.vocab)
        return self.cur(ids) + self.prev(prev) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class ResidualMLP(nn.Module):
    """``x + MLP(LayerNorm(x))``, shape-preserving."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


class Head(nn.Module):
    """``(hidden, targets)`` -> mean cross-entropy over the micro-batch."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln(hidden))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_mlp(vocab: int = 256, dim: int = 32, depth: int = 2, seq_len: int = 32, seed: int = 0) -> list[nn.Module]:
    """``[ByteEmbed, ResidualMLP x depth, Head]``; layer i initialised from ``(seed, i)``."""
    makers = [lambda: ByteEmbed(vocab, dim, seq_len)]
    makers += [lambda: ResidualMLP(dim)] * depth
    makers += [lambda: Head(dim, vocab)]
    return [seeded_layer(seed, i, make) for i, make in enumerate(makers)]
