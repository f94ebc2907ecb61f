"""Tensor messages between pipeline stages: activations downstream, their gradients upstream.

A message is one frame (see ``net.framing``): header ``{"v", "kind", "job", "epoch", "step",
"mb", "src", "dtype", "shape"}`` and one raw buffer of the tensor's bytes (float32, float16 or
bfloat16: activations and their gradients cross the wire in the job's compute dtype), or a
codec's buffers (``comp``: they decode to float32, then to the expected dtype). The receiver
checks every field against what its stage map says it must get; anything else is a ``FrameError``.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..compress import codecs
from ..net.framing import FrameError, check_fields

MESSAGE_VERSION = 1
ACT, GRAD, GSUM = "act", "grad", "gsum"  # activations, their gradients, weight gradients to sum
AMP = "amp"  # fp16: a peer's overflow flag, and the swarm's verdict (pipeline.loss_scale)
WGAT = "wgat"  # a sharded stage's new weights, from the replica that owns their optimizer state (train.shard)
REPLICA_KINDS = (GSUM, AMP, WGAT)  # messages between the replicas of a stage: one slot per sender
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# numpy has no bfloat16: its 2-byte values travel as int16 and are viewed back as bfloat16
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}
MAX_DIMS = 8


def encode_tensor(kind: str, job_id: str, epoch: int, step: int, mb: int, src: str, t: torch.Tensor,
                  codec: str = "none", feedback: Optional[codecs.ErrorFeedback] = None,
                  slot: object = None) -> tuple[dict, list[memoryview]]:
    """The message for ``t``; ``codec`` (a spec such as "int8" or "topk:0.05") compresses it, and
    with ``feedback`` the part a lossy codec drops is carried over to the next tensor of ``slot``."""
    t = t.detach().contiguous()
    dtype = next((n for n, d in DTYPES.items() if d == t.dtype), None)
    if dtype is None:
        raise ValueError(f"cannot send tensors of dtype {t.dtype}")
    header = {"v": MESSAGE_VERSION, "kind": kind, "job": job_id, "epoch": epoch, "step": step, "mb": mb,
              "src": src, "dtype": dtype, "shape": list(t.shape)}
    if codec == "none":
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return header, [memoryview(raw.numpy()).cast("B")]
    name, params = codecs.parse_spec(codec)
    if feedback is not None:
        meta, bufs = feedback.encode(slot, name, t.float(), **params)
    else:
        meta, bufs = codecs.encode(name, t.float(), **params)
    header["comp"] = meta
    return header, bufs


@dataclass(frozen=True)
class Expect:
    """What a stage accepts for one kind of message under its current stage map."""

    kind: str
    job_id: str
    epoch: int
    src: frozenset[str]  # peers allowed to send it
    shape: tuple[int, ...]
    num_microbatches: int  # valid "mb" values: 0 .. num_microbatches - 1
    dtype: str = "float32"
    shapes_by_mb: tuple[tuple[int, ...], ...] = ()  # when the shape depends on "mb" (e.g. one per layer)


def decode_tensor(header: dict, buffers: list[memoryview], expect: Expect, steps: tuple[int, int]) -> tuple[int, int, torch.Tensor]:
    """(step, micro-batch, tensor) of a validated message; FrameError naming the first bad field."""
    check_fields(header, {"v": int, "kind": str, "job": str, "epoch": int, "step": int, "mb": int,
                          "src": str, "dtype": str, "shape": list})
    if header["v"] != MESSAGE_VERSION:
        raise FrameError(f"message version {header['v']}, this peer reads {MESSAGE_VERSION}")
    if header["kind"] != expect.kind:
        raise FrameError(f"message kind {header['kind']!r} sent to the {expect.kind!r} endpoint")
    if header["job"] != expect.job_id:
        raise FrameError(f"message for job {header['job'][:16]!r}, this peer runs {expect.job_id[:16]!r}")
    if header["epoch"] != expect.epoch:
        raise FrameError(f"message for stage-map epoch {header['epoch']}, this peer is at epoch {expect.epoch}")
    if header["src"] not in expect.src:
        raise FrameError(f"{expect.kind} from {header['src'][:16]}…, which is not a neighbour of this stage")
    step, mb = header["step"], header["mb"]
    if not steps[0] <= step <= steps[1]:
        raise FrameError(f"message for step {step}, this stage accepts steps {steps[0]}..{steps[1]}")
    if not 0 <= mb < expect.num_microbatches:
        raise FrameError(f"micro-batch {mb} out of range 0..{expect.num_microbatches - 1}")
    if header["dtype"] != expect.dtype:
        raise FrameError(f"dtype {header['dtype']!r}, expected {expect.dtype!r}")
    shape = header["shape"]
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise FrameError("shape must be a short list of ints")
    want_shape = expect.shapes_by_mb[mb] if expect.shapes_by_mb else expect.shape
    if tuple(shape) != want_shape:
        raise FrameError(f"shape {shape}, expected {list(want_shape)}")
    comp = header.get("comp")
    if comp is not None:
        if not isinstance(comp, dict):
            raise FrameError("'comp' must be a map")
        try:
            t = codecs.decode(comp, buffers, want_shape)
        except codecs.CodecError as e:
            raise FrameError(f"compressed tensor rejected: {e}") from None
        return step, mb, t.to(DTYPES[expect.dtype])
    if len(buffers) != 1:
        raise FrameError(f"a tensor message carries 1 buffer, not {len(buffers)}")
    want = math.prod(shape) * np.dtype(_NP[expect.dtype]).itemsize
    if buffers[0].nbytes != want:
        raise FrameError(f"tensor of {buffers[0].nbytes} bytes, shape {shape} {expect.dtype} needs {want}")
    arr = np.frombuffer(buffers[0], dtype=_NP[expect.dtype]).reshape(shape)
    if not arr.flags.writeable:
        arr = arr.copy()  # a read-only frame (bytes): the tensor gets memory of its own
    t = torch.from_numpy(arr)
    if expect.dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    if t.numel() and not all(math.isfinite(x) for x in torch.aminmax(t)):  # NaN wins min and max: one pass
        raise FrameError("tensor holds NaN or infinite values")
    return step, mb, t


class _Slot:
    """A key's tensor once filed, and the future its one taker waits on until then."""
    __slots__ = ("tensor", "waiter")

    def __init__(self) -> None:
        self.tensor: Optional[torch.Tensor] = None
        self.waiter: Optional[asyncio.Future] = None


class Inbox:
    """Received tensors by (kind, step, micro-batch), awaited with deadlines; bounded.
    A tensor filed for a waiting taker wakes it at the loop's next turn: the taker awaits a future
    of its own that ``put`` sets, not the slot's future through ``asyncio.shield``, which took two
    turns (the shield's callback, then the task's wake-up) on a loop that may wait for a core
    between them (issue 31: a filed tensor's wait for its op, 90th percentile 2.4 ms)."""

    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self._slots: dict[tuple[str, int, int], _Slot] = {}

    def put(self, key: tuple[str, int, int], tensor: torch.Tensor) -> None:
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= self.max_pending:
                raise FrameError(f"inbox full ({self.max_pending} pending messages)")
            slot = self._slots[key] = _Slot()
        if slot.tensor is not None:
            raise FrameError(f"duplicate {key[0]} for step {key[1]} micro-batch {key[2]}")
        slot.tensor = tensor
        if slot.waiter is not None and not slot.waiter.done():
            slot.waiter.set_result(None)

    def arrived(self, key: tuple[str, int, int]) -> bool:
        """Whether ``get(key)`` has its tensor now."""
        slot = self._slots.get(key)
        return slot is not None and slot.tensor is not None

    async def get(self, key: tuple[str, int, int], timeout: float) -> torch.Tensor:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
        try:
            if slot.tensor is None:  # (one that came first is taken as it is: no timer, no waiter)
                # a timeout cancels the waiter alone: the slot stays, and takes the tensor when it comes;
                # ``asyncio.timeout``, not ``wait_for``: no task of its own for each message
                slot.waiter = asyncio.get_running_loop().create_future()
                async with asyncio.timeout(timeout):
                    await slot.waiter
            return slot.tensor
        except TimeoutError:
            raise TimeoutError(f"no {key[0]} for step {key[1]} micro-batch {key[2]} within {timeout:.0f}s") from None
        finally:
            slot.waiter = None
            if slot.tensor is not None and self._slots.get(key) is slot:
                del self._slots[key]

    def drop_before(self, step: int) -> None:
        for key in [k for k in self._slots if k[1] < step]:
            slot = self._slots.pop(key)
            if slot.waiter is not None and not slot.waiter.done():
                slot.waiter.cancel()

    def clear(self) -> None:
        self.drop_before(2**62)
