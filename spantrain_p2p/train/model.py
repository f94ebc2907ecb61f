"""The model as a list of layers, so a pipeline can cut it between any two of them.

Contract for any model (the reference one here or a user's, see ``load_user_model``):

- the model is a non-empty ``list[nn.Module]``; a stage of the pipeline runs a contiguous slice;
- the first layer takes the input batch tensor (e.g. token ids, LongTensor ``[B, T]``);
- each middle layer maps one activation tensor to one activation tensor;
- the last layer takes ``(activation, targets)`` and returns a scalar loss, the mean over the
  micro-batch (so micro-batch losses average into the global-batch loss);
- layer ``i`` must be built the same way on every peer: initialise it from a seed derived from
  ``(seed, i)``, never from whatever the global RNG holds when a peer happens to build it.

The reference model is a byte-level, decoder-only, pre-LN transformer:
``[Embedding, Block x depth, LMHead]``.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

SEED_STRIDE = 1_000_003  # layer i of a model seeded s is initialised from s * SEED_STRIDE + i
MAX_PARAMS = 4 << 30  # a config above this many parameters is refused as absurd
INIT_STD = 0.02

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
        if not isinstance(d, Mapping):
            raise ValueError(f"model config must be a map, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ValueError(f"model config has unknown fields {sorted(map(str, unknown))[:8]}")
        missing = known - set(d)
        if missing:
            raise ValueError(f"model config lacks fields {sorted(missing)}")
        return cls(**d)


def num_params(cfg: ModelConfig) -> int:
    """Parameter count of the reference model (computed, nothing built)."""
    d, h = cfg.dim, cfg.dim * cfg.mlp_ratio
    embed = cfg.vocab * d + cfg.seq_len * d
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    head = 2 * d + d * cfg.vocab + cfg.vocab
    return embed + cfg.depth * block + head


def _init_(module: nn.Module) -> None:
    """GPT-2 style init: normal(0, 0.02) weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=INIT_STD)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class Embedding(nn.Module):
    """Token ids ``[B, T]`` -> hidden ``[B, T, D]``: token plus learned position embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] > self.seq_len:
            raise ValueError(f"want token ids [B, T<={self.seq_len}], got shape {tuple(ids.shape)}")
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention then MLP, each residual. ``[B,T,D]->[B,T,D]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final LayerNorm and projection to the vocabulary; ``forward`` returns the mean cross-entropy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(hidden))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(hidden)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _new_layer(cfg: ModelConfig, i: int) -> nn.Module:
    layer = Embedding(cfg) if i == 0 else LMHead(cfg) if i == cfg.num_layers - 1 else Block(cfg)
    _init_(layer)
    return layer


def seeded_layer(seed: int, i: int, make: Callable[[], nn.Module]) -> nn.Module:
    """Runs ``make()`` under the RNG seed of layer ``i`` without disturbing the caller's RNG state.

    Helper for user models too: it makes layer ``i`` the same whichever layers a peer builds.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * SEED_STRIDE + i)
        return make()


def build_layer_range(cfg: ModelConfig, first: int, last_exclusive: int) -> list[nn.Module]:
    """Layers ``[first, last_exclusive)`` of the reference model, equal to that slice of ``build_layers``."""
    if not 0 <= first < last_exclusive <= cfg.num_layers:
        raise ValueError(f"layer range [{first}, {last_exclusive}) is not inside [0, {cfg.num_layers})")
    return [seeded_layer(cfg.seed, i, functools.partial(_new_layer, cfg, i)) for i in range(first, last_exclusive)]


def build_layers(cfg: ModelConfig) -> list[nn.Module]:
    """The whole reference model: ``[Embedding, Block x depth, LMHead]`` (``depth + 2`` layers)."""
    return build_layer_range(cfg, 0, cfg.num_layers)


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


def load_user_model(spec: str, **kwargs: Any) -> list[nn.Module]:
    """Imports ``"package.module:function"``, calls it with ``kwargs`` and checks it returns layers."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"model spec {spec!r} must look like 'package.module:function'")
    mod_name, fn_name = spec.split(":")
    if not mod_name or not fn_name:
        raise ValueError(f"model spec {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"model spec {spec!r}: cannot import {mod_name!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"model spec {spec!r}: {mod_name!r} has no callable {fn_name!r}")
    layers = fn(**kwargs)
    if not isinstance(layers, list) or not layers:
        got = type(layers).__name__ if layers else "an empty list"
        raise ValueError(f"model spec {spec!r} returned {got}, want a non-empty list of nn.Module")
    bad = [i for i, m in enumerate(layers) if not isinstance(m, nn.Module)]
    if bad:
        raise ValueError(f"model spec {spec!r}: items {bad[:8]} of the returned list are not nn.Module")
    return layers
