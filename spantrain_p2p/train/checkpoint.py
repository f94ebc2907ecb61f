"""Checkpoints on local disk: a stage's layers and optimizer state every K steps (the last two
kept, written atomically), and gradient dumps for tests that compare with single-process runs."""
from __future__ import annotations

import os

import torch


def write_checkpoint(directory: str, job_id: str, step: int, layers, opt, first: int, last: int) -> str:
    """Writes the state of layers [first, last) after ``step`` steps; keeps the two newest."""
    os.makedirs(directory, exist_ok=True)
    name = f"ckpt-{job_id}-layers{first}-{last}-step{step}.pt"
    path = os.path.join(directory, name)
    torch.save({"job_id": job_id, "step": step, "layers": [first, last],
                "model": [layer.state_dict() for layer in layers], "optimizer": opt.state_dict()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    old = sorted((f for f in os.listdir(directory) if f.startswith(f"ckpt-{job_id}-layers{first}-{last}-")),
                 key=lambda f: int(f.rsplit("step", 1)[1].split(".")[0]))
    for f in old[:-2]:
        os.remove(os.path.join(directory, f))
    return path


def dump_grads(directory: str, layers, first: int, step: int, peer_id: str) -> None:
    """Saves the layers' gradients of ``step`` (keys ``"{layer}.{parameter name}"``)."""
    os.makedirs(directory, exist_ok=True)
    grads = {f"{first + i}.{name}": p.grad.detach().clone() for i, layer in enumerate(layers)
             for name, p in layer.named_parameters() if p.grad is not None}
    torch.save(grads, os.path.join(directory, f"grads-step{step}-{peer_id}.pt"))
