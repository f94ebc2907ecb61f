"""Where a peer's layers live: ``--device auto|cpu|cuda|cuda:N``.

``auto`` is the first CUDA device when torch sees one, else the CPU. The layers, their gradients,
the optimizer state and the tensors a peer receives live on that device; what leaves the peer
(activations, gradients, layer copies, checkpoints) is copied to host memory first, where the wire
codecs and safetensors work. Naming a CUDA device on a machine without one fails at once.
"""
from __future__ import annotations

import re

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_CUDA = re.compile(r"^cuda(?::(\d{1,3}))?$")


def resolve_device(spec: str) -> torch.device:
    """The torch device ``spec`` names on this machine; ValueError (saying what there is) if none."""
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    m = _CUDA.match(spec or "")
    if m is None:
        raise ValueError(f"--device {spec!r}: want {DEVICE_CHOICES}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(m.group(1) or 0)
    if count == 0:
        built = "a CPU-only build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise ValueError(f"--device {spec!r}: this machine has no CUDA device that torch can use ({built}); "
                         f"use --device cpu (or auto)")
    if index >= count:
        raise ValueError(f"--device {spec!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def describe(device: torch.device) -> dict:
    """What a peer reports of its device: its name, and its memory when it is a GPU."""
    if device.type != "cuda":
        return {"device": str(device)}
    free, total = torch.cuda.mem_get_info(device)
    return {"device": str(device), "name": torch.cuda.get_device_name(device), "memory_free_bytes": int(free),
            "memory_total_bytes": int(total)}


# dense bfloat16 tensor-core peaks (FLOP/s) from the vendors' data sheets, by a fragment of the
# name torch gives the device (first match); any other device or dtype is measured (a matmul)
BF16_PEAKS = (("H200", 989.4e12), ("H100 PCIe", 756.5e12), ("H100", 989.4e12), ("A100", 312.0e12),
              ("L40S", 362.1e12), ("L4", 121.0e12))


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(the device's peak FLOP/s in ``dtype``, where the figure comes from): the data sheet for a
    known GPU in bfloat16, else the best of a few timed square matmuls."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for fragment, flops in BF16_PEAKS:
            if fragment in name:
                return flops, f"data sheet ({name}, dense bf16)"
    return matmul_flops(device, dtype), f"measured ({device.type} {str(dtype).removeprefix('torch.')} matmul)"


def matmul_flops(device: torch.device, dtype: torch.dtype, budget_s: float = 0.25) -> float:
    """FLOP/s of the best of several ``n x n`` matmuls on ``device`` (n = 4096 on a GPU, 512 on a CPU)."""
    import time

    n = 4096 if device.type == "cuda" else 512
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    a @ b  # warm-up
    sync(device)
    best, t_end = float("inf"), time.perf_counter() + budget_s
    for _ in range(100):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return 2.0 * n ** 3 / best


# CUDA libraries' own names for running out of memory (cuBLAS creating its handle or workspace, cuDNN):
# a RuntimeError, not torch's OutOfMemoryError, when the caching allocator left them nothing
_ALLOC_FAILED = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUSOLVER_STATUS_ALLOC_FAILED")


def is_out_of_memory(e: BaseException | None) -> bool:
    """Whether ``e``, or an exception it was raised from, is the device running out of memory."""
    while e is not None:
        if isinstance(e, torch.OutOfMemoryError) or (
                isinstance(e, RuntimeError) and any(s in str(e) for s in _ALLOC_FAILED)):
            return True
        e = e.__cause__
    return False
