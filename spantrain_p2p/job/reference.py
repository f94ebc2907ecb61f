"""Single-process training of a job: the reference the swarm's losses and gradients must match."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .dataset import open_data
from .spec import JobSpec, ModelHandle
from .optim import make_optimizer
from ..models.precision import COMPUTE_DTYPES


def _autocast(job: JobSpec, device_type: str):
    dtype = COMPUTE_DTYPES.get(job.precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


class _Stepper:
    """The optimizer step, through ``torch.amp.GradScaler`` for fp16 (``skipped``: the steps whose
    gradients overflowed)."""

    def __init__(self, job: JobSpec, opt, device_type: str):
        self.opt = opt
        self.scaler = torch.amp.GradScaler(device_type, init_scale=job.loss_scale) if job.precision == "fp16" else None
        self.skipped: list[int] = []
        self._unscaled = False

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self) -> None:
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.opt)
            self._unscaled = True

    def step(self, step: int) -> None:
        if self.scaler is None:
            self.opt.step()
        else:
            before = self.scaler.get_scale()
            self.unscale()
            self.scaler.step(self.opt)
            self.scaler.update()
            self._unscaled = False
            if self.scaler.get_scale() < before:
                self.skipped.append(step)
        self.opt.zero_grad(set_to_none=True)


def reference_run(job: JobSpec, steps: int, grads_at: Optional[int] = None,
                  skipped: Optional[list] = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(loss per step, {"<layer>.<param>": grad} after the backward of step ``grads_at``); the
    job's data (``dataset.open_data``) and precision (bf16, fp16: autocast, fp32 weights; fp16
    through GradScaler, whose skipped steps go to ``skipped``)."""
    batch = open_data(job).batch
    handle = ModelHandle(job)
    layers = handle.build(0, handle.num_layers)
    params = [p for layer in layers for p in layer.parameters()]
    stepper = _Stepper(job, make_optimizer(job, params), "cpu")
    losses, grads = [], {}
    M = job.num_micro_batches
    for step in range(steps):
        total = 0.0
        for mb in range(M):
            x, y = batch(step, mb)
            with _autocast(job, "cpu"):
                for layer in layers[:-1]:
                    x = layer(x)
                loss = layers[-1](x, y)
            stepper.backward(loss / M)
            total += float(loss.detach())
        losses.append(total / M)
        if step == grads_at:
            stepper.unscale()
            grads = {f"{i}.{n}": p.grad.detach().clone() for i, layer in enumerate(layers)
                     for n, p in layer.named_parameters() if p.grad is not None}
        stepper.step(step)
    if skipped is not None:
        skipped += stepper.skipped
    return losses, grads


def transformers_reference_run(job: JobSpec, steps: int, grads_at: Optional[int] = None, device: str = "cpu",
                               step_times: Optional[list] = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """As ``reference_run`` for an ``hf:`` job, but the model is transformers' whole
    ``*ForCausalLM`` (``hf_model.full_model``) starting from the same weights: what single-process
    training with plain PyTorch and transformers computes, on ``device``. Gradients are keyed as
    the swarm's (``"<layer>.<param>"``); ``step_times`` gets each step's seconds (device synced)."""
    import time
    import torch.nn.functional as F

    from ..models.hf_model import full_model

    batch = open_data(job).batch
    handle = ModelHandle(job)
    layers = handle.build(0, handle.num_layers)
    lm = full_model(handle.hf, layers).to(device)
    lm.train()
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    named = dict(lm.named_parameters())
    keys = {f"{i}.{n}": layer.hf_name(n) for i, layer in enumerate(layers) for n, _ in layer.named_parameters()}
    stepper = _Stepper(job, make_optimizer(job, lm.parameters()), dev.type)
    losses, grads = [], {}
    M = job.num_micro_batches
    for step in range(steps):
        t0 = time.perf_counter()
        total = torch.zeros((), device=dev)
        for mb in range(M):
            x, y = (t.to(dev) for t in batch(step, mb))
            with _autocast(job, dev.type):
                logits = lm(input_ids=x).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            stepper.backward(loss / M)
            total += loss.detach()
        if step == grads_at:
            stepper.unscale()
            grads = {k: named[hf].grad.detach().cpu().clone() for k, hf in keys.items() if named[hf].grad is not None}
        stepper.step(step)
        losses.append(float(total) / M)  # one device sync per step
        sync()
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
    return losses, grads
