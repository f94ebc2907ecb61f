"""Measuring a device.

- ``profiler``: per-layer forward, input-grad and weight-grad times of this device at the job's
  micro-batch (``DeviceProfile``), cached on disk;
- ``virtual``: the virtual device of emulation, a CPU that takes as long as a scenario's device.
"""
from .profiler import DeviceProfile, ProfileCache, ProfileError, model_fingerprint, profile_layers
from .virtual import FlopCache, PhaseFlops, VirtualDevice

__all__ = [
    "DeviceProfile", "FlopCache", "PhaseFlops", "ProfileCache", "ProfileError", "VirtualDevice",
    "model_fingerprint", "profile_layers",
]
