"""Checkpoints on local disk, in safetensors: one file per layer and step.

``DIR/step-00000020/layer-0003.safetensors`` holds layer 3's state after 20 steps: its parameters
and buffers and the optimizer's state of its parameters, named as ``models.state`` names them
(``p:<param>``, ``b:<buffer>``, ``o:<param>:<key>``, ``s:<run scalar>``), with the job's model fingerprint, the
optimizer, the layer and the step in the file's metadata. Every peer writes the layers it runs
(atomically: a temporary file, then a rename) and keeps the newest two steps of them; peers of one
swarm may share the directory or each keep their own. ``DIR/job.json`` is the job that trained
them: what ``spantrain export`` rebuilds the model from.

``--resume DIR`` reads it back: ``CheckpointDir`` lists what the directory holds for this job's
model (checked by fingerprint and shapes) and loads a layer's state on demand, so a peer holds
nothing in memory until a stage map gives it layers. Together with the peers' other copies, the
swarm resumes from the latest step at which every layer survives (``decide.resume_point``), on
whatever peers and stage layout the planner chooses then.

Gradient dumps (``--dump-grads``, for tests against single-process training) live here too.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .state import LayerState, is_layer_entry

log = logging.getLogger("spantrain.train")

FORMAT = "spantrain-layer-1"
KEEP_STEPS = 2
JOB_FILE = "job.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_LAYER_FILE = re.compile(r"^layer-(\d{4})\.safetensors$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def layer_path(directory: str, step: int, layer: int) -> str:
    return os.path.join(step_dir(directory, step), f"layer-{layer:04d}.safetensors")


def write_layers(directory: str, fingerprint: str, optimizer: str, step: int,
                 states: list[tuple[int, LayerState]], job: Optional[dict] = None) -> None:
    """Writes each (layer, state) after ``step`` steps, and ``job`` (the job record, which says
    what model the layers make up) as ``job.json``; keeps the newest ``KEEP_STEPS`` steps of these
    layers (other peers' layers in a shared directory are theirs to prune)."""
    os.makedirs(directory, exist_ok=True)
    if job is not None:
        raw = json.dumps(job, sort_keys=True, indent=1).encode()
        path = os.path.join(directory, JOB_FILE)
        if not os.path.exists(path) or open(path, "rb").read() != raw:
            with open(path + f".tmp{os.getpid()}", "wb") as f:
                f.write(raw)
            os.replace(path + f".tmp{os.getpid()}", path)
    for layer, state in states:
        path = layer_path(directory, step, layer)
        tensors = {name: t.detach().contiguous() for name, t in state}
        meta = {"format": FORMAT, "fingerprint": fingerprint, "optimizer": optimizer, "layer": str(layer),
                "step": str(step)}
        # Replicas of a stage sharing the directory write the same files, and prune old steps: write
        # beside the step folders (never removed) under this process's name, then move it in.
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{step}.tmp{os.getpid()}")
        save_file(tensors, tmp, metadata=meta)
        for attempt in range(5):  # another replica's pruning may take the step folder at any moment
            try:
                os.makedirs(step_dir(directory, step), exist_ok=True)
                os.replace(tmp, path)
                break
            except (FileNotFoundError, FileExistsError):  # FileExistsError: made, then removed, by others
                if attempt == 4:
                    raise
    mine = {layer for layer, _ in states}
    for old in sorted(_steps(directory))[:-KEEP_STEPS]:
        for layer in mine:
            try:
                os.remove(layer_path(directory, old, layer))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(step_dir(directory, old))  # only once every peer's files of that step are gone
        except OSError:
            pass


def _steps(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))]


class CheckpointDir:
    """The layer states a checkpoint directory holds for one model (``fingerprint``) and optimizer.
    Files of another model or optimizer, unreadable ones or ones whose shapes do not match the
    layer are left out, each said once."""

    def __init__(self, directory: str, fingerprint: str, optimizer: str):
        if not os.path.isdir(directory):
            raise ValueError(f"--resume {directory!r}: no such directory")
        self.directory, self.fingerprint, self.optimizer = directory, fingerprint, optimizer
        self._said: set[str] = set()

    def _skip(self, path: str, why: str) -> None:
        if path not in self._said:
            self._said.add(path)
            log.warning("checkpoint %s left out: %s", path, why)

    def inventory(self) -> dict[int, list[int]]:
        """Layer -> steps held for this model."""
        out: dict[int, list[int]] = {}
        for step in sorted(_steps(self.directory)):
            try:
                names = os.listdir(step_dir(self.directory, step))
            except OSError:
                continue
            for name in names:
                m = _LAYER_FILE.match(name)
                if m and self._matches(layer_path(self.directory, step, int(m.group(1))), int(m.group(1)), step):
                    out.setdefault(int(m.group(1)), []).append(step)
        return out

    def _matches(self, path: str, layer: int, step: int) -> bool:
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:
            self._skip(path, f"unreadable ({e})")
            return False
        want = {"format": FORMAT, "fingerprint": self.fingerprint, "optimizer": self.optimizer,
                "layer": str(layer), "step": str(step)}
        wrong = [k for k, v in want.items() if meta.get(k) != v]
        if wrong:
            self._skip(path, f"its {', '.join(wrong)} differ from this job's (fingerprint "
                             f"{str(meta.get('fingerprint'))[:12]} vs {self.fingerprint[:12]})")
            return False
        return True

    def load(self, layer: int, step: int, expected: dict[str, tuple[int, ...]]) -> Optional[LayerState]:
        """The state of ``layer`` after ``step`` steps, or None if the directory has no valid one;
        ``expected``: the layer's parameter and buffer shapes."""
        path = layer_path(self.directory, step, layer)
        if not os.path.exists(path) or not self._matches(path, layer, step):
            return None
        with safe_open(path, framework="pt") as f:
            state = [(name, f.get_tensor(name)) for name in sorted(f.keys())]
        got = {n: tuple(t.shape) for n, t in state if is_layer_entry(n)}
        if got != expected or any(not torch.isfinite(t).all() for _, t in state if t.is_floating_point()):
            self._skip(path, "its tensors do not match the layer's shapes, or hold NaN/inf")
            return None
        return state


def dump_grads(directory: str, layers, first: int, step: int, peer_id: str) -> None:
    """Saves the layers' gradients of ``step`` (keys ``"{layer}.{parameter name}"``)."""
    os.makedirs(directory, exist_ok=True)
    grads = {f"{first + i}.{name}": p.grad.detach().to("cpu", copy=True) for i, layer in enumerate(layers)
             for name, p in layer.named_parameters() if p.grad is not None}
    torch.save(grads, os.path.join(directory, f"grads-step{step}-{peer_id}.pt"))
