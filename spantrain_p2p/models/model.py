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
``[Embedding, Block x depth, LMHead]``. Its config, parameter and FLOP counts are torch-free, in
``spantrain_p2p.plan.model`` (the planner reads them); they are importable from here too.
"""
from __future__ import annotations

import functools
import threading
import importlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..plan.model import MAX_PARAMS, ModelConfig, flops_per_layer, num_params  # noqa: F401  (the config is torch-free)

SEED_STRIDE = 1_000_003  # layer i of a model seeded s is initialised from s * SEED_STRIDE + i
INIT_STD = 0.02


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
    with _SEEDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * SEED_STRIDE + i)
        return make()


# torch's generator is the process's: peers in one process (the Python API's local swarm) build their
# layers on threads of their own, and two seeds set at once mixed their draws (the same job's first
# loss came out 5.5128, 5.5409 and 5.5417 in three runs of four local peers)
_SEEDING = threading.RLock()


def build_layer_range(cfg: ModelConfig, first: int, last_exclusive: int) -> list[nn.Module]:
    """Layers ``[first, last_exclusive)`` of the reference model, equal to that slice of ``build_layers``."""
    if not 0 <= first < last_exclusive <= cfg.num_layers:
        raise ValueError(f"layer range [{first}, {last_exclusive}) is not inside [0, {cfg.num_layers})")
    return [seeded_layer(cfg.seed, i, functools.partial(_new_layer, cfg, i)) for i in range(first, last_exclusive)]


def build_layers(cfg: ModelConfig) -> list[nn.Module]:
    """The whole reference model: ``[Embedding, Block x depth, LMHead]`` (``depth + 2`` layers)."""
    return build_layer_range(cfg, 0, cfg.num_layers)


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
