"""Causal LMs from ``transformers`` split into the layer contract of ``models.model``: ``--model hf:...``.

``hf:PRESET`` names a config in ``hf_presets`` (random init); ``hf:DIR`` (a spec with a ``/`` or
starting with ``.``) a local directory holding ``config.json`` and, for fine-tuning, the weights
as ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``). Nothing is ever
downloaded: a hub name with no local copy fails at once, before transformers is even imported.
``--model-arg KEY=VALUE`` overrides config fields (``seed`` picks the init seed instead).

The layers, ``[embeddings, decoder block x N, final norm + lm_head + loss]``:

- GPT-2: ``wte(ids) + wpe(0..T-1)``; ``GPT2Block``; ``ln_f``, ``lm_head``.
- Llama, Mistral, Qwen2: ``embed_tokens``; the family's decoder layer, its wrapper computing
  positions ``0..T-1`` and the rotary cos/sin with the family's rotary module (grouped-query
  attention is the block's own); the final RMSNorm, ``lm_head``.

The last layer returns the mean cross-entropy of the logits against the targets as given (they are
already the next tokens: no shift). Every block runs transformers' own code with
``attn_implementation="sdpa"`` and no mask (causal), as the whole ``*ForCausalLM`` does without
padding, so the layer list computes what the whole model computes. Dropout is set to 0 (replicas
and the single-process reference must compute the same thing).

Initialisation: layer ``i`` is built alone under the seed of ``(seed, i)`` (``seeded_layer``) and
initialised as transformers' ``_init_weights`` does: normal(0, ``initializer_range``) for linear and
embedding weights (GPT-2's residual projections ``c_proj`` scaled by ``1/sqrt(2 n_layer)``), zero
biases, unit norms. A peer holding 4 blocks of a 7B model allocates those 4 blocks only.

Tied embeddings (GPT-2; any config with ``tie_word_embeddings``): a tied weight cannot be shared by
two pipeline stages, so the layer list is *untied*: the head holds its own ``lm_head.weight``,
starting as a copy of the embedding's (its initial value, rebuilt from layer 0's seed; or the
checkpoint's embedding when the file has no ``lm_head.weight``). At step 0 the model equals the
tied one; from then on the two matrices train apart. Export must therefore write
``tie_word_embeddings: false`` and both tensors (``export_config``, ``hf_state_dict``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .hf_presets import PRESETS, SUPPORTED_TYPES, preset
from .model import seeded_layer

PREFIX = "hf:"
ATTN = "sdpa"  # the attention of every block and of the single-process model it must equal
_CONFIG_NOISE = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype")


def is_hf(spec: Any) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


@dataclass(frozen=True)
class Source:
    """Where an ``hf:`` model comes from: a preset, or a local directory (with its weight files)."""

    spec: str
    preset: Optional[str] = None
    directory: Optional[str] = None
    weight_files: tuple[str, ...] = ()  # safetensors files, in name order; () = random init


def resolve(spec: str) -> Source:
    """The source ``spec`` names; ValueError at once (nothing imported, nothing downloaded) if none.

    A target with a ``/`` or starting with ``.`` is a directory, anything else a preset name.
    """
    if not is_hf(spec):
        raise ValueError(f"model {spec!r} is not an 'hf:' spec")
    target = spec[len(PREFIX):]
    presets = ", ".join(PRESETS)
    if not target:
        raise ValueError(f"model {spec!r}: name a preset ({presets}) or a local directory after 'hf:'")
    if "/" not in target and os.sep not in target and not target.startswith("."):
        if target in PRESETS:
            return Source(spec, preset=target)
        raise ValueError(f"model {spec!r}: no local copy of {target!r} and no preset of that name (presets: "
                         f"{presets}); nothing is downloaded: put its config.json (and model.safetensors) in a "
                         f"local directory and pass hf:./DIR")
    if not os.path.isdir(target):
        raise ValueError(f"model {spec!r}: no local copy of {target!r} (no such directory here); nothing is "
                         f"downloaded: copy the model's directory (config.json, model.safetensors) to this machine")
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise ValueError(f"model {spec!r}: the directory {target!r} has no config.json")
    return Source(spec, directory=target, weight_files=_weight_files(target))


def _weight_files(directory: str) -> tuple[str, ...]:
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        return (single,)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return tuple(os.path.join(directory, os.path.basename(n)) for n in names)
    if any(os.path.isfile(os.path.join(directory, n)) for n in ("pytorch_model.bin", "model.bin")):
        raise ValueError(f"model directory {directory!r} holds pickled weights (pytorch_model.bin) only: convert "
                         f"them to model.safetensors (this runtime loads no pickles)")
    return ()


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime key the cache
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_hash(files: tuple[str, ...]) -> Optional[str]:
    """One hash of the weight files' contents (None for random init)."""
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        st = os.stat(p)
        h.update(f"{os.path.basename(p)}:{_file_sha256(os.path.realpath(p), st.st_size, st.st_mtime_ns)};".encode())
    return h.hexdigest()


# ---- the config -----------------------------------------------------------------------------------
def _no_dropout(d: dict, model_type: str) -> None:
    keys = ("attn_pdrop", "resid_pdrop", "embd_pdrop") if model_type == "gpt2" else ("attention_dropout",)
    for k in keys:
        d[k] = 0.0


def make_config(source: Source, overrides: Mapping[str, Any], seq_len: int):
    """(the transformers config the layers are built from, whether the source ties lm_head to the
    embedding). ``overrides`` must name fields of the config."""
    from transformers import CONFIG_MAPPING

    if source.preset is not None:
        model_type, base = preset(source.preset)
    else:
        with open(os.path.join(source.directory, "config.json")) as f:
            base = json.load(f)
        if not isinstance(base, dict):
            raise ValueError(f"model {source.spec!r}: config.json is not a JSON object")
        model_type = base.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model {source.spec!r}: model type {model_type!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_TYPES)})")
    cls = CONFIG_MAPPING[model_type]
    known = set(cls().to_dict()) | set(base)
    bad = sorted(k for k in overrides if k not in known)
    if bad:
        raise ValueError(f"model {source.spec!r}: --model-arg {bad[0]!r} is not a field of the {model_type} config "
                         f"(fields include: {', '.join(sorted(k for k in known if not k.startswith('_'))[:40])})")
    merged = {**base, **overrides}
    if "layer_types" in base and set(overrides) & {"num_hidden_layers", "n_layer"}:
        merged.pop("layer_types")  # derived again from the new depth
    _no_dropout(merged, model_type)
    vocab = merged.get("vocab_size", cls().vocab_size)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a preset's vocabulary resized to a tokenizer's
        v = merged.get(k, getattr(cls(), k, None))
        if isinstance(v, int) and not 0 <= v < vocab:
            merged[k] = None
    merged.pop("model_type", None)
    config = cls(**merged)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    config.tie_word_embeddings = False  # the layer list is untied (see the module's doc)
    config._attn_implementation = ATTN
    config.use_cache = False
    _check(config, model_type, source.spec, seq_len)
    return config, tied


def _check(config, model_type: str, spec: str, seq_len: int) -> None:
    positions = config.n_positions if model_type == "gpt2" else config.max_position_embeddings
    if seq_len > positions:
        raise ValueError(f"model {spec!r}: seq_len {seq_len} is over the model's {positions} positions")
    if model_type == "gpt2" and config.add_cross_attention:
        raise ValueError(f"model {spec!r}: GPT-2 with cross-attention is not a causal LM")
    window = getattr(config, "sliding_window", None)
    sliding = model_type == "mistral" or getattr(config, "use_sliding_window", False)
    if window and sliding and seq_len > window:
        raise ValueError(f"model {spec!r}: seq_len {seq_len} is over the sliding window {window} (not supported)")
    if config.num_hidden_layers < 1:
        raise ValueError(f"model {spec!r}: no decoder blocks")


# ---- the layers -----------------------------------------------------------------------------------
class _HFLayer(nn.Module):
    """A layer that knows the transformers name of each of its parameters (``hf_prefixes``)."""

    hf_prefixes: dict[str, str]

    def hf_name(self, name: str) -> str:
        for local, hf in self.hf_prefixes.items():
            if name.startswith(local):
                return hf + name[len(local):]
        raise KeyError(name)


def _check_ids(ids: torch.Tensor, positions: int) -> None:
    if ids.dim() != 2 or ids.shape[1] > positions:
        raise ValueError(f"want token ids [B, T<={positions}], got shape {tuple(ids.shape)}")


class GPT2Embeddings(_HFLayer):
    """Token ids ``[B, T]`` -> ``wte(ids) + wpe(0..T-1)``, ``[B, T, D]`` (embedding dropout is 0)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.positions = config.n_positions
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.hf_prefixes = {"wte.": "transformer.wte.", "wpe.": "transformer.wpe."}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.positions)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.wte(ids) + self.wpe(pos)


class GPT2Layer(_HFLayer):
    """One ``GPT2Block``, causal self-attention over the whole activation."""

    def __init__(self, config, index: int) -> None:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        super().__init__()
        self.block = GPT2Block(config, layer_idx=index)
        self.hf_prefixes = {"block.": f"transformer.h.{index}."}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class GPT2Head(_HFLayer):
    """``ln_f``, ``lm_head`` (untied) and the mean cross-entropy against the targets."""

    def __init__(self, config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.hf_prefixes = {"ln_f.": "transformer.ln_f.", "lm_head.": "lm_head."}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _loss(self.logits(hidden), targets)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """As transformers' causal-LM loss with the labels already shifted: fp32 logits, mean over tokens."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _llama_classes(model_type: str):
    """(decoder layer, RMSNorm, rotary embedding) classes of a Llama-style family."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type].removesuffix("ForCausalLM")
    return (getattr(mod, f"{prefix}DecoderLayer"), getattr(mod, f"{prefix}RMSNorm"),
            getattr(mod, f"{prefix}RotaryEmbedding"))


class TokenEmbeddings(_HFLayer):
    """Token ids ``[B, T]`` -> ``embed_tokens(ids)`` (positions are rotary, inside each block)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.positions = config.max_position_embeddings
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.hf_prefixes = {"embed_tokens.": "model.embed_tokens."}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.positions)
        return self.embed_tokens(ids)


class RotaryDecoderLayer(_HFLayer):
    """One Llama/Mistral/Qwen2 decoder layer; computes what it needs from the activation alone:
    positions ``0..T-1`` and their rotary cos/sin (the family's own rotary module), causal attention."""

    def __init__(self, config, index: int, model_type: str) -> None:
        super().__init__()
        layer_cls, _, rotary_cls = _llama_classes(model_type)
        self.layer = layer_cls(config, index)
        self.rotary_emb = rotary_cls(config=config)
        self.hf_prefixes = {"layer.": f"model.layers.{index}."}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary_emb(x, pos)
        return self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)


class RMSNormHead(_HFLayer):
    """The final RMSNorm, ``lm_head`` and the mean cross-entropy against the targets."""

    def __init__(self, config, model_type: str) -> None:
        super().__init__()
        norm_cls = _llama_classes(model_type)[1]
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.hf_prefixes = {"norm.": "model.norm.", "lm_head.": "lm_head."}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _loss(self.logits(hidden), targets)


@torch.no_grad()
def _init_(layer: nn.Module, config, model_type: str) -> None:
    """transformers' ``_init_weights`` on one layer; every parameter must be covered."""
    from transformers.pytorch_utils import Conv1D

    std = config.initializer_range
    done: set[int] = set()
    for m in layer.modules():
        name = type(m).__name__
        if isinstance(m, (nn.Linear, Conv1D)):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm) or "RMSNorm" in name or "LayerNorm" in name:
            if getattr(m, "weight", None) is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        else:
            continue
        done.update(id(p) for p in m.parameters(recurse=False))
    if model_type == "gpt2":  # residual projections: std / sqrt(2 * n_layer), as GPT2PreTrainedModel does
        for m in layer.modules():
            if type(m).__name__ in ("GPT2Attention", "GPT2MLP"):
                nn.init.normal_(m.c_proj.weight, 0.0, std / math.sqrt(2 * config.n_layer))
    missing = [n for n, p in layer.named_parameters() if id(p) not in done]
    if missing:
        raise ValueError(f"{type(layer).__name__}: no initialisation known for {missing[:4]}")


# ---- the model ------------------------------------------------------------------------------------
class HFModel:
    """An ``hf:`` model resolved to a config: builds any range of its layers, loads their weights."""

    def __init__(self, spec: str, model_args: Mapping[str, Any], seed: int, seq_len: int) -> None:
        args = dict(model_args)
        self.seed = int(args.pop("seed", seed))
        self.source = resolve(spec)
        self.config, self.tied = make_config(self.source, args, seq_len)
        self.model_type = self.config.model_type

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers + 2

    def describe(self) -> dict:
        """What the job's fingerprint covers besides the parameter shapes: config, weights, tying."""
        cfg = {k: v for k, v in self.config.to_dict().items() if k not in _CONFIG_NOISE}
        return {"config": cfg, "weights": weights_hash(self.source.weight_files), "tied": self.tied,
                "seed": self.seed}

    def export_config(self) -> dict:
        """config.json of an exported directory (untied: write ``lm_head.weight`` too)."""
        d = self.config.to_dict()
        d["tie_word_embeddings"] = False
        d["architectures"] = [_causal_lm_name(self.model_type)]
        return d

    def _new_layer(self, i: int) -> nn.Module:
        c, t = self.config, self.model_type
        if i == 0:
            layer = GPT2Embeddings(c) if t == "gpt2" else TokenEmbeddings(c)
        elif i == self.num_layers - 1:
            layer = GPT2Head(c) if t == "gpt2" else RMSNormHead(c, t)
        else:
            layer = GPT2Layer(c, i - 1) if t == "gpt2" else RotaryDecoderLayer(c, i - 1, t)
        _init_(layer, c, t)
        return layer

    def _layer(self, i: int) -> nn.Module:
        return seeded_layer(self.seed, i, functools.partial(self._new_layer, i))

    def meta_layers(self) -> list[nn.Module]:
        """Every layer on the meta device: shapes, no memory, no weights read."""
        with torch.device("meta"):
            return [self._new_layer(i) for i in range(self.num_layers)]

    def build(self, first: int, last_exclusive: int) -> list[nn.Module]:
        """Layers ``[first, last_exclusive)``, each built alone from ``(seed, i)``, then loaded from the
        directory's weights if it has any."""
        n = self.num_layers
        if not 0 <= first < last_exclusive <= n:
            raise ValueError(f"layer range [{first}, {last_exclusive}) is not inside [0, {n})")
        layers = [self._layer(i) for i in range(first, last_exclusive)]
        if self.source.weight_files:
            self._load(layers, first)
        elif self.tied and last_exclusive == n:  # the head starts as a copy of the embedding
            emb = layers[0] if first == 0 else self._layer(0)
            head = layers[-1]
            if not head.lm_head.weight.is_meta:
                with torch.no_grad():
                    head.lm_head.weight.copy_(_token_embedding(emb).weight)
        for layer in layers:
            layer.train()
        return layers

    def _load(self, layers: list[nn.Module], first: int) -> None:
        from safetensors import safe_open

        where: dict[str, str] = {}
        for path in self.source.weight_files:
            with safe_open(path, framework="pt") as f:
                where.update({k: path for k in f.keys()})
        embed_key = "transformer.wte.weight" if self.model_type == "gpt2" else "model.embed_tokens.weight"
        wanted: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        for layer in layers:
            for name, p in layer.named_parameters():
                if p.is_meta:
                    continue
                key = layer.hf_name(name)
                cands = [key, key.split(".", 1)[1]]  # saved by the *ForCausalLM, or by the bare model
                if key == "lm_head.weight":
                    cands += [embed_key, embed_key.split(".", 1)[1]]  # tied: the file has the embedding only
                found = next((k for k in cands if k in where), None)
                if found is None:
                    raise ValueError(f"model {self.source.spec!r}: the weights have no tensor {key!r}")
                wanted.setdefault(where[found], []).append((found, p))
        for path, items in wanted.items():
            with safe_open(path, framework="pt") as f, torch.no_grad():
                for key, p in items:
                    t = f.get_tensor(key)
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"model {self.source.spec!r}: tensor {key!r} has shape {tuple(t.shape)}, "
                                         f"the config makes it {tuple(p.shape)}")
                    p.copy_(t.to(p.dtype))


def _token_embedding(layer: nn.Module) -> nn.Embedding:
    return layer.wte if isinstance(layer, GPT2Embeddings) else layer.embed_tokens


def _causal_lm_name(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def hf_state_dict(layers: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The layers' parameters under their transformers names (``*ForCausalLM``), for export."""
    return {layer.hf_name(n): p.detach() for layer in layers for n, p in layer.named_parameters()}


def full_model(model: HFModel, layers: list[nn.Module]):
    """The whole transformers ``*ForCausalLM`` of the config, holding ``layers``' weights (untied):
    what single-process transformers training of the same model starts from."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(model.config, attn_implementation=ATTN)
    missing, unexpected = lm.load_state_dict(hf_state_dict(layers), strict=False)
    if missing or unexpected:
        raise ValueError(f"the layers do not fill the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return lm
