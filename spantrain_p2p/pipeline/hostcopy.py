"""Tensors leaving a CUDA device for the wire, copied while the device computes on.

A plain ``t.to("cpu")`` on the event loop waits for every kernel queued so far, so the loop (and
every transfer it serves) stalls behind the stage's compute. Here a copy is queued on a side CUDA
stream, after the kernels that produce the tensor, into pinned host memory (torch's caching host
allocator keeps those buffers), and an event marks its end; the send awaits the event by polling
it from the loop, never synchronizing the device. On the CPU the tensor is already in host memory
and nothing happens; other accelerators take a plain copy.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import torch

POLL_S = 0.0002  # how often a waiting send looks at its copy's event


class HostCopier:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, t: torch.Tensor) -> tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
        """Begins copying ``t`` to host memory: (the host tensor, the event its copy ends with, or
        None if it is there already). Call on the thread that queued ``t``'s kernels, or after
        them; ``t`` may be freed by its owner at once (the copy stream holds on to it)."""
        if t.device.type == "cpu":
            return t, None
        if self.stream is None or t.device.type != "cuda":
            return t.to("cpu"), None
        return self.copy(t), self.mark()

    # ---- many tensors, one event (a stage's state after a step: ``models.state.capture``) -----------
    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of CUDA tensor ``t``, queued after every kernel queued so far on the current
        stream (``t`` may be a temporary made just now: a conversion, a dequantized state) and
        complete once ``mark``'s event is: read it on the host only after that; ``t`` may change on
        the device once the device's stream waits for that event."""
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)
        return host

    def mark(self) -> "torch.cuda.Event":
        """An event that completes once every copy queued so far has."""
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    @staticmethod
    async def wait(host: torch.Tensor, done: Optional["torch.cuda.Event"]) -> torch.Tensor:
        """The host tensor once its copy is complete."""
        while done is not None and not done.query():
            await asyncio.sleep(POLL_S)
        return host
