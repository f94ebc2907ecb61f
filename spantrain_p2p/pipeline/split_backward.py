"""A zero-bubble schedule's backward in two parts, B and W, without walking the graph twice.

B computes the gradient at a layer's input; W, later, the gradients of its weights. Autograd has no
such split of its own: ``torch.distributed.pipelining`` keeps B's graph (``retain_graph``), finds
in Python, per micro-batch, the nodes where each weight enters it, and in W runs autograd again
from there. Here, as the ZB paper's own Megatron code does, a linear layer's weight gradient is
left as the two tensors it is the product of: in B the layer's backward computes the gradient at
its input alone and hands its input and the gradient at its output to the micro-batch's list
(``Deferral``); W multiplies them. B's graph is let go as B ends. Every other weight (a norm's,
an embedding's) gets its gradient in B's one pass, returned to the caller rather than summed into
``.grad``, which W then does: B still leaves the weights' gradients as they were (a spot check runs
B alone), and W sums each weight's micro-batches in the order the schedule gives. The products are
the ones autograd's own ``addmm`` backward computes, so the weight gradients are equal bit for bit
to one fused backward's (tests/test_split_backward.py); a weight that a layer also uses outside its
linear layer gets its parts summed in another order (equal up to float rounding).

``install`` puts the split into a stage's ``nn.Linear`` modules (their class exactly: a subclass may
compute otherwise), through an instance ``forward``: a forward outside B's reach, or one run before
the install, leaves a plain graph, whose weight gradients B's pass returns like any other's, so the
result is the same whichever way a forward went. Only for float32 without recomputation: autocast
and checkpoints keep autograd's own split (``executor``).
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class Deferral:
    """Where the linear layers of one stage put their weight gradients' factors while a B runs:
    ``into`` is that B's list (None: compute them at once, as autograd would)."""

    def __init__(self) -> None:
        self.into: Optional[list] = None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, deferral):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.deferral = module, deferral
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        _, want_w, want_b = ctx.needs_input_grad[:3]
        if not (want_w or want_b):  # a frozen layer: no weight gradient to compute, now or in W
            return gx, None, None, None, None
        into = ctx.deferral.into
        if into is not None:
            into.append((ctx.module, x, gy))
            return gx, None, None, None, None
        return (gx, *linear_weight_grads(x, gy, want_w, want_b), None, None)


def linear_weight_grads(x: torch.Tensor, gy: torch.Tensor, want_w: bool,
                        want_b: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The gradients of a linear layer's weight and bias (those wanted, else None) from its input
    ``x`` and the gradient at its output ``gy``: the products ``addmm``'s backward computes (equal to
    its bit for bit)."""
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    return (g2.t().mm(x2) if want_w else None), (g2.sum(0) if want_b else None)


def _split_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _Linear.apply(x, self.weight, self.bias, self, self._spantrain_deferral)


def install(layers: list[nn.Module], deferral: Deferral) -> int:
    """Gives every ``nn.Linear`` (exactly) among ``layers`` the split backward; returns how many."""
    n = 0
    for layer in layers:
        for m in layer.modules():
            if type(m) is nn.Linear and "forward" not in m.__dict__:
                m._spantrain_deferral = deferral
                m.forward = types.MethodType(_split_forward, m)
                n += 1
    return n


def input_backward(deferral: Deferral, out: torch.Tensor, inp: torch.Tensor, params: list[torch.Tensor],
                   grad: Optional[torch.Tensor]) -> tuple[torch.Tensor, tuple[list, list]]:
    """B of one layer: the gradient at ``inp`` (from ``grad`` at ``out``), and what W needs for
    ``params``: (their gradients computed now, the linear layers' factors)."""
    factors: list = []
    deferral.into = factors
    try:
        got = torch.autograd.grad(out, [inp, *params], grad, allow_unused=True)
    finally:
        deferral.into = None
    return got[0], ([(p, g) for p, g in zip(params, got[1:]) if g is not None], factors)


def weight_backward(held: tuple[list, list]) -> None:
    """W of one layer, from what its B left (``input_backward``): sums into each weight's ``.grad``."""
    ready, factors = held
    with torch.no_grad():  # (the factors' inputs are a graph's tensors)
        _sum_into(ready, factors)


def _sum_into(ready: list, factors: list) -> None:
    for p, g in ready:  # (autograd's may share memory with another tensor: a first one is copied)
        _accumulate(p, g, fresh=False)
    for module, x, gy in factors:
        bias = module.bias
        gw, gb = linear_weight_grads(x, gy, module.weight.requires_grad, bias is not None and bias.requires_grad)
        if gw is not None:
            _accumulate(module.weight, gw)
        if gb is not None:
            _accumulate(bias, gb)


def _accumulate(p: torch.Tensor, g: torch.Tensor, fresh: bool = True) -> None:
    """As autograd sums a gradient into a leaf (outside grad mode): the first is kept (``fresh``: it
    is no other tensor's; else a copy of it), the rest added."""
    if p.grad is None:
        p.grad = g if fresh else g.clone(memory_format=torch.contiguous_format)
    else:
        p.grad += g
