"""What a step costs a device after its last backward, per byte of weights: the optimizer's step.
The snapshot's copy of the weights and the optimizer's state is not on it: ``train.recovery`` takes
it while the next step computes (a GPU on a side stream, a CPU on a thread of its own, since
2026-11-29). Measured by each peer on its own device (a virtual one steps on the host CPU, unpadded:
the host's time is the truth there) and published with its profile
(``DeviceProfile.step_s_per_param_byte``); the cost model adds it to every stage's step
(``plan.layout``). Counted nowhere before, it was 5 % of a cee-3region step here (2.6 ms of
optimizer and 2 ms of snapshot, then between the steps, in 107 ms, 2026-11-28)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

# parameters stepped, at most (16 MB of fp32; with Adam's state and the copies ~100 MB held for a moment,
# on the device): a rate, not the whole model's time
MAX_ELEMENTS = 1 << 22
MAX_S_PER_BYTE = 1e-5  # a published rate above this is no device's (10 us a byte: 40 s for 1 GB of weights)
MAX_BYTES_PER_S = 1e13  # a published copy rate above this is no host's (10 TB/s)


def measure(layers: Iterable[nn.Module], make_optimizer: Callable[[list], torch.optim.Optimizer],
            reps: int = 3, torch_device: Optional[torch.device] = None) -> float:
    """Seconds per byte of weights of one optimizer step (``make_optimizer``: the job's, over the
    parameters given), on copies of the layers' parameters (up to ``MAX_ELEMENTS``; the layers are
    left as they are): the median of ``reps`` after a first step that makes the state. Blocking:
    call it through ``asyncio.to_thread``."""
    params = _copies(layers, torch_device)
    if not params:
        return 0.0
    seconds = _median_step(make_optimizer(params), params, reps)
    return min(MAX_S_PER_BYTE, seconds / sum(p.numel() * p.element_size() for p in params))


def copy_rate(layers: Iterable[nn.Module], offloaded: Callable[[list], Any],
              reps: int = 3, torch_device: Optional[torch.device] = None) -> float:
    """Bytes a second of an offloaded optimizer's copies between the device and host memory:
    ``offloaded(params)`` steps nothing but copies as the job's offload does (``job.offload.copies_only``)
    and says how many bytes its last step moved (``copied_bytes``); on copies of the layers'
    parameters as ``measure``'s, the median of ``reps`` after a first step. 0 where there is nothing
    to copy. What the planner charges an offloading stage's copies at (``PeerInfo.host_bytes_per_s``).
    Blocking."""
    params = _copies(layers, torch_device)
    if not params:
        return 0.0
    opt = offloaded(params)
    seconds = _median_step(opt, params, reps)
    return min(MAX_BYTES_PER_S, opt.copied_bytes / seconds) if seconds > 0 else MAX_BYTES_PER_S


def _copies(layers: Iterable[nn.Module], torch_device) -> list[torch.Tensor]:
    """Copies of the layers' parameters, up to ``MAX_ELEMENTS``, on ``torch_device``, each with a
    small seeded gradient."""
    params, n = [], 0
    for layer in layers:
        for p in layer.parameters():
            if n >= MAX_ELEMENTS:
                break
            params.append(p.detach().clone().to(torch_device).requires_grad_(True))
            n += p.numel()
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.device, p.dtype)
    return params


def _median_step(opt, params: list[torch.Tensor], reps: int) -> float:
    """The median seconds of ``reps`` of ``opt.step()`` (a CUDA device's work included) after a
    first one, which makes an optimizer's state."""
    cuda = params[0].device.type == "cuda"

    def step() -> float:
        t = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize(params[0].device)
        return time.perf_counter() - t

    step()
    return statistics.median(step() for _ in range(reps))
