"""Runs one stage's schedule for one step: F, B, W (or fused BW), sends and receives.

The schedule (``pipeline.schedule``) decides the order; this only follows the list, so GPipe,
1F1B and ZB-H1 share all the machinery. Compute runs on one worker thread so the peer's event
loop keeps serving the network (and sends overlap compute); sends are asynchronous and awaited at
the end of the step. A failed step leaves no gradient behind: the caller can redo it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import torch
from torch import nn

from . import schedule as sched
from .messages import ACT, GRAD

Recv = Callable[[str, int, int], Awaitable[torch.Tensor]]
Send = Callable[[str, int, int, torch.Tensor], Awaitable[None]]
Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (step, mb) -> (inputs, targets)


class StepFailed(RuntimeError):
    """A step could not complete; the message says why. No optimizer step was taken."""


@dataclass
class _Mb:
    inp: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    grad_out: Optional[torch.Tensor] = None
    grad_in: Optional[torch.Tensor] = None


@dataclass
class StepResult:
    losses: list[float] = field(default_factory=list)  # per micro-batch, last stage only
    compute_s: float = 0.0


class StageExecutor:
    def __init__(self, layers: list[nn.Module], is_first: bool, is_last: bool, num_microbatches: int,
                 batch: Batch, recv: Recv, send: Send, device=None, flops: Optional[dict[str, float]] = None):
        """``device`` (a profile.virtual.VirtualDevice) pads each op to ``flops[phase]`` of one micro-batch."""
        self.layers = nn.ModuleList(layers)
        self.is_first, self.is_last = is_first, is_last
        self.num_microbatches = num_microbatches
        self.batch, self.recv, self.send = batch, recv, send
        self.params = [p for p in self.layers.parameters() if p.requires_grad]
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self.device = device
        self.flops = flops or {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _compute(self, phase: str, fn, *args):
        if self.device is not None:
            flops = self.flops.get("B", 0.0) + self.flops.get("W", 0.0) if phase == "BW" else self.flops.get(phase, 0.0)
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: self.device.run(fn, *args, flops=flops, phase="B" if phase == "BW" else phase))
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- compute (worker thread) ---------------------------------------------------------------
    def _forward(self, step: int, mb: int, st: _Mb) -> Optional[float]:
        inputs, targets = self.batch(step, mb) if (self.is_first or self.is_last) else (None, None)
        x = inputs if self.is_first else st.inp
        body = self.layers[:-1] if self.is_last else self.layers
        for layer in body:
            x = layer(x)
        if self.is_last:
            loss = self.layers[-1](x, targets)
            st.out = loss / self.num_microbatches  # micro-batch gradients sum to the global-batch mean
            return float(loss.detach())
        st.out = x
        return None

    def _backward_input(self, st: _Mb) -> None:
        if self.is_first:
            return  # token ids have no gradient; W does all the work
        (st.grad_in,) = torch.autograd.grad(st.out, [st.inp], st.grad_out, retain_graph=True)

    def _backward_weight(self, st: _Mb) -> None:
        if self.params:
            torch.autograd.backward(st.out, st.grad_out, inputs=self.params)
        st.out = st.inp = None

    def _backward_full(self, st: _Mb) -> None:
        if self.is_first:
            self._backward_weight(st)
            return
        torch.autograd.backward(st.out, st.grad_out, inputs=[st.inp, *self.params])
        st.grad_in, st.out = st.inp.grad, None

    # ---- one step --------------------------------------------------------------------------------
    async def run_step(self, step: int, actions: list[sched.Action]) -> StepResult:
        mbs: dict[int, _Mb] = {}
        sends: list[asyncio.Task] = []
        result = StepResult()
        loop = asyncio.get_running_loop()
        t_compute = 0.0
        try:
            for a in actions:
                st = mbs.setdefault(a.mb, _Mb())
                op = a.op
                if op is sched.Op.RECV_F:
                    st.inp = (await self.recv(ACT, step, a.mb)).requires_grad_(True)
                elif op is sched.Op.RECV_B:
                    st.grad_out = await self.recv(GRAD, step, a.mb)
                elif op is sched.Op.SEND_F:
                    sends.append(asyncio.create_task(self.send(ACT, step, a.mb, st.out.detach())))
                elif op is sched.Op.SEND_B:
                    sends.append(asyncio.create_task(self.send(GRAD, step, a.mb, st.grad_in.detach())))
                    st.grad_in = None
                else:
                    t0 = loop.time()
                    if op is sched.Op.F:
                        loss = await self._compute("F", self._forward, step, a.mb, st)
                        if loss is not None:
                            result.losses.append(loss)
                    elif op is sched.Op.B:
                        await self._compute("B", self._backward_input, st)
                    elif op is sched.Op.W:
                        await self._compute("W", self._backward_weight, st)
                    elif op is sched.Op.BW:
                        await self._compute("BW", self._backward_full, st)
                    t_compute += loop.time() - t0
            await asyncio.gather(*sends)
        except BaseException as e:
            for t in sends:
                t.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            self.zero_grad()
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
                raise
            raise StepFailed(f"step {step} failed: {e}") from e
        result.compute_s = t_compute
        return result

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def stage_flops(layers: list[nn.Module], sample_input: torch.Tensor, targets: Optional[torch.Tensor]) -> dict[str, float]:
    """FLOPs of F, B and W of one micro-batch through these layers, counted by torch's own counter."""
    from ..profile.virtual import FlopCache

    cache = FlopCache()
    total = {"F": 0.0, "B": 0.0, "W": 0.0}
    x = sample_input
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1 and targets is not None
        args = (x, targets) if last else (x,)
        pf = cache.phase_flops(layer, args)
        total["F"] += pf["F"]
        total["B"] += pf["B"]
        # the counter's W pass (autograd to the weights alone) re-walks the input-gradient chain;
        # the weight gradients' own work is what is left once B is taken out
        total["W"] += max(0.0, pf["W"] - pf["B"])
        if not last:
            with torch.no_grad():
                x = layer(x)
    return total
