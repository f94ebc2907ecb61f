"""The optimizer of a job, the same on every stage and in the single-process reference."""
from __future__ import annotations

import torch

from .spec import JobSpec


def make_optimizer(job: JobSpec, params) -> torch.optim.Optimizer:
    params = list(params)
    if job.optimizer == "sgd":
        return torch.optim.SGD(params, lr=job.lr)
    return torch.optim.Adam(params, lr=job.lr, foreach=True)  # one multi-tensor pass (CPU default: per tensor)
