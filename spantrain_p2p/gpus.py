"""A catalogue of GPUs in real units, for scenarios (``gpu = "NAME"`` in a device class).

Each entry is one GPU: its dense bfloat16 (or, where the GPU has none, float16) tensor-core peak
in TFLOP/s, without structured sparsity, and its memory in GB, from the vendor's data sheet or
architecture whitepaper named beside it. Peaks are what the silicon can do at its boost clock;
training reaches a fraction of them (MFU), which the emulated device's speed should include when
a scenario wants realistic step times (``scenario`` multiplies by ``efficiency``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float  # dense bf16 tensor TFLOP/s (fp16 where no bf16), no sparsity
    memory_gb: float
    kind: str  # data-centre | workstation | consumer | embedded
    source: str


CATALOGUE: dict[str, GPU] = {g.name: g for g in (
    # data centre
    GPU("H200-SXM", 989.4, 141, "data-centre", "NVIDIA H200 Tensor Core GPU data sheet: BF16 1,979 TFLOPS with sparsity"),
    GPU("H100-SXM", 989.4, 80, "data-centre", "NVIDIA H100 Tensor Core GPU data sheet (SXM5): BF16 1,979 TFLOPS with sparsity"),
    GPU("H100-PCIe", 756.5, 80, "data-centre", "NVIDIA H100 data sheet (PCIe): BF16 1,513 TFLOPS with sparsity"),
    GPU("A100-80GB", 312.0, 80, "data-centre", "NVIDIA A100 Tensor Core GPU data sheet: BF16 312 TFLOPS (624 sparse)"),
    GPU("A100-40GB", 312.0, 40, "data-centre", "NVIDIA A100 Tensor Core GPU data sheet: BF16 312 TFLOPS (624 sparse)"),
    GPU("L40S", 362.05, 48, "data-centre", "NVIDIA L40S data sheet: BF16 733 TFLOPS with sparsity"),
    GPU("L4", 121.0, 24, "data-centre", "NVIDIA L4 Tensor Core GPU data sheet: BF16 242 TFLOPS with sparsity"),
    GPU("A10", 125.0, 24, "data-centre", "NVIDIA A10 Tensor Core GPU data sheet: BF16 125 TFLOPS (250 sparse)"),
    GPU("V100-SXM2-32GB", 125.0, 32, "data-centre", "NVIDIA V100 data sheet: FP16 tensor 125 TFLOPS (no bf16)"),
    GPU("T4", 65.0, 16, "data-centre", "NVIDIA T4 data sheet: FP16 tensor 65 TFLOPS (no bf16)"),
    # consumer
    GPU("RTX-4090", 165.2, 24, "consumer",
        "NVIDIA Ada Lovelace architecture whitepaper: RTX 4090 BF16 tensor with FP32 accumulate 165.2 TFLOPS (330.4 sparse)"),
    GPU("RTX-3090", 71.0, 24, "consumer",
        "NVIDIA Ampere GA102 GPU architecture whitepaper: RTX 3090 BF16 tensor with FP32 accumulate 71 TFLOPS (142 sparse)"),
    GPU("RTX-3080", 59.5, 10, "consumer",
        "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix: RTX 3080 (10 GB) FP16/BF16 tensor with FP32 accumulate "
        "59.5 TFLOPS (119 sparse)"),
    GPU("RTX-3070", 40.6, 8, "consumer",
        "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix: RTX 3070 (8 GB) FP16/BF16 tensor with FP32 accumulate "
        "40.6 TFLOPS (81.3 sparse)"),
    # embedded
    GPU("Jetson-AGX-Orin-64GB", 42.5, 64, "embedded",
        "NVIDIA Jetson AGX Orin Series technical brief v1.2: GPU 170 sparse INT8 TOPS; dense FP16 taken as a quarter of "
        "that (sparsity halves, INT8 is twice FP16): derived, not a sheet figure; memory shared with the CPU"),
)}


def gpu(name: str) -> GPU:
    """The catalogue's entry for ``name``; KeyError naming the known ones otherwise."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r} (the catalogue has: {', '.join(CATALOGUE)})") from None
