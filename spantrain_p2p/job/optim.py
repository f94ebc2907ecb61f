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
    return torch.optim.Adam(params, lr=job.lr, **adam_kernel(params))


# torch's fused Adam kernel: these devices and dtypes (``torch.optim.Adam(fused=True)`` refuses others)
FUSED_DEVICES = ("cpu", "cuda")
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def adam_kernel(params) -> dict:
    """How ``torch.optim.Adam`` steps ``params``: its fused kernel (one pass over each tensor)
    where every parameter is a dense float on the CPU or a CUDA device, else ``foreach`` (one
    multi-tensor op per update term; torch's CPU default is per tensor). On this 2-core box, one
    thread, the 235,136 parameters of cee-3region's stage (54 tensors) stepped in 0.435-0.467 ms
    fused against 1.32-3.07 ms foreach and 2.18-4.86 per tensor (``scripts/optimizer_step.py``, four
    runs, 2026-12-01 06:49-08:43 UTC), where a cee-3region step spent 2.8-18.5 ms of its ~105 in
    ``foreach``'s step (04:50). The kernels differ in the last bits; every peer and the
    single-process reference use the same one."""
    ok = all(p.device.type in FUSED_DEVICES and p.dtype in FUSED_DTYPES and not p.is_sparse for p in params)
    return {"fused": True} if ok and params else {"foreach": True}


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
