"""Workloads (``--workload hf:PRESET|hf:DIR``): emulate training a real model without computing it.

This machine cannot compute GPT-2 XL or Llama-7B for a swarm of peers, but the plan of a swarm
depends only on the workload's shape: its FLOPs, activations, weights and memory per layer. So
the live swarm trains a small *proxy* model (the job's ``--model``, by default the built-in
transformer, given the workload's layer count), which keeps training real (losses, recovery,
checkpoints), while the emulated world behaves as if it trained the workload:

- each F, B and W op of proxy layer ``i`` is padded on the virtual device to the FLOPs of workload
  layer ``i`` (``layer_flops``: the executor and the profiler pad to these);
- the link emulator charges the workload's bytes for each message (``Charges``): an activation or
  its gradient as many bytes as the workload's activation at the same boundary (at whatever codec
  ratio the proxy's tensor got), a replica's gradient part as many as the workload's parameters
  of that layer;
- the planner plans the workload (``planning.model_profile``): its FLOPs, bytes and memory
  (weights, gradients, optimizer state, activation stash) against the devices' memory.

The profiler and prober keep measuring (they never read the scenario): they see the workload's
times because the device and the links behave as they would under it. The workload trains in bf16
on its GPUs (2-byte activations), whatever precision the proxy runs in.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from ..plan import types as pt
from .hf_model import HFModel
from .precision import wire_dtype_bytes

WORKLOAD_WIRE_BYTES = 2  # bf16 activations and their gradients, as a GPU run sends them
# An op below this fraction of the workload's largest (the embedding's lookup: T x D "FLOPs") has
# no time on a GPU worth padding to: it runs unpadded (the virtual device leaves zero-FLOP ops out of
# fidelity), rather than overrunning a budget of microseconds with the proxy's CPU time.
NEGLIGIBLE_OP = 1e-3


@functools.lru_cache(maxsize=8)
def profile_of(spec: str, seq_len: int) -> pt.ModelProfile:
    """The planner's profile of the transformers model ``spec`` (hf:PRESET|hf:DIR) at ``seq_len``
    tokens, as a GPU run trains it (bf16 activations; fp32 weights and Adam state)."""
    from .hf_profile import hf_model_profile

    return hf_model_profile(HFModel(spec, {}, 0, seq_len), seq_len, wire_dtype_bytes=WORKLOAD_WIRE_BYTES)


def facts(spec: str, seq_len: int) -> dict:
    """What the operator's tools say of a workload: its name, parameters, layers and sequence length."""
    prof = profile_of(spec, seq_len)
    return {"workload": spec, "name": prof.name, "params": int(prof.total_param_bytes() / 4),
            "layers": prof.num_layers, "seq_len": seq_len}


def profile(job) -> Optional[pt.ModelProfile]:
    """The workload's profile (per sample of ``workload_seq_len`` tokens), or None without one."""
    return profile_of(job.workload, job.workload_seq_len) if job.workload else None


def num_layers(job) -> int:
    return profile(job).num_layers


def layer_flops(job, first: int, last: int) -> list[dict[str, float]]:
    """F, B and W FLOPs of one micro-batch through each workload layer ``first..last-1``."""
    b = job.micro_batch_size
    layers = profile(job).layers
    floor = NEGLIGIBLE_OP * max(max(lp.fwd_flops, lp.bwd_input_flops, lp.bwd_weight_flops) for lp in layers)
    return [{ph: (f * b if f >= floor else 0.0) for ph, f in
             (("F", lp.fwd_flops), ("B", lp.bwd_input_flops), ("W", lp.bwd_weight_flops))}
            for lp in layers[first:last]]


@dataclass(frozen=True)
class Charges:
    """Emulated bytes per real byte of the proxy's messages: ``activation`` for activations and
    their gradients (every boundary has the same shape, in both models), ``params[i]`` for
    gradient parts (and layer copies) of layer ``i``."""

    activation: float
    params: tuple[float, ...]


def layer_charge(charges: Optional[Charges], layer: int) -> float:
    """Emulated bytes per real byte of a message about ``layer``'s parameters (1 without a workload)."""
    return charges.params[layer] if charges is not None and layer < len(charges.params) else 1.0


def charges(job, handle) -> Charges:
    """How many bytes of the workload each byte the proxy (``handle``: its ``ModelHandle``) sends
    stands for."""
    wl = profile(job)
    proxy_sample = math.prod(handle.boundary_shapes()[1][1:])  # one sample's activation at a block boundary
    act = wl.layers[0].activation_bytes_out / (proxy_sample * wire_dtype_bytes(job.precision))
    params = []
    for layer, lp in zip(handle.meta_layers(), wl.layers):
        proxy = 4 * sum(p.numel() for p in layer.parameters() if p.requires_grad)
        params.append(lp.param_bytes / proxy if proxy else 1.0)
    return Charges(act, tuple(params))
