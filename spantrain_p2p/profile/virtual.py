"""Virtual device: a CPU that takes as long as the scenario's device would.

Each operation (a layer's forward F, input-grad B or weight-grad W) runs for real on the CPU, then
the calling thread is held until ``FLOPs / (tflops × 1e12 × scale)`` seconds have passed since it
started. ``scale`` is the scenario's ``compute_scale``: it slows every device by the same factor so
a small CPU can stand in for fast ones. The FLOPs come from torch's own counter
(``torch.utils.flop_counter.FlopCounterMode``), counted once per layer structure, input shape and
phase by a ``FlopCache``.

Fidelity: an operation whose real CPU time already exceeds its budget cannot be padded; it *overran*
and the emulated device was slower than configured there. ``fidelity()`` is the fraction of padded
operations that did **not** overrun (1.0 = perfect); ``overrun_fraction()`` is its complement. If
fidelity drops below ~0.95, the scale is too large for this CPU. Operations with zero counted FLOPs
(embedding lookups, layers without matmuls) run unpadded and are left out of both (``unpadded_ops``).

Padding: ``sleep_until`` sleeps with ``time.sleep`` up to ``spin_s`` (0.2 ms) before the deadline,
then spins with ``time.sleep(0)`` (which releases the GIL) to the deadline: ~10 µs accurate instead
of ``time.sleep``'s ~60 µs late. It blocks only the calling thread, so compute run in a worker thread
(``asyncio.to_thread``) pads there without stalling the event loop. A ``VirtualDevice`` is safe to
share between threads (its counters are under a lock); each thread's operations are padded separately.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

PHASES = ("F", "B", "W")  # forward, backward to the input (B), backward to the weights (W)
# An operation is late when it held the device longer than its budget by more than 3 % + 0.1 ms:
# it overran, or the padding woke up late because the host's cores were busy elsewhere. Either
# way its time is the host's, not the device's (the profiler measures such a repetition again).
LATE_TOLERANCE = (0.03, 1e-4)

Clock = Callable[[], float]


def sleep_until(deadline: float, clock: Clock = time.perf_counter, spin_s: float = 2e-4,
                sleep: Callable[[float], None] = time.sleep) -> None:
    """Blocks the calling thread until ``clock() >= deadline`` (see the module docstring)."""
    while True:
        d = deadline - clock()
        if d <= 0:
            return
        sleep(d - spin_s if d > spin_s else 0)


@dataclass
class PhaseStats:
    ops: int = 0  # operations run in this phase
    unpadded_ops: int = 0  # with zero FLOPs: nothing to pad to
    overruns: int = 0  # real time above the budget
    late: int = 0  # busy time above the budget by more than LATE_TOLERANCE: overruns, late wake-ups
    flops: float = 0.0
    real_s: float = 0.0  # CPU time of the operations themselves
    busy_s: float = 0.0  # time the device was busy, padding included
    worst_overrun: float = 0.0  # largest real / budget ratio among overruns
    caught_up_s: float = 0.0  # time operations started on the device before their thread began them (``op``'s ``ready``)


@dataclass
class DeviceStats:
    phases: dict[str, PhaseStats] = field(default_factory=lambda: {p: PhaseStats() for p in PHASES})

    @property
    def ops(self) -> int:
        return sum(p.ops for p in self.phases.values())

    @property
    def padded_ops(self) -> int:
        return sum(p.ops - p.unpadded_ops for p in self.phases.values())

    @property
    def overruns(self) -> int:
        return sum(p.overruns for p in self.phases.values())

    @property
    def late(self) -> int:
        return sum(p.late for p in self.phases.values())

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.phases.values())

    @property
    def busy_s(self) -> float:
        return sum(p.busy_s for p in self.phases.values())

    @property
    def real_s(self) -> float:
        return sum(p.real_s for p in self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ops": self.ops, "padded_ops": self.padded_ops, "overruns": self.overruns, "late": self.late,
            "flops": self.flops,
            "real_s": self.real_s, "busy_s": self.busy_s,
            "caught_up_s": sum(p.caught_up_s for p in self.phases.values()),
            "fidelity": 1.0 - self.overruns / self.padded_ops if self.padded_ops else 1.0,
            "phases": {k: vars(v).copy() for k, v in self.phases.items()},
        }


class VirtualDevice:
    """A device of ``tflops`` TFLOP/s slowed by ``scale``; see the module docstring.

    ``with device.op("F", flops): …`` runs the block and pads it; ``device.run(fn, *args, flops=…)``
    does the same for a call. ``memory_bytes`` is the device's usable memory, reported by the profiler.
    ``clock`` and ``sleep`` are the time it pads on (a test's own clock: time that passes only as
    the thread computes or sleeps, so another process's load on the host is not the device's).
    """

    def __init__(
        self,
        tflops: float,
        scale: float = 1.0,
        *,
        memory_bytes: Optional[int] = None,
        clock: Clock = time.perf_counter,
        spin_s: float = 2e-4,
        sleep: Callable[[float], None] = time.sleep,
    ):
        for name, v in (("tflops", tflops), ("scale", scale)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"virtual device {name} must be a positive number, not {v!r}")
        if memory_bytes is not None and (isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0):
            raise ValueError(f"virtual device memory_bytes must be a non-negative int, not {memory_bytes!r}")
        self.tflops = float(tflops)
        self.scale = float(scale)
        self.memory_bytes = memory_bytes
        self.clock = clock
        self.spin_s = spin_s
        self.sleep = sleep
        self._lock = threading.Lock()
        self._thread = threading.local()  # free_at: when this thread's last operation ended on the device
        self._stats = DeviceStats()

    def __repr__(self) -> str:
        return f"VirtualDevice({self.tflops:g} TFLOP/s x {self.scale:g})"

    @property
    def key(self) -> str:
        """Identifies the device's speed, e.g. for the profile cache."""
        return f"virtual:{self.tflops:g}tflops:x{self.scale:g}"

    @property
    def flops_per_s(self) -> float:
        """The FLOP/s this device runs at in real time (tflops × 1e12 × scale)."""
        return self.tflops * 1e12 * self.scale

    def budget_s(self, flops: float) -> float:
        """Seconds an operation of ``flops`` takes on this device."""
        return max(0.0, float(flops)) / self.flops_per_s

    @contextlib.contextmanager
    def op(self, phase: str, flops: float, ready: Optional[float] = None) -> Iterator["OpProgress"]:
        """Runs the block, then holds the thread until the device's time for ``flops`` has passed.
        A block that raises is neither padded nor counted. The block may call ``reach(fraction)``
        on the yielded handle to be held until that part of the budget has passed (a part of the
        operation, e.g. one layer's weight-grads, is done on the device then).

        ``ready`` (this device's clock): when the operation was queued, its inputs there. The device
        then starts it when it was both queued and done with this thread's previous operation, as a
        GPU's stream runs queued kernels back to back, though that is before the host thread began
        it: a thread woken late from its last padding (a busy host) does not delay the device. The
        operation's own CPU work is never shortened: it ends no earlier than it began plus that
        work. Without ``ready``, it starts when the block begins."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
        if not (math.isfinite(flops) and flops >= 0):
            raise ValueError(f"flops must be a finite number >= 0, not {flops!r}")
        budget = self.budget_s(flops)
        t0 = self.clock()
        start = t0 if ready is None else min(t0, max(ready, getattr(self._thread, "free_at", -math.inf)))
        progress = OpProgress(self, start, budget)
        yield progress
        worked = self.clock()  # the block's end: its CPU work (and any holds) done
        real = worked - t0 - progress.held_s
        if budget > real:
            sleep_until(start + budget, self.clock, self.spin_s, self.sleep)
        self._thread.free_at = max(start + budget, worked)
        busy = self.clock() - start
        with self._lock:
            s = self._stats.phases[phase]
            s.ops += 1
            s.flops += flops
            s.real_s += real
            s.busy_s += busy
            s.caught_up_s += t0 - start
            if budget <= 0:
                s.unpadded_ops += 1
                return
            if real > budget:
                s.overruns += 1
                s.worst_overrun = max(s.worst_overrun, real / budget)
            if busy > budget * (1 + LATE_TOLERANCE[0]) + LATE_TOLERANCE[1]:
                s.late += 1

    def run(self, fn: Callable[..., Any], *args: Any, flops: float, phase: str = "F", **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as one padded operation; returns its result."""
        with self.op(phase, flops):
            return fn(*args, **kwargs)

    def stats(self) -> DeviceStats:
        """A snapshot of the counters."""
        with self._lock:
            return DeviceStats({k: replace(v) for k, v in self._stats.phases.items()})

    def fidelity(self) -> float:
        """Fraction of padded operations whose real CPU time stayed within the budget (1.0 if none)."""
        s = self.stats()
        return 1.0 - s.overruns / s.padded_ops if s.padded_ops else 1.0

    def overrun_fraction(self) -> float:
        return 1.0 - self.fidelity()

    def reset(self) -> None:
        with self._lock:
            self._stats = DeviceStats()


class OpProgress:
    """The running operation of ``VirtualDevice.op``: ``reach(f)`` holds the thread until the
    fraction ``f`` of its budget has passed since it started (at once if it has); ``due(f)`` says
    whether it has."""

    def __init__(self, device: VirtualDevice, t0: float, budget_s: float):
        self._device, self._t0, self._budget = device, t0, budget_s
        self.held_s = 0.0  # time spent held here: not the operation's CPU time

    def due(self, fraction: float) -> bool:
        """Whether the fraction ``fraction`` of the budget has passed since the operation started."""
        return self._device.clock() >= self._t0 + self._budget * min(1.0, max(0.0, float(fraction)))

    def reach(self, fraction: float) -> None:
        dev = self._device
        t = dev.clock()
        deadline = self._t0 + self._budget * min(1.0, max(0.0, float(fraction)))
        if deadline > t:
            sleep_until(deadline, dev.clock, dev.spin_s, dev.sleep)
            self.held_s += dev.clock() - t


# ---------------------------------------------------------------------------------------------
# FLOP counting


@dataclass(frozen=True)
class PhaseFlops:
    """FLOPs of one layer at one input shape: forward, input-grad, weight-grad (torch's counter)."""

    F: float
    B: float
    W: float

    def __getitem__(self, phase: str) -> float:
        if phase not in PHASES:
            raise KeyError(phase)
        return getattr(self, phase)

    @property
    def total(self) -> float:
        return self.F + self.B + self.W


def _counter() -> Any:
    from torch.utils import flop_counter as fc

    # torch counts the CUDA attention kernels but not the CPU one; give it the same formulas
    def fwd(q, k, v, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return fc.sdpa_flop_count(q, k, v)

    def bwd(grad_out, q, k, v, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return fc.sdpa_backward_flop_count(grad_out, q, k, v)

    extra = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", fwd),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", bwd),
    ):
        op = getattr(torch.ops.aten, name, None)
        if op is not None and op not in fc.flop_registry:
            extra[op] = formula
    counter = fc.FlopCounterMode(display=False, custom_mapping=extra)
    counter.mod_tracker = _NoModuleSplit()
    return counter


class _NoModuleSplit:
    """Stands in for FlopCounterMode's ModuleTracker, whose per-module split (unused here: only the
    total is read) works by module hooks that are global to the process: a peer profiling in one
    thread put them on every other thread's forward passes too, and a LocalSwarm peer training
    beside it then failed its backward ("A leaf node was passed to _will_engine_execute_node but
    we are currently running autograd.grad()"; the README's example hung on it once). The counting
    mode itself is per thread."""

    parents = frozenset({"Global"})  # every count goes to the total

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def layer_inputs(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh leaf copies of a layer's inputs: the first one tracks its gradient if it is floating
    point (that is what B computes); the others (e.g. targets of a loss head) never do."""
    xs = [x.detach() for x in inputs]
    if xs and xs[0].is_floating_point():
        xs[0].requires_grad_(True)
    return xs


def grad_output(out: torch.Tensor, seed: int = 0) -> Optional[torch.Tensor]:
    """The gradient fed back into a layer's output: None (i.e. 1) for a scalar loss, else a fixed
    pseudo-random tensor of the output's shape."""
    if out.dim() == 0:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)


class FlopCache:
    """Counts (and remembers) the F, B and W FLOPs of layers. The key is the layer's structure
    (type, repr and parameter shapes, so equal blocks share one count) and the inputs' shapes and
    dtypes. Owned by whoever profiles or runs layers; not thread-safe."""

    def __init__(self) -> None:
        self._cache: dict[tuple, PhaseFlops] = {}

    @staticmethod
    def key(layer: nn.Module, inputs: Sequence[torch.Tensor]) -> tuple:
        t = type(layer)
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters())
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in inputs)
        return (f"{t.__module__}.{t.__qualname__}", repr(layer), params, shapes)

    def __len__(self) -> int:
        return len(self._cache)

    def phase_flops(self, layer: nn.Module, inputs: Sequence[torch.Tensor]) -> PhaseFlops:
        k = self.key(layer, inputs)
        hit = self._cache.get(k)
        if hit is None:
            hit = self._cache[k] = count_phase_flops(layer, inputs)
        return hit

    def flops(self, layer: nn.Module, phase: str, inputs: Sequence[torch.Tensor]) -> float:
        return self.phase_flops(layer, inputs)[phase]


def count_phase_flops(layer: nn.Module, inputs: Sequence[torch.Tensor]) -> PhaseFlops:
    """Runs F, then B (``autograd.grad`` to the input) and W (to the parameters) once, under torch's
    FLOP counter. W is counted as its own pass, as the executor runs it."""
    xs = layer_inputs(inputs)
    params = [p for p in layer.parameters() if p.requires_grad]
    with torch.enable_grad():
        m = _counter()
        with m:
            out = layer(*xs)
        f = m.get_total_flops()
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return PhaseFlops(float(f), 0.0, 0.0)
        g = grad_output(out)
        b = w = 0
        if xs and xs[0].requires_grad:
            m = _counter()
            with m:
                torch.autograd.grad(out, [xs[0]], g, retain_graph=True, allow_unused=True)
            b = m.get_total_flops()
        if params:
            m = _counter()
            with m:
                torch.autograd.grad(out, params, g, allow_unused=True)
            w = m.get_total_flops()
    return PhaseFlops(float(f), float(b), float(w))


def stage_layer_flops(layers: list[nn.Module], sample_input: torch.Tensor,
                      targets: Optional[torch.Tensor]) -> list[dict[str, float]]:
    """FLOPs of F, B and W of one micro-batch through each of these layers (torch's own counter)."""
    cache = FlopCache()
    out = []
    x = sample_input
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1 and targets is not None
        args = (x, targets) if last else (x,)
        pf = cache.phase_flops(layer, args)
        # the counter's W pass (autograd to the weights alone) re-walks the input-gradient chain;
        # the weight gradients' own work is what is left once B is taken out
        out.append({"F": pf["F"], "B": pf["B"], "W": max(0.0, pf["W"] - pf["B"])})
        if not last:
            with torch.no_grad():
                x = layer(x)
    return out
