"""Training state of single layers: snapshot, wire form, and loading into a stage.

A layer's state is its parameters and buffers plus the optimizer's state of its parameters,
as ``(name, tensor)`` pairs: ``p:<param>``, ``b:<buffer>``, ``o:<param>:<key>``, and scalars of the
whole run that must survive with it (``s:<name>``: fp16's loss scale). In a stage whose optimizer
state is sharded across its replicas (``train.shard``) a replica's state of a layer is partial: an
empty ``x:<param>`` for each parameter whose optimizer state another replica holds (``merge`` puts
the parts together, ``missing`` says what a part lacks). Peers keep
snapshots of the last few steps of their own layers and hold copies of a buddy's, so that when
a peer dies, the layers it ran can be rebuilt elsewhere at a step every survivor can also return
to: the interrupted step is redone, none is lost and none applied twice.
"""
from __future__ import annotations

import math
import time
import weakref
from typing import Iterable, Optional

import numpy as np
import torch
from torch import nn

from ..net.framing import FrameError

LayerState = list[tuple[str, torch.Tensor]]
MAX_ENTRIES = 4096


def capture(layer: nn.Module, opt: Optional[torch.optim.Optimizer], run: LayerState = (),
            foreign: frozenset = frozenset(), copier=None) -> LayerState:
    """A copy of the layer's state now (parameters, buffers, optimizer state of its parameters),
    with ``run``'s ``s:`` entries (scalars of the whole run); ``foreign``: the parameters whose
    optimizer state another replica holds (marked ``x:``). With ``copier`` (a
    ``pipeline.hostcopy.HostCopier``), CUDA tensors are copied on its stream
    while the device computes on: the copy is readable once the copier's next ``mark`` completes.
    The tensors in host memory are copied in one ``_foreach_clone`` (``_host_copies``)."""
    return copied([walk(layer, opt, run, foreign)], copier)[0]


class _Found:
    """Where ``walk`` found one layer's tensors (its parameters and buffers, and the optimizer's
    state of each parameter), kept for the layer's next snapshots: a CPU stage walks its layers after
    every step on the event loop, between two steps (6 layers, 54 parameters with Adam's state:
    0.30-0.69 ms walked afresh, 65 us found again). Each tensor is looked up again where it was found
    and compared: anything moved or replaced, and the layer is walked afresh. A layer whose
    optimizer keeps a state other than float32 tensors (a number, a low-bit one) is walked afresh
    every time (``usable`` False: not looked at again while the optimizer is the same)."""

    def __init__(self, layer: nn.Module, opt, entries: LayerState, n_params: int):
        self.opt = opt
        where = {id(t): (d, k) for _, m in layer.named_modules() for kind in ("_parameters", "_buffers")
                 for k, t in getattr(m, kind).items() if t is not None for d in [getattr(m, kind)]}
        self.params = [(n[2:], t) for n, t in entries[:n_params]]
        self.slots = [(*where[id(t)], t) for _, t in entries[:n_params]] + \
            [(*where[id(t)], t) for n, t in entries[n_params:] if n.startswith("b:")]
        self.head = [e for e in entries if e[0][:2] in ("p:", "b:")]
        self.states = {}  # parameter name -> (the optimizer's state dict of it, its (key, value) pairs, entries)
        # (a state kept other than as float32 tensors, a number or a low-bit one, is walked every time)
        self.usable = True
        for n, t in self.params:
            st = opt.state.get(t) if opt is not None else None
            if not st:
                continue
            if not all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in st.values()):
                self.usable = False
                break
            keys = sorted(st)
            self.states[n] = (st, [(k, st[k]) for k in keys], [(f"o:{n}:{k}", st[k]) for k in keys])

    def entries(self, opt) -> Optional[tuple[LayerState, list[int]]]:
        """The walk's entries (no ``s:``), or None where anything moved since."""
        if opt is not self.opt or any(d.get(k) is not t for d, k, t in self.slots):
            return None
        entries = list(self.head)
        if opt is not None:
            for n, t in self.params:
                st = opt.state.get(t)
                held = self.states.get(n)
                if not st and held is None:
                    continue
                if held is None or st is not held[0] or len(st) != len(held[1]) or \
                        any(st.get(k) is not v for k, v in held[1]):
                    return None
                entries += held[2]
        return entries, list(range(len(entries)))


_found: "weakref.WeakKeyDictionary[nn.Module, _Found]" = weakref.WeakKeyDictionary()


def walk(layer: nn.Module, opt: Optional[torch.optim.Optimizer], run: LayerState = (),
         foreign: frozenset = frozenset()) -> tuple[LayerState, list[int]]:
    """``capture``'s entries before the copies: the stage's own tensors where the copies go (the
    indices ``own``: parameters, buffers, optimizer state), the rest made here (``x:``, ``s:``)."""
    runs = [(n, t.detach().float().clone()) for n, t in run if n.startswith("s:")]
    found = _found.get(layer) if not foreign else None
    kept = found.entries(opt) if found is not None and found.usable else None
    if kept is not None:
        return kept[0] + runs, kept[1]
    entries, own = _walk(layer, opt, foreign)
    if not foreign and not (found is not None and not found.usable and found.opt is opt):
        # (an optimizer whose state is not usable here stays so: not looked at again each step)
        _found[layer] = _Found(layer, opt, entries, sum(1 for n, _ in entries if n.startswith("p:")))
    return entries + runs, own


def _walk(layer: nn.Module, opt: Optional[torch.optim.Optimizer],
          foreign: frozenset) -> tuple[LayerState, list[int]]:
    params = list(layer.named_parameters())  # (the modules' walk, once: it cost as much as a copy)
    entries: LayerState = [(f"p:{n}", p) for n, p in params]
    entries += [(f"b:{n}", b) for n, b in layer.named_buffers()]
    own = list(range(len(entries)))
    entries += [(f"x:{n}", torch.zeros(0)) for n, _ in params if n in foreign]
    if opt is not None:
        for n, p in params:
            if n in foreign:
                continue
            for key, v in sorted(opt.state.get(p, {}).items()):
                t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                if type(t) is not torch.Tensor and hasattr(t, "dequantize"):
                    # a low-bit optimizer's state (torchao): kept as the values it stands for (its
                    # copy would share the codes the next step overwrites); ``apply`` quantizes again
                    t = t.dequantize()
                own.append(len(entries))
                entries.append((f"o:{n}:{key}", t.float()))  # (a float32 state is itself: copied once, as the rest)
    return entries, own


def copied(walks: list[tuple[LayerState, list[int]]], copier=None) -> list[LayerState]:
    """The states of ``walk``s: their ``own`` tensors copied to host memory, all in one pass
    (``_host_copies``), in their places."""
    copies = iter(_host_copies([entries[i][1] for entries, own in walks for i in own], copier))
    out = []
    for entries, own in walks:
        state = list(entries)
        for i in own:
            state[i] = (state[i][0], next(copies))
        out.append(state)
    return out


def clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of host ``tensors``, with no gradient history, in one ``torch._foreach_clone`` (each
    tensor's clone on a torch without that private op): how a snapshot copies a CPU stage's state."""
    clone = getattr(torch, "_foreach_clone", None)
    with torch.no_grad():  # (clones of parameters would otherwise be part of a graph)
        return clone(tensors) if clone is not None else [t.clone() for t in tensors]


def _host_copies(tensors: list[torch.Tensor], copier=None) -> list[torch.Tensor]:
    """Copies of ``tensors`` in host memory, in order: CUDA ones on ``copier``'s stream where there is
    one, CPU ones in one ``torch._foreach_clone`` (``clone_all``: a ``.to`` and a ``detach`` each
    cost 8 us more a tensor than the bytes, 2.2 ms between two steps for the 216 tensors of a
    6-layer stage and its Adam state, against 0.4 ms of copying), any other one on its own."""
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    on_cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    for i, c in zip(on_cpu, clone_all([tensors[i] for i in on_cpu]) if on_cpu else ()):
        out[i] = c
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = copier.copy(t.detach()) if copier is not None and t.device.type == "cuda" else _host_copy(t)
    return out


def missing(state: LayerState) -> frozenset:
    """The parameters whose optimizer state ``state`` lacks (held by another replica); empty: whole."""
    return frozenset(n[2:] for n, _ in state if n.startswith("x:"))


def merge(a: LayerState, b: LayerState) -> LayerState:
    """``a`` with the optimizer state it lacks taken from ``b`` (a state of the same layer and step:
    the same weights), where ``b`` has it."""
    gaps = missing(a)
    if not gaps:
        return a
    from_b = gaps - missing(b)
    if not from_b:
        return a
    take = [(n, t) for n, t in b if n.startswith("o:") and n[2:].rsplit(":", 1)[0] in from_b]
    return [(n, t) for n, t in a if not (n.startswith("x:") and n[2:] in from_b)] + take


def run_entries(state: LayerState) -> dict[str, torch.Tensor]:
    """The ``s:`` entries of a layer's state (scalars of the whole run)."""
    return {n: t for n, t in state if n.startswith("s:")}


def is_layer_entry(name: str) -> bool:
    """A parameter or buffer entry (what a layer's shapes are checked against)."""
    return name[:2] in ("p:", "b:")


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (states leave the device: snapshots, layer copies, checkpoints)."""
    return t.detach().to("cpu", copy=True)


def apply(layer: nn.Module, opt: Optional[torch.optim.Optimizer], state: LayerState,
          foreign: frozenset = frozenset()) -> None:
    """Loads ``state`` into the layer (and the optimizer's state of its parameters, but those of
    ``foreign``: another replica's to hold)."""
    d = dict(state)
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(d[f"p:{n}"])
        for n, b in layer.named_buffers():
            if f"b:{n}" in d:
                b.copy_(d[f"b:{n}"])
    if opt is None:
        return
    for n, p in params.items():
        if n in foreign:
            continue
        prefix = f"o:{n}:"
        # the moments live with the parameter; a scalar (Adam's step count) stays on the host, as torch keeps it
        st = {k[len(prefix):]: v.to(p.device, copy=True) if v.dim() else v.clone()
              for k, v in d.items() if k.startswith(prefix)}
        new_buffer = getattr(opt, "_new_buffer", None)  # a low-bit optimizer (torchao): its moments quantized again
        if new_buffer is not None:
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st and st[key].dim():
                    buf = new_buffer(p, key == "exp_avg")  # exp_avg is signed, exp_avg_sq is not
                    buf.copy_(st[key])
                    st[key] = buf
        if st:
            opt.state[p] = st


def encode(state: LayerState) -> tuple[dict, list[memoryview]]:
    names = [n for n, _ in state]
    shapes = [list(t.shape) for _, t in state]
    bufs = [memoryview(t.contiguous().float().numpy()).cast("B") for _, t in state]
    return {"names": names, "shapes": shapes}, bufs


def decode(header: dict, buffers: list[memoryview], expected: Optional[dict[str, tuple[int, ...]]] = None) -> LayerState:
    """Validated layer state from a frame; ``expected`` = the parameter and buffer shapes it must have."""
    names, shapes = header.get("names"), header.get("shapes")
    if not isinstance(names, list) or not isinstance(shapes, list) or len(names) != len(shapes) != len(buffers):
        raise FrameError("layer state needs matching names, shapes and buffers")
    if len(names) > MAX_ENTRIES or len(buffers) != len(names):
        raise FrameError("layer state has too many or too few entries")
    out = []
    for n, shape, buf in zip(names, shapes, buffers):
        if not isinstance(n, str) or len(n) > 256 or n[:2] not in ("p:", "b:", "o:", "s:", "x:"):
            raise FrameError(f"bad layer state entry name {str(n)[:40]!r}")
        if n.startswith("x:") and shape != [0]:
            raise FrameError(f"{n} marks a missing optimizer state: it holds nothing")
        if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(x, int) and x >= 0 for x in shape):
            raise FrameError(f"bad shape for {n}")
        if buf.nbytes != math.prod(shape) * 4:
            raise FrameError(f"{n}: {buf.nbytes} bytes for shape {shape}")
        arr = np.frombuffer(buf, dtype=np.float32).reshape(shape).copy()
        if not np.isfinite(arr).all():
            raise FrameError(f"{n} holds NaN or infinite values")
        out.append((n, torch.from_numpy(arr)))
    if expected is not None:
        gaps = [n for n, _ in out if n.startswith("x:") and f"p:{n[2:]}" not in expected]
        if gaps:
            raise FrameError(f"{gaps[0]} names no parameter of the layer")
        got = {n: tuple(t.shape) for n, t in out if is_layer_entry(n)}
        if got != expected:
            missing = sorted(set(expected) ^ set(got))[:3] or [k for k in expected if expected[k] != got.get(k)][:3]
            raise FrameError(f"layer state does not match the layer (e.g. {missing})")
    return out


def expected_shapes(layer: nn.Module) -> dict[str, tuple[int, ...]]:
    out = {f"p:{n}": tuple(p.shape) for n, p in layer.named_parameters()}
    out.update({f"b:{n}": tuple(b.shape) for n, b in layer.named_buffers()})
    return out


class Store:
    """States of layers by (layer index, step): this peer's own snapshots and a buddy's copies."""

    def __init__(self, keep_steps: int = 3):
        self.keep = keep_steps
        self._d: dict[tuple[int, int], LayerState] = {}
        self._told: dict[int, set[int]] = {}  # layer -> steps an inventory named lately (``hold``)
        self._told_until = 0.0

    def hold(self, until: float) -> None:
        """Keeps the steps held now until ``until`` (``time.monotonic``): an inventory just named them,
        and a planner may resume from one while this peer trains on (an improving re-plan's old map
        runs until the new one arrives: a step that fell out meanwhile failed the new epoch at once).
        Holds within that time add up, the newest ``2 * keep`` steps a layer at most: the latest
        ``keep`` are kept anyway, so a peer that polls ``/inventory`` keeps ``keep`` more a layer."""
        if time.monotonic() >= self._told_until:
            self._told = {}  # the last hold ran out
        for layer, step in self._d:
            self._told.setdefault(layer, set()).add(step)
        self._told = {layer: set(sorted(steps)[-2 * self.keep:]) for layer, steps in self._told.items()}
        self._told_until = until

    def put(self, layer: int, step: int, state: LayerState, merge_parts: bool = False, pin_every: int = 1) -> None:
        """Keeps ``state``, the newest, in place of what was held for (layer, step); with
        ``merge_parts``, a part completed from what was held (buddies' copies of one sharded layer,
        from its replicas). The layer's latest ``keep`` steps stay, and so do its latest ``keep``
        steps that are multiples of ``pin_every`` (the steps buddy copies are taken at)."""
        held = self._d.get((layer, step))
        if merge_parts and held is not None:
            state = merge(state, held)
        self._d[(layer, step)] = state
        steps = sorted({s for (l, s) in self._d if l == layer})
        pinned = set([s for s in steps if s % pin_every == 0][-self.keep:])
        if time.monotonic() < self._told_until:
            pinned.update(self._told.get(layer, ()))
        for s in steps[: -self.keep]:
            if s not in pinned:
                self._d.pop((layer, s), None)

    def drop_after(self, layer: int, step: int) -> None:
        """Forgets the layer's states after ``step``: a timeline abandoned by a resume at ``step``
        (its states would count as the latest and push out the redone steps' snapshots)."""
        for key in [k for k in self._d if k[0] == layer and k[1] > step]:
            del self._d[key]

    def get(self, layer: int, step: int) -> Optional[LayerState]:
        return self._d.get((layer, step))

    def inventory(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for layer, step in sorted(self._d):
            out.setdefault(layer, []).append(step)
        return out

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._d)

    def clear(self) -> None:
        self._d.clear()


def covered(partials: Iterable[dict[int, dict[int, frozenset]]]) -> dict[int, list[int]]:
    """(layer -> steps) whose state the parts held (per peer: layer -> step -> the parameters whose
    optimizer state its part lacks) make whole together: no parameter lacked by every part."""
    gaps: dict[tuple[int, int], frozenset] = {}
    for inv in partials:
        for layer, steps in inv.items():
            for step, lack in steps.items():
                gaps[(layer, step)] = gaps[(layer, step)] & lack if (layer, step) in gaps else frozenset(lack)
    out: dict[int, list[int]] = {}
    for (layer, step), lack in sorted(gaps.items()):
        if not lack:
            out.setdefault(layer, []).append(step)
    return out


def resume_step(inventories: Iterable[dict[int, list[int]]], num_layers: int) -> tuple[Optional[int], list[int]]:
    """(the latest step at which every layer's state is held somewhere, layers held nowhere).

    The swarm redoes from there: every survivor can go back to it, and every layer has a copy.
    """
    have: dict[int, set[int]] = {i: set() for i in range(num_layers)}
    for inv in inventories:
        for layer, steps in inv.items():
            if 0 <= int(layer) < num_layers:
                have[int(layer)].update(int(s) for s in steps)
    missing = [i for i, s in have.items() if not s]
    if missing:
        return None, missing
    common = set.intersection(*have.values())
    return (max(common) if common else None), []
