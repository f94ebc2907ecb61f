"""Exporting a checkpoint as a transformers directory: ``spantrain export CHECKPOINT_DIR --out DIR``.

The checkpoint (``models.checkpoint``: one safetensors file per layer and step, and ``job.json``)
is read at the latest step every layer of the model is there for; an ``hf:`` model's layers are
rebuilt from the job, loaded with those states and written under their transformers names as
``model.safetensors`` with the config (untied, see ``hf_model``), so that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it. A tokenizer.json the job
names is copied beside it.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping, Optional

from ..models import state as layer_state
from ..models.checkpoint import JOB_FILE, CheckpointDir
from .spec import JobSpec, ModelHandle


def complete_step(inventory: dict[int, list[int]], num_layers: int) -> Optional[int]:
    """The latest step at which the checkpoint holds every layer, or None."""
    common = set.intersection(*(set(inventory.get(i, ())) for i in range(num_layers))) if num_layers else set()
    return max(common) if common else None


def export(checkpoint_dir: str, out_dir: str, step: Optional[int] = None) -> dict:
    """Writes the transformers directory; returns what it wrote (path, step, model, parameters)."""
    from ..models.hf_model import HFModel, is_hf

    path = os.path.join(checkpoint_dir, JOB_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{checkpoint_dir!r} holds no {JOB_FILE}: not a checkpoint written by --checkpoint-every")
    with open(path) as f:
        job = JobSpec.from_dict(json.load(f))
    if not is_hf(job.model):
        raise ValueError(f"the checkpoint's model is {job.model!r}: only transformers models (--model hf:...) "
                         f"export to a transformers directory")
    model = HFModel(job.model, job.model_args, job.seed, job.seq_len)
    ckpt = CheckpointDir(checkpoint_dir, job.fingerprint, job.optimizer)
    have = ckpt.inventory()
    best = complete_step(have, model.num_layers)
    step = best if step is None else step
    if step is None or any(step not in have.get(i, ()) for i in range(model.num_layers)):
        missing = [i for i in range(model.num_layers) if step not in have.get(i, ())]
        raise ValueError(f"the checkpoint has no step at which every layer is there (step {step}: layers "
                         f"{missing[:8]} missing); copy the other peers' files into {checkpoint_dir!r}")
    meta = model.meta_layers()
    states = {i: ckpt.load(i, step, layer_state.expected_shapes(meta[i])) for i in range(model.num_layers)}
    return {**write_transformers_dir(job, states, out_dir), "step": step}


def trained_layers(job: JobSpec, states: Mapping[int, Any]) -> list:
    """The job's model, every layer built and loaded with its state (layer index -> ``models.state``
    state: from a checkpoint, or gathered from the peers that trained it)."""
    model = ModelHandle(job)
    missing = [i for i in range(model.num_layers) if i not in states]
    if missing:
        raise ValueError(f"no state for layers {missing[:8]} of the model's {model.num_layers}")
    layers = model.build(0, model.num_layers)
    for i, layer in enumerate(layers):
        layer_state.apply(layer, None, states[i])
    return layers


def write_transformers_dir(job: JobSpec, states: Mapping[int, Any], out_dir: str) -> dict:
    """Writes the trained ``hf:`` model (``states``: every layer's) as a transformers directory:
    ``model.safetensors`` under transformers' names, ``config.json`` (untied), the job's tokenizer.json."""
    from safetensors.torch import save_file

    from ..models.hf_model import HFModel, hf_state_dict, is_hf

    if not is_hf(job.model):
        raise ValueError(f"the job's model is {job.model!r}: only transformers models (hf:...) "
                         f"export to a transformers directory")
    model = HFModel(job.model, job.model_args, job.seed, job.seq_len)
    layers = trained_layers(job, states)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in hf_state_dict(layers).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.export_config(), f, indent=2, sort_keys=True)
    if job.tokenizer.endswith(".json") and os.path.isfile(job.tokenizer):
        shutil.copyfile(job.tokenizer, os.path.join(out_dir, "tokenizer.json"))
    return {"out": out_dir, "model": job.model, "layers": model.num_layers,
            "parameters": sum(t.numel() for t in tensors.values())}
