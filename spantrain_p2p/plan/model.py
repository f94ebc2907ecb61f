"""The reference transformer described without torch: its shape, parameter and FLOP counts.

What the planner needs to know of the model, computed from the config alone, nothing built:
``ModelConfig`` (validated; ``from_dict`` for untrusted data), ``num_params`` (and the parts
it adds up: embedding, one block, head) and ``flops_per_layer``. ``spantrain_p2p.models.model``
builds the layers themselves from the same config.

The reference model is a byte-level, decoder-only, pre-LN transformer:
``[Embedding, Block x depth, LMHead]``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..net.framing import strict_from_dict

MAX_PARAMS = 4 << 30  # a config above this many parameters is refused as absurd

# name -> (lowest, highest) allowed value; every field is an int
_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab": (2, 1 << 20),
    "dim": (1, 1 << 15),
    "depth": (1, 1024),
    "heads": (1, 1024),
    "seq_len": (1, 1 << 16),
    "mlp_ratio": (1, 64),
    "seed": (0, (1 << 32) - 1),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of the reference transformer; validated on construction."""

    vocab: int = 256  # byte-level
    dim: int = 64
    depth: int = 4  # number of transformer blocks
    heads: int = 4
    seq_len: int = 32
    mlp_ratio: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name, (lo, hi) in _BOUNDS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"model config field {name!r} must be an int, got {type(v).__name__}")
            if not lo <= v <= hi:
                raise ValueError(f"model config field {name!r}={v} is outside [{lo}, {hi}]")
        if self.dim % self.heads:
            raise ValueError(f"model config dim={self.dim} is not divisible by heads={self.heads}")
        if (n := num_params(self)) > MAX_PARAMS:
            raise ValueError(f"model config has {n:,} parameters, over the {MAX_PARAMS:,} limit")

    @property
    def num_layers(self) -> int:
        """Length of the layer list: embedding, ``depth`` blocks, head."""
        return self.depth + 2

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ModelConfig:
        """Builds a config from untrusted data (e.g. off the network): all fields required, else ValueError."""
        return strict_from_dict(cls, d, "model config")


def embed_params(cfg: ModelConfig) -> int:
    """Token and position embeddings."""
    return cfg.vocab * cfg.dim + cfg.seq_len * cfg.dim


def block_params(cfg: ModelConfig) -> int:
    """One transformer block: two LayerNorms, QKV and output projections, the MLP."""
    d, h = cfg.dim, cfg.dim * cfg.mlp_ratio
    return 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)


def head_params(cfg: ModelConfig) -> int:
    """The final LayerNorm and the projection to the vocabulary."""
    return 2 * cfg.dim + cfg.dim * cfg.vocab + cfg.vocab


def num_params(cfg: ModelConfig) -> int:
    """Parameter count of the reference model (computed, nothing built)."""
    return embed_params(cfg) + cfg.depth * block_params(cfg) + head_params(cfg)


def flops_per_layer(cfg: ModelConfig, micro_batch: int) -> list[float]:
    """Rough forward FLOPs of each layer for ``micro_batch`` sequences of ``cfg.seq_len`` tokens.

    Matmuls count 2 FLOPs per weight per token; attention adds ``QK^T`` and ``AV``
    (``4 * T * D`` per token, as computed without exploiting the causal mask). Backward is about 2x.
    """
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive int, got {micro_batch!r}")
    tokens = micro_batch * cfg.seq_len
    d = cfg.dim
    embed = float(tokens * d)  # a lookup and an add
    block = 2.0 * (4 * d * d + 2 * cfg.mlp_ratio * d * d) * tokens + 4.0 * tokens * cfg.seq_len * d
    head = 2.0 * d * cfg.vocab * tokens
    return [embed] + [block] * cfg.depth + [head]
