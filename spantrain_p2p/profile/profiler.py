"""Device profiler: how long this device takes for each layer of the job, at the job's micro-batch.

``profile_layers(layers, (micro_batch, seq_len), device=…)`` times, per layer, the forward (F), the
backward to the layer's input (B: ``torch.autograd.grad`` w.r.t. the input activation) and the
backward to its weights (W: ``autograd.grad`` w.r.t. its parameters, a separate pass as the zero-bubble
executor runs it). It warms up, repeats, and keeps the median. With a ``VirtualDevice`` each operation
runs through it, so the times are the emulated device's; the profiler never reads a scenario. A
repetition in which the virtual device was late (the host could not keep up) is left out
of the median while a few more repetitions can replace it: on a shared host that reading is the
host's load, not the device.

Layer contract (see ``models/model.py``): the first layer takes token ids ``LongTensor [B, T]`` (zeros
unless ``inputs`` is given), the last one ``(activation, targets)`` and returns a scalar loss.
The first layer's B is 0 (integer ids have no gradient), as is W of a layer without parameters.

Every reading must be finite, positive and below ``max_op_s``; a repetition with a bad reading is
run again (at most ``max_retries`` times per repetition), and a layer that keeps giving bad readings
raises ``ProfileError``: nothing invalid is returned, cached or published.

Results are cached on disk (``ProfileCache``: one small JSON file per (model fingerprint, input
shape, device key)), so a restarted peer does not profile again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..files import atomic_write_bytes
from ..net.framing import strict_from_dict
from .step_tail import MAX_BYTES_PER_S, MAX_S_PER_BYTE
from .virtual import FlopCache, PhaseFlops, VirtualDevice, grad_output, layer_inputs

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
MAX_LAYERS = 4096
MAX_OP_S = 3600.0  # a single layer operation above an hour is absurd
MAX_TFLOPS = 1e6
MAX_MEMORY_BYTES = 1 << 50
OVERRUN_PAUSE_S = 0.02  # before measuring again a repetition the host could not keep up with


class ProfileError(RuntimeError):
    """The device kept giving readings that cannot be right; nothing was returned."""


def _times(d: Mapping, key: str, n: Optional[int], positive: bool) -> tuple[float, ...]:
    v = d.get(key)
    if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= MAX_LAYERS:
        raise ValueError(f"device profile {key!r} must be a list of 1..{MAX_LAYERS} seconds")
    if n is not None and len(v) != n:
        raise ValueError(f"device profile {key!r} has {len(v)} layers, fwd_s has {n}")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 or x > MAX_OP_S:
            raise ValueError(f"device profile {key}[{i}] = {x!r} is not a time in [0, {MAX_OP_S:g}] s")
        if positive and x <= 0:
            raise ValueError(f"device profile {key}[{i}] must be > 0 s")
        out.append(float(x))
    return tuple(out)


@dataclass(frozen=True)
class DeviceProfile:
    """Per-layer F, B and W seconds of one device at one micro-batch shape, its usable memory and the
    FLOP/s it achieved (torch-counted FLOPs / measured time, in real time: a virtual device's figure
    divided by its ``scale`` gives its configured TFLOP/s). Validated on construction."""

    fwd_s: tuple[float, ...]
    bwd_input_s: tuple[float, ...]
    bwd_weight_s: tuple[float, ...]
    memory_bytes: int
    effective_tflops: float
    version: int = PROFILE_VERSION
    # the optimizer's step after a step (the snapshot's copies overlap the next), seconds per byte of
    # weights (``profile.step_tail``); 0: not measured (a profile from a peer that does not say)
    step_s_per_param_byte: float = 0.0
    # the same step on this peer's host CPU, where the job offloads its optimizer there (``job.offload``);
    # 0: not measured (the planner prices it at ``train.planning.HOST_STEP_S_PER_PARAM_BYTE``)
    host_step_s_per_param_byte: float = 0.0
    # where the job offloads it, the rate of the copies between the device and host memory, bytes a
    # second (``profile.step_tail.copy_rate``); 0: not measured (the planner's ``HOST_BYTES_PER_S`` then)
    host_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        d = {"fwd_s": self.fwd_s, "bwd_input_s": self.bwd_input_s, "bwd_weight_s": self.bwd_weight_s}
        fwd = _times(d, "fwd_s", None, positive=True)
        object.__setattr__(self, "fwd_s", fwd)
        object.__setattr__(self, "bwd_input_s", _times(d, "bwd_input_s", len(fwd), positive=False))
        object.__setattr__(self, "bwd_weight_s", _times(d, "bwd_weight_s", len(fwd), positive=False))
        m = self.memory_bytes
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= MAX_MEMORY_BYTES:
            raise ValueError(f"device profile memory_bytes must be an int in [0, 2^50], not {m!r}")
        t = self.effective_tflops
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= MAX_TFLOPS:
            raise ValueError(f"device profile effective_tflops must be in [0, {MAX_TFLOPS:g}], not {t!r}")
        object.__setattr__(self, "effective_tflops", float(t))
        if self.version != PROFILE_VERSION:
            raise ValueError(f"device profile version {self.version!r} is not {PROFILE_VERSION}")
        for name, hi in (("step_s_per_param_byte", MAX_S_PER_BYTE), ("host_step_s_per_param_byte", MAX_S_PER_BYTE),
                         ("host_bytes_per_s", MAX_BYTES_PER_S)):
            r = getattr(self, name)
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 <= r <= hi:
                raise ValueError(f"device profile {name} must be in [0, {hi:g}], not {r!r}")
            object.__setattr__(self, name, float(r))

    @property
    def num_layers(self) -> int:
        return len(self.fwd_s)

    def layer_s(self, i: int) -> float:
        """F + B + W seconds of layer ``i``."""
        return self.fwd_s[i] + self.bwd_input_s[i] + self.bwd_weight_s[i]

    @property
    def total_s(self) -> float:
        """F + B + W seconds of all layers: one micro-batch through the whole model."""
        return sum(self.fwd_s) + sum(self.bwd_input_s) + sum(self.bwd_weight_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "fwd_s": list(self.fwd_s), "bwd_input_s": list(self.bwd_input_s),
            "bwd_weight_s": list(self.bwd_weight_s), "memory_bytes": self.memory_bytes,
            "effective_tflops": self.effective_tflops, "step_s_per_param_byte": self.step_s_per_param_byte,
            "host_step_s_per_param_byte": self.host_step_s_per_param_byte, "host_bytes_per_s": self.host_bytes_per_s,
        }

    @classmethod
    def from_dict(cls, d: Any) -> "DeviceProfile":
        """From untrusted data (the DHT, a cache file): every field checked, else ValueError."""
        return strict_from_dict(cls, d, "device profile", required=_REQUIRED)


# every field of a profile but the step's tails and the copy rate (a profile without them, cached or from a peer that
# does not measure them: 0)
_REQUIRED = tuple(f.name for f in fields(DeviceProfile) if f.name not in ("step_s_per_param_byte",
                                                                          "host_step_s_per_param_byte",
                                                                          "host_bytes_per_s"))


def model_fingerprint(layers: Sequence[nn.Module]) -> str:
    """A short digest of the layers' structure (types and parameter shapes, not values)."""
    desc = [
        [f"{type(m).__module__}.{type(m).__qualname__}", [[n, list(p.shape), str(p.dtype)] for n, p in m.named_parameters()]]
        for m in layers
    ]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def cpu_device_key() -> str:
    """Identifies this machine's CPU compute (for the cache), when no virtual device is used."""
    return (f"cpu:{platform.machine()}:{platform.processor() or '?'}:{os.cpu_count()}cpus:"
            f"{torch.get_num_threads()}threads:torch{torch.__version__}")


GPU_RESERVE = 0.10  # of a GPU's memory kept back from the planner (allocator slack, CUDA context growth)


def usable_memory_bytes(torch_device: Optional[torch.device] = None) -> int:
    """Memory this process could still use: on a GPU its free memory less a reserve
    (``GPU_RESERVE`` of the total); else MemAvailable from /proc/meminfo, else physical memory."""
    if torch_device is not None and torch_device.type == "cuda":
        free, total = torch.cuda.mem_get_info(torch_device)
        return max(0, int(free - GPU_RESERVE * total))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class ProfileCache:
    """Profiles on disk, one JSON file per (fingerprint, shape, device key). Unreadable, corrupt or
    mismatching files count as misses; writes are atomic (temp file + rename)."""

    def __init__(self, directory: str):
        self.directory = directory

    @staticmethod
    def _key(fingerprint: str, shape: Sequence[int], device_key: str) -> dict:
        return {"fingerprint": fingerprint, "shape": [int(s) for s in shape], "device": device_key}

    def path(self, fingerprint: str, shape: Sequence[int], device_key: str) -> str:
        k = json.dumps(self._key(fingerprint, shape, device_key), sort_keys=True)
        return os.path.join(self.directory, f"profile-{hashlib.sha256(k.encode()).hexdigest()[:24]}.json")

    def get(self, fingerprint: str, shape: Sequence[int], device_key: str) -> Optional[DeviceProfile]:
        p = self.path(fingerprint, shape, device_key)
        try:
            with open(p) as f:
                data = json.load(f)
            if data.get("key") != self._key(fingerprint, shape, device_key):
                return None
            return DeviceProfile.from_dict(data.get("profile"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ignoring profile cache file %s: %s", p, e)
            return None

    def put(self, fingerprint: str, shape: Sequence[int], device_key: str, profile: DeviceProfile) -> None:
        os.makedirs(self.directory, exist_ok=True)
        p = self.path(fingerprint, shape, device_key)
        data = {"key": self._key(fingerprint, shape, device_key), "profile": profile.to_dict()}
        atomic_write_bytes(p, json.dumps(data).encode())


def profile_layers(
    layers: Sequence[nn.Module],
    input_shape: tuple[int, int],
    *,
    device: Optional[VirtualDevice] = None,
    warmup: int = 1,
    reps: int = 5,
    max_retries: int = 3,
    max_op_s: float = 60.0,
    cache_dir: Optional[str] = None,
    fingerprint: Optional[str] = None,
    flop_cache: Optional[FlopCache] = None,
    inputs: Optional[torch.Tensor] = None,
    targets: Optional[torch.Tensor] = None,
    timer: Callable[[], float] = time.perf_counter,
    report: Optional[dict] = None,
    torch_device: Optional[torch.device] = None,
    layer_flops: Optional[Sequence[dict]] = None,
) -> DeviceProfile:
    """Measures F, B and W seconds per layer at ``input_shape = (micro_batch, seq_len)``.

    ``device``: run every operation through this virtual device (else the bare CPU).
    ``cache_dir``: read/write the profile there (None: no cache). ``fingerprint``: the model's
    identity for the cache (default: ``model_fingerprint(layers)``). ``inputs`` / ``targets``: the
    first layer's input and the loss head's targets (default: zeros, a valid token id for any vocab).
    ``timer`` is injectable for tests. ``report``, if given, receives ``late_layers``: the layers
    whose every repetition was late on the virtual device (their times are the host's load).
    ``torch_device``: where the layers are (``--device``); on a GPU every reading of the timer
    waits for the device first, and the memory is the device's. ``layer_flops`` (per layer, F, B
    and W): what the virtual device pads each op to, instead of the layers' own FLOPs (a proxy
    standing for a workload's layers, ``models.workload``).
    Blocking and CPU-bound: call it through ``asyncio.to_thread``.
    """
    if not layers or not all(isinstance(m, nn.Module) for m in layers):
        raise ValueError("profile_layers wants a non-empty list of nn.Module")
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"input_shape must be (micro_batch, seq_len), not {input_shape!r}")
    if warmup < 0 or reps < 1 or max_retries < 0:
        raise ValueError("need warmup >= 0, reps >= 1, max_retries >= 0")
    fingerprint = fingerprint or model_fingerprint(layers)
    device_key = device.key if device is not None else cpu_device_key()
    if torch_device is not None and torch_device.type == "cuda":
        device_key = f"{torch_device}:{torch.cuda.get_device_name(torch_device)}:torch{torch.__version__}"
        timer = _synced(timer, torch_device)
    cache = ProfileCache(cache_dir) if cache_dir else None
    if cache is not None:
        hit = cache.get(fingerprint, shape, device_key)
        if hit is not None and hit.num_layers == len(layers):
            log.info("device profile from cache (%s, shape %s, %s)", fingerprint, shape, device_key)
            return hit

    flop_cache = flop_cache if flop_cache is not None else FlopCache()
    ids = inputs if inputs is not None else torch.zeros(shape, dtype=torch.long)
    tgt = targets if targets is not None else torch.zeros(shape, dtype=torch.long)
    if torch_device is not None:
        ids, tgt = ids.to(torch_device), tgt.to(torch_device)
    fwd, bwd_in, bwd_w, total_flops, late_layers = [], [], [], 0.0, []
    was_training = [m.training for m in layers]
    t_start = time.perf_counter()
    try:
        for m in layers:
            m.train()
        x = ids
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            args = (x, tgt) if last else (x,)
            flops = PhaseFlops(**layer_flops[i]) if layer_flops is not None else flop_cache.phase_flops(layer, args)
            total_flops += flops.total
            (f, b, w), kept_any = _measure_layer(i, layer, args, flops, device, warmup, reps, max_retries, max_op_s,
                                                 timer)
            if not kept_any:
                late_layers.append(i)
            fwd.append(f)
            bwd_in.append(b)
            bwd_w.append(w)
            if not last:
                with torch.no_grad():
                    x = layer(x)
    finally:
        for m, t in zip(layers, was_training):
            m.train(t)
    if report is not None:
        report["late_layers"] = late_layers
    total_s = sum(fwd) + sum(bwd_in) + sum(bwd_w)
    mem = device.memory_bytes if device is not None and device.memory_bytes is not None else \
        usable_memory_bytes(torch_device)
    profile = DeviceProfile(fwd, bwd_in, bwd_w, min(mem, MAX_MEMORY_BYTES), total_flops / total_s / 1e12)
    log.info("profiled %d layers at shape %s on %s in %.1f s: %.3f ms per micro-batch (F+B+W), %.4g TFLOP/s",
             len(layers), shape, device_key, time.perf_counter() - t_start, total_s * 1e3, profile.effective_tflops)
    if cache is not None:
        try:
            cache.put(fingerprint, shape, device_key, profile)
        except OSError as e:
            log.warning("cannot write the profile cache in %s: %s", cache.directory, e)
    return profile


def _synced(timer: Callable[[], float], torch_device: torch.device) -> Callable[[], float]:
    """``timer`` read once the GPU has done what was queued (its kernels run asynchronously)."""
    def read() -> float:
        torch.cuda.synchronize(torch_device)
        return timer()
    return read


def _measure_layer(i, layer, args, flops, device, warmup, reps, max_retries, max_op_s, timer):
    """(median F, B, W seconds of one layer over ``reps`` repetitions, whether any repetition kept
    up with the virtual device). A repetition with a bad
    reading is run again. With a virtual device, a repetition with a late operation (it overran
    its budget, or its padding woke up late: the host CPU, shared with the other peers of an
    emulated swarm, did not keep up, so the reading is the host's, not the device's; see
    ``virtual.LATE_TOLERANCE``) does not count while up to ``max_retries`` more
    repetitions can replace it; the median is over the ones that kept up, or over all of them if
    none did (a device this host can never keep up with)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    for _ in range(warmup):
        _valid_rep(i, layer, args, params, flops, device, max_retries, max_op_s, timer)
    kept, overran = [], []
    tries = reps + (max_retries if device is not None else 0)
    while tries > 0 and len(kept) < reps:
        tries -= 1
        before = device.stats().late if device is not None else 0
        r = tuple(0.0 if v is None else v for v in
                  _valid_rep(i, layer, args, params, flops, device, max_retries, max_op_s, timer))
        if device is None or device.stats().late == before:
            kept.append(r)
        else:
            overran.append(r)
            time.sleep(OVERRUN_PAUSE_S)
    return tuple(statistics.median(col) for col in zip(*(kept or overran))), bool(kept)


def _valid_rep(i, layer, args, params, flops, device, max_retries, max_op_s, timer):
    """One F, B, W round whose readings are all finite, positive and below ``max_op_s``."""
    for _ in range(max_retries + 1):
        r = _one_rep(layer, args, params, flops, device, timer)
        # F always exists; B and W read None where the layer has no such operation
        bad = [name for name, v in zip("FBW", r)
               if (name == "F" or v is not None) and not (v is not None and math.isfinite(v) and 0 < v <= max_op_s)]
        if not bad:
            return r
        log.warning("layer %d: rejected %s reading(s) %s; measuring again", i, "/".join(bad), r)
    raise ProfileError(f"layer {i} ({type(layer).__name__}): no valid reading in {max_retries + 1} tries "
                       f"(last: F={r[0]!r} B={r[1]!r} W={r[2]!r} s)")


def _timed(fn, phase, flops, device, timer):
    if device is None:
        t0 = timer()
        out = fn()
        return out, timer() - t0
    t0 = timer()
    with device.op(phase, flops[phase]):
        out = fn()
    return out, timer() - t0


def _one_rep(layer, args, params, flops, device, timer):
    """One F, B, W round; a phase that does not exist for this layer reads None."""
    xs = layer_inputs(args)
    with torch.enable_grad():
        out, tf = _timed(lambda: layer(*xs), "F", flops, device, timer)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return tf, None, None
        g = grad_output(out)
        tb = tw = None
        if xs[0].requires_grad:
            _, tb = _timed(lambda: torch.autograd.grad(out, [xs[0]], g, retain_graph=bool(params)), "B", flops, device, timer)
        if params:
            _, tw = _timed(lambda: torch.autograd.grad(out, params, g, allow_unused=True), "W", flops, device, timer)
    return tf, tb, tw
