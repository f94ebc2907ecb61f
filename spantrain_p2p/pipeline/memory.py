"""A stage's memory levers on its activations, and what its activations take, measured.

**Recomputation** (``RECOMPUTE``): ``none`` keeps everything a layer's forward saves for its
backward until the micro-batch's backward is done; ``full`` keeps only each layer's input and runs
the layer's forward again inside its backward, through ``torch.utils.checkpoint`` (non-reentrant:
it restores the RNG and autocast state, so dropout and bf16 recompute the same bits), one
checkpoint per layer. Under a zero-bubble schedule the input gradient (B) and the weight gradient
(W) are two backward passes, and the checkpoint recomputes the forward in each: F runs three times
where it ran once (1F1B's fused BW: twice), while nothing recomputed lives from B to W. (Selective
recomputation, torch's ``create_selective_checkpoint_contexts``, is not offered yet: it refuses a
second backward over a region, which ZB's split B and W are, keeps what it saves outside autograd's
saved tensors, where ``StashMeter`` does not see it, and its per-op dispatch took longer than full
recomputation on the tiny Llama here: 0.49 s against 0.26 s of compute.)

**The stash, measured** (``StashMeter``): what autograd keeps from a micro-batch's forward for its
backward, as it is kept: the saved-tensor hooks see every tensor saved (with a checkpoint, only its
inputs: the recomputed ones are saved under the checkpoint's own hooks during backward), counted
once per storage, the stage's parameters left out (they are the weights, counted apart).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

RECOMPUTE = ("none", "full")


def layer_call(mode: str) -> Callable:
    """How a stage calls one layer under recomputation ``mode``: ``call(layer, *args)``."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {mode!r}")
    if mode == "none":
        return lambda layer, *args: layer(*args)
    return lambda layer, *args: checkpoint(layer, *args, use_reentrant=False)


class StashMeter:
    """Counts the bytes autograd saves in a forward (``saving``), per micro-batch, and the most held
    at once over a step (``held``, ``peak``)."""

    def __init__(self, params: list[torch.Tensor]):
        self._weights = {p.untyped_storage().data_ptr() for p in params}
        self.held = 0  # bytes of the micro-batches whose backward is not done yet
        self.peak = 0  # the most held at once since ``reset``
        self.largest = 0  # the largest one micro-batch kept since ``reset``
        self._by_input: dict[tuple, int] = {}  # the stash measured for each input's shape (``known``)

    def reset(self) -> None:
        self.held = self.peak = self.largest = 0

    @contextlib.contextmanager
    def saving(self, into: dict[int, int]):
        """Within it, every tensor autograd saves is recorded in ``into`` (storage -> bytes)."""
        weights = self._weights

        def pack(t: torch.Tensor):
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in weights and ptr:
                into[ptr] = s.nbytes()
            # kept without its autograd history: a saved output kept as itself is a reference cycle
            # (tensor -> its grad_fn -> the saved tensor) that Python's collector cannot see through, so
            # a graph that a backward leaves (retain_graph, as B does) was never freed. On an H100 a
            # replica's spot checks (B alone) leaked a micro-batch's activations each: 28 GB by step 11
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    MAX_KNOWN = 16  # input shapes remembered (a job has one or two)

    def known(self, key: tuple) -> Optional[int]:
        """The stash measured before for a forward on an input described by ``key`` (its shape, its
        dtype and whether the stage computes a loss): every micro-batch of a stage saves the same
        tensors, so the hooks of ``saving``, a Python call for every tensor saved (3.5 % of a small
        stage's compute, measured), run on the first forward of each input shape only."""
        return self._by_input.get(key)

    def learn(self, key: tuple, n: int) -> None:
        if len(self._by_input) < self.MAX_KNOWN:
            self._by_input[key] = n

    def kept(self, n: int) -> int:
        """A micro-batch's forward is done: its ``n`` bytes of stash are held until ``freed``."""
        self.held += n
        self.peak = max(self.peak, self.held)
        self.largest = max(self.largest, n)
        return n

    def freed(self, n: int) -> None:
        self.held = max(0, self.held - n)


def saved_bytes(layer: torch.nn.Module, *args: torch.Tensor) -> tuple[int, torch.Tensor]:
    """What ``layer`` keeps of a forward on ``args`` for its backward (bytes, its weights left out),
    and its output (detached): the planner's stash per sample, measured on one sample."""
    stash: dict[int, int] = {}
    x, *rest = args
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    with StashMeter([p for p in layer.parameters()]).saving(stash):
        out = layer(x, *rest)
    return sum(stash.values()), out.detach()


def layer_stashes(layers: list, x: torch.Tensor, target: Optional[torch.Tensor] = None, dtype=None,
                  inputs: Optional[list] = None) -> list[int]:
    """What each of ``layers``, run one after another on ``x`` (the last one with ``target``, where
    given), keeps for its backward (``saved_bytes``), under autocast to ``dtype`` where given.
    ``inputs``, a list: gets each layer's input bytes as the stage holds it (what a checkpoint keeps
    under full recomputation: under autocast a block's input is the fp32 residual stream, twice a
    bf16 wire's bytes; the first layer's, the token ids)."""
    device = next((p.device for layer in layers for p in layer.parameters()), torch.device("cpu"))
    x, out = x.to(device), []
    ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with ctx:
        for i, layer in enumerate(layers):
            rest = (target.to(device),) if target is not None and i == len(layers) - 1 else ()
            if inputs is not None:
                inputs.append(x.nelement() * x.element_size())
            n, x = saved_bytes(layer, x, *rest)
            out.append(n)
    return out
