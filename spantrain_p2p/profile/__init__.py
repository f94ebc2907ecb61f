"""Device measurement: the profiler (per-layer F/B/W times) and the virtual device used in emulation."""
from .profiler import DeviceProfile, ProfileCache, ProfileError, model_fingerprint, profile_layers
from .virtual import FlopCache, PhaseFlops, VirtualDevice

__all__ = [
    "DeviceProfile", "FlopCache", "PhaseFlops", "ProfileCache", "ProfileError", "VirtualDevice",
    "model_fingerprint", "profile_layers",
]
