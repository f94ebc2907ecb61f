"""The optimizer of a job, the same on every stage and in the single-process reference."""
from __future__ import annotations

import torch

from .spec import JobSpec


def make_optimizer(job: JobSpec, params) -> torch.optim.Optimizer:
    params = list(params)
    if job.offload_optimizer:  # the same optimizer, stepping host copies (job.offload)
        from dataclasses import replace

        from .offload import HostOffloaded

        return HostOffloaded(params, lambda masters: make_optimizer(replace(job, offload_optimizer=False), masters))
    if job.optimizer == "sgd":
        return torch.optim.SGD(params, lr=job.lr)
    if job.optimizer == "adam8bit":
        return adam8bit(params, job.lr)
    return torch.optim.Adam(params, lr=job.lr, foreach=True)  # one multi-tensor pass (CPU default: per tensor)


def adam8bit(params, lr: float) -> torch.optim.Optimizer:
    """torchao's Adam8bit (no weight decay, as ``torch.optim.Adam``): both moments of a tensor of
    4,096 values or more kept as 8-bit codes with one fp32 scale per block of 256 (dynamic tree
    quantization, as bitsandbytes), the step computed in fp32 and compiled once per parameter shape.
    torchao is a well-kept library made for it (pytorch/ao); the compile needs a C++ compiler."""
    import warnings

    with warnings.catch_warnings():  # its import warns about optional CUDA kernels this machine lacks
        warnings.simplefilter("ignore")
        from torchao.optim import Adam8bit
    return Adam8bit(params, lr=lr)
