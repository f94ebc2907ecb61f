"""What importing torchao says on any machine without its CUDA kernels or Triton, left out of our logs.

transformers' model code imports torchao, so ``spantrain export``, the zygote that preloads that code
for an ``hf:`` job, and every peer of one logged five warnings at their start, two of them "Failed to
load ... .so: Could not load this library": the demo's console showed them twice. They speak of
hardware this machine does not have. Only these messages are left out (a command run with ``-vv``
shows them where it imports torchao itself; the zygote always leaves them out); torchao's other
warnings still show.
"""
from __future__ import annotations

import logging

NOISE = {  # logger -> the starts of the messages left out
    "torchao": ("Failed to load ",),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}


def _keep(record: logging.LogRecord) -> bool:
    return not any(str(record.msg).startswith(p) for p in NOISE.get(record.name, ()))


def leave_out() -> None:
    """Filters those messages from their loggers (again: a no-op)."""
    for name in NOISE:
        logging.getLogger(name).addFilter(_keep)
