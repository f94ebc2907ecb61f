"""Optimizer state on the host (``--offload-optimizer``): a stage's device keeps its weights and their
gradients; the optimizer steps fp32 master copies of the weights in host memory (pinned where the
device is a GPU), and the new weights are copied back.

One step: each weight and its gradient go to the host (the master is refreshed from the weight
every step, so weights set from outside, by a snapshot, a checkpoint or the islands' outer step,
are never overwritten by a stale master), the wrapped optimizer steps the masters there (its state
lives beside them), and each weight is overwritten from its master.
The arithmetic is the wrapped optimizer's on the same fp32 values, so losses equal those of the
same optimizer on the device. ``state`` reads and writes the masters' state under the device
parameters, so snapshots, buddy copies and checkpoints (``models.state``) see the state where they
always look. Written here because no library does it for a single process that is not a DeepSpeed
or FSDP job (DeepSpeed's ZeRO-Offload and FSDP's CPU offload need their engines and process groups).
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Iterator

import torch


class _StateView(MutableMapping):
    """The wrapped optimizer's state, keyed by the device parameters instead of their masters."""

    def __init__(self, owner: "HostOffloaded"):
        self._o = owner

    def __getitem__(self, p):
        return self._o.inner.state[self._o.master[p]]

    def __setitem__(self, p, value) -> None:
        m = self._o.master[p]
        self._o.inner.state[m] = {k: (v.to(m.device) if isinstance(v, torch.Tensor) and v.dim() else v)
                                  for k, v in value.items()}

    def __delitem__(self, p) -> None:
        del self._o.inner.state[self._o.master[p]]

    def __iter__(self) -> Iterator:
        by_master = {id(m): p for p, m in self._o.master.items()}
        return iter([by_master[id(m)] for m in self._o.inner.state if id(m) in by_master])

    def __len__(self) -> int:
        return len(self._o.inner.state)

    def get(self, p, default=None):
        m = self._o.master.get(p)
        return default if m is None else self._o.inner.state.get(m, default)


class HostOffloaded:
    """``make(masters)`` (an optimizer over host tensors) stepping on behalf of ``params``."""

    def __init__(self, params: list[torch.Tensor], make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        self.params = list(params)
        pin = any(p.is_cuda for p in self.params)
        self.master: dict[torch.Tensor, torch.Tensor] = {}
        for p in self.params:
            m = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
            m.copy_(p.detach())
            m.requires_grad_(True)
            self.master[p] = m
        self.inner = make([self.master[p] for p in self.params])
        self.state = _StateView(self)
        self.param_groups = self.inner.param_groups
        self.copied_bytes = 0  # what the last step moved between device and host (both ways)

    @torch.no_grad()
    def step(self) -> None:
        moved = 0
        for p in self.params:
            m = self.master[p]
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            m.copy_(p.detach())
            m.grad.copy_(p.grad)
            moved += 2 * p.numel() * p.element_size()
        self.inner.step()
        for p in self.params:
            if p.grad is not None:
                p.copy_(self.master[p])
                moved += p.numel() * p.element_size()
        self.copied_bytes = moved

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)


class _NoStep(torch.optim.Optimizer):
    """An optimizer that changes nothing: the offload's copies alone."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__(params, {})

    def step(self, closure=None) -> None:
        return None


def copies_only(params: list[torch.Tensor]) -> HostOffloaded:
    """``params`` offloaded as ``--offload-optimizer`` offloads them, stepping nothing between the
    copies: what ``profile.step_tail.copy_rate`` times (the copies' rate, which the planner charges
    them at)."""
    return HostOffloaded(params, _NoStep)
