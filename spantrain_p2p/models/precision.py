"""A job's precision (``--precision``): the compute dtype and what crosses the wire between stages.

Weights, their gradients and the optimizer state stay fp32 whatever the precision; bf16 and fp16
autocast the compute, and fp16 scales the loss (``pipeline.loss_scale``).
"""
from __future__ import annotations

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtype (fp32: none)
WIRE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # activations and their gradients


def wire_dtype_bytes(precision: str) -> int:
    """Bytes per value of the activations and gradients a job of ``precision`` sends."""
    return getattr(torch, WIRE_DTYPES[precision]).itemsize
