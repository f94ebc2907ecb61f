"""Named transformers configs for ``--model hf:PRESET``: data, not code, and nothing downloaded.

A preset is a model type and the config fields that differ from that type's defaults; the
weights are random, initialised per layer from ``(seed, i)`` (see ``hf_model``). The tiny ones
train on a CPU in tests (hidden 64, vocab 256 = byte tokens); the others give the shapes of the
real models (GPT-2 small to XL, a Llama-2-7B-class Llama) for planning and GPU runs: only a
config, never allocated here.

Torch-free and transformers-free, so the CLI can list presets and refuse a bad spec at once.
"""
from __future__ import annotations

from typing import Any

# model types whose causal LM this runtime can split into layers (hf_model.FAMILIES)
SUPPORTED_TYPES = ("gpt2", "llama", "mistral", "qwen2")

_TINY_LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 2,  # grouped-query attention
               "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # tiny: tests and CPU demos (byte tokens: vocab 256)
    "gpt2-tiny": ("gpt2", {"vocab_size": 256, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 256}),
    "llama-tiny": ("llama", dict(_TINY_LLAMA)),
    "qwen2-tiny": ("qwen2", dict(_TINY_LLAMA)),  # Llama-shaped blocks with q/k/v biases
    "mistral-tiny": ("mistral", {**_TINY_LLAMA, "sliding_window": 256}),
    # real shapes (the configs of the published models; random init unless loaded from a directory)
    "gpt2": ("gpt2", {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}),
    "gpt2-medium": ("gpt2", {"vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 1024}),
    "gpt2-large": ("gpt2", {"vocab_size": 50257, "n_embd": 1280, "n_layer": 36, "n_head": 20, "n_positions": 1024}),
    "gpt2-xl": ("gpt2", {"vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 25, "n_positions": 1024}),
    "llama-7b": ("llama", {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
}


def preset(name: str) -> tuple[str, dict[str, Any]]:
    """(model type, config fields) of preset ``name``; KeyError if there is none."""
    model_type, fields = PRESETS[name]
    return model_type, dict(fields)
