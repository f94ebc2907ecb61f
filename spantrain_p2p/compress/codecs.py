"""Codecs for the tensors sent between pipeline stages: pure functions over tensors and bytes.

``encode(name, tensor, **params) -> (meta, buffers)`` gives small plain data for the message header
and the raw buffers to send after it; ``decode(meta, buffers, shape, max_bytes)`` checks everything
that came from the network and gives back a float32 tensor, or raises ``CodecError`` naming the
first thing wrong. Formats (little-endian; ``n`` values, the tensor flattened in row-major order):

``none``  one buffer: n float32. Lossless.
``fp16``  one buffer: n float16. Encoding refuses values beyond fp16's range (±65504).
``int8``  blockwise absmax: the flat tensor is cut into blocks of ``block`` values (default 256;
          the last block may be shorter). Buffers: q, n int8 in [-127, 127], q = round(x·127/absmax);
          scales, one float32 absmax/127 per block. Blockwise rather than per-channel because it does
          not depend on the tensor's layout and an outlier only coarsens its own 256 values;
          ~0.66 % relative L2 error on gaussian data, wire 0.25 + 1/block of fp32.
``int``   the same blockwise absmax with ``bits`` (2..7) per value instead of 8: q in [-L, L],
          L = 2^(bits−1) − 1, sent as q + L in ``bits`` bits each, packed into bytes most significant
          bit first (numpy's packbits order), the last byte padded with zeros; then the scales.
          Wire bits/32 + 1/block of fp32; 6 bits: ~2.7 % relative L2 error on gaussian data.
``topk``  the k = max(1, round(ratio·n)) largest magnitudes, ``0 < ratio <= 0.5``. Buffers: indices,
          k int32 strictly increasing (so unique and cheap to check); values, k float16 divided by
          ``scale`` (|v| <= 1, so fp16 neither overflows nor flushes small gradients to zero) and
          scale, one float32 (the largest kept magnitude); or with ``values="fp32"`` k float32 values
          as they are and no scale. Wire 1.5·ratio (fp16) or 2·ratio (fp32) of fp32.

``meta`` is ``{"codec": name}`` plus what decoding needs: ``block`` for int8, ``k`` and ``values``
for topk. Buffer lengths are implied by meta and the shape, which the receiver takes from its stage
map, never from the sender. ``ErrorFeedback`` keeps what a lossy gradient codec dropped and adds it
to the next gradient of the same slot.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Any, Collection, Hashable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

log = logging.getLogger(__name__)

CODECS = ("none", "fp16", "int8", "int", "topk")  # lightest (least lossy) first
DEFAULT_MAX_BYTES = 256 << 20  # same as a data-plane frame
MAX_DIMS = 8
INT8_BLOCK_DEFAULT, INT8_BLOCK_MIN, INT8_BLOCK_MAX = 256, 16, 1 << 16
INT_BITS_MIN, INT_BITS_MAX, INT_BITS_DEFAULT = 2, 7, 6
TOPK_RATIO_DEFAULT, TOPK_RATIO_MIN, TOPK_RATIO_MAX = 0.1, 1e-5, 0.5
TOPK_VALUES = ("fp16", "fp32")
_F32_MAX = float(np.finfo(np.float32).max)
_F16_MAX = float(np.finfo(np.float16).max)
_F32, _F16, _I32 = np.dtype("<f4"), np.dtype("<f2"), np.dtype("<i4")

Buffer = Union[bytes, bytearray, memoryview]


class CodecError(ValueError):
    """A compressed tensor (or request to make one) that is malformed or over a limit."""


# ---- parameters --------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def check_params(name: str, params: Mapping[str, Any]) -> dict:
    """The full, validated parameters of codec ``name`` (defaults filled in); CodecError if not."""
    if not isinstance(name, str) or name not in CODECS:
        raise CodecError(f"unknown codec {str(name)[:32]!r}; known: {', '.join(CODECS)}")
    allowed = {"none": (), "fp16": (), "int8": ("block",), "int": ("bits", "block"), "topk": ("ratio", "values")}[name]
    extra = sorted(set(params) - set(allowed))
    if extra:
        raise CodecError(f"codec {name} takes no parameter {extra[0]!r}"
                         + (f" (it takes {', '.join(allowed)})" if allowed else ""))
    if name in ("int8", "int"):
        block = params.get("block", INT8_BLOCK_DEFAULT)
        if not _is_int(block) or not INT8_BLOCK_MIN <= block <= INT8_BLOCK_MAX:
            raise CodecError(f"{name} block must be an int in {INT8_BLOCK_MIN}..{INT8_BLOCK_MAX}, not {block!r}")
        if name == "int8":
            return {"block": int(block)}
        bits = params.get("bits", INT_BITS_DEFAULT)
        if not _is_int(bits) or not INT_BITS_MIN <= bits <= INT_BITS_MAX:
            raise CodecError(f"int bits must be an int in {INT_BITS_MIN}..{INT_BITS_MAX}, not {bits!r}")
        return {"bits": int(bits), "block": int(block)}
    if name == "topk":
        ratio = params.get("ratio", TOPK_RATIO_DEFAULT)
        if not _is_num(ratio) or not (TOPK_RATIO_MIN <= ratio <= TOPK_RATIO_MAX):  # NaN fails too
            raise CodecError(f"topk ratio must be a number in {TOPK_RATIO_MIN:g}..{TOPK_RATIO_MAX:g}, not {ratio!r}")
        values = params.get("values", "fp16")
        if values not in TOPK_VALUES:
            raise CodecError(f"topk values must be one of {', '.join(TOPK_VALUES)}, not {values!r}")
        return {"ratio": float(ratio), "values": values}
    return {}


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"none"``, ``"fp16"``, ``"int8"``, ``"int8:512"``, ``"int:6"``, ``"int:6:128"`` (bits, block),
    ``"topk:0.1"``, ``"topk:0.1:fp32"`` →
    (name, params), the spelling used in plans (``Plan.compression``)."""
    if not isinstance(spec, str):
        raise CodecError(f"a codec spec is a string, not {type(spec).__name__}")
    name, *args = spec.split(":")
    params: dict[str, Any] = {}
    try:
        if name == "int8" and len(args) == 1:
            params["block"] = int(args[0])
        elif name == "int" and 1 <= len(args) <= 2:
            params["bits"] = int(args[0])
            if len(args) == 2:
                params["block"] = int(args[1])
        elif name == "topk" and 1 <= len(args) <= 2:
            params["ratio"] = float(args[0])
            if len(args) == 2:
                params["values"] = args[1]
        elif args:
            raise ValueError
    except ValueError:
        raise CodecError(f"cannot read codec spec {spec[:40]!r}; e.g. none, fp16, int8, int:6, topk:0.1") from None
    return name, check_params(name, params)


def spec(name: str, params: Optional[Mapping[str, Any]] = None) -> str:
    """The spec string of (name, params), inverse of ``parse_spec``; defaults left out except topk's ratio."""
    p = check_params(name, params or {})
    if name == "int8" and p["block"] != INT8_BLOCK_DEFAULT:
        return f"int8:{p['block']}"
    if name == "int":
        return f"int:{p['bits']}" + (f":{p['block']}" if p["block"] != INT8_BLOCK_DEFAULT else "")
    if name == "topk":
        return f"topk:{p['ratio']:g}" + (":fp32" if p["values"] == "fp32" else "")
    return name


def _resolve(name: str, params: Mapping[str, Any]) -> tuple[str, dict]:
    if isinstance(name, str) and ":" in name:
        base, p = parse_spec(name)
        return base, check_params(base, {**p, **params})
    return name, check_params(name, params)


def topk_count(n: int, ratio: float) -> int:
    """How many values topk keeps out of ``n``: round(ratio·n), at least 1 (0 for an empty tensor)."""
    return 0 if n == 0 else min(n, max(1, int(round(ratio * n))))


def _topk_max_count(n: int) -> int:
    return 0 if n == 0 else min(n, max(1, math.ceil(TOPK_RATIO_MAX * n)))


def _buffer_lengths(meta: Mapping[str, Any], n: int) -> list[int]:
    codec = meta["codec"]
    if codec == "none":
        return [4 * n]
    if codec == "fp16":
        return [2 * n]
    if codec == "int8":
        return [n, 4 * (-(-n // meta["block"]))]
    if codec == "int":
        return [-(-n * meta["bits"] // 8), 4 * (-(-n // meta["block"]))]
    k = meta["k"]
    return [4 * k, 2 * k, 4] if meta["values"] == "fp16" else [4 * k, 4 * k]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def wire_bytes(name: str, shape: Sequence[int], **params: Any) -> int:
    """Bytes of buffers ``encode`` produces for a tensor of ``shape`` (header not counted)."""
    name, p = _resolve(name, params)
    n = _numel(shape)
    meta = {"codec": name, **p}
    if name == "topk":
        meta = {"codec": name, "k": topk_count(n, p["ratio"]), "values": p["values"]}
    return sum(_buffer_lengths(meta, n))


def wire_ratio(name: str, shape: Sequence[int], **params: Any) -> float:
    """Bytes on the wire / bytes of the tensor as float32, for the planner's cost model
    (none 1, fp16 0.5, int8 0.25 + 1/block, topk 1.5·ratio with fp16 values); 1.0 for an empty tensor."""
    n = _numel(shape)
    return wire_bytes(name, shape, **params) / (4 * n) if n else 1.0


# ---- encode ------------------------------------------------------------------------------------

def _mv(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1)).cast("B")


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous float32 numpy view (or copy) of a floating-point tensor; CodecError if it is not
    one, or holds NaN/inf. The codecs run in numpy: single-threaded, which on a busy 2-core host is
    far faster than torch's OpenMP kernels for these memory-bound passes."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise CodecError(f"can only encode floating-point tensors, not {getattr(tensor, 'dtype', type(tensor))}")
    if tensor.dim() > MAX_DIMS:
        raise CodecError(f"tensor of {tensor.dim()} dimensions, at most {MAX_DIMS}")
    a = np.ascontiguousarray(tensor.detach().to(device="cpu", dtype=torch.float32).numpy())
    if a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):  # min/max propagate NaN
        raise CodecError("cannot encode a tensor holding NaN or infinite values")
    return a


def encode(name: str, tensor: torch.Tensor, **params: Any) -> tuple[dict, list[memoryview]]:
    """(meta for the header, buffers to send) of ``tensor`` under codec ``name`` (or a spec such as
    ``"topk:0.05"``). The tensor must be floating point and finite. With ``none`` the buffer is a view
    of the tensor's memory (no copy): do not change the tensor until it is sent."""
    name, p = _resolve(name, params)
    a = _as_array(tensor)
    return _encode_array(name, p, a)


def _encode_array(name: str, p: dict, a: np.ndarray) -> tuple[dict, list[memoryview]]:
    if name == "none":
        return {"codec": "none"}, [_mv(a.astype(_F32, copy=False))]
    if name == "fp16":
        if a.size and max(-float(a.min()), float(a.max())) > _F16_MAX:
            raise CodecError(f"tensor holds values beyond fp16's range (±{_F16_MAX:g}); use int8 or none")
        return {"codec": "fp16"}, [_mv(a.astype(_F16))]
    if name == "int8":
        return _encode_int8(a.reshape(-1), p["block"])
    if name == "int":
        return _encode_int(a.reshape(-1), p["bits"], p["block"])
    return _encode_topk(a.reshape(-1), p["ratio"], p["values"])


def _quantize(flat: np.ndarray, block: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(q in [-levels, levels] as int8, one float32 scale absmax/levels per block)."""
    n = flat.size
    nb = -(-n // block)
    xb = (np.concatenate([flat, np.zeros(nb * block - n, np.float32)]) if nb * block != n else flat).reshape(nb, block)
    amax = np.maximum(xb.max(axis=1), -xb.min(axis=1)) if n else np.zeros(0, np.float32)
    # a block whose absmax is below ~1e-36 is sent as zeros (levels/absmax would overflow float32)
    big = amax > np.float32(1e-36)
    inv = np.where(big, np.float32(levels) / np.where(big, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    y = xb * inv[:, None]
    np.rint(y, out=y)
    np.clip(y, -levels, levels, out=y)
    return y.astype(np.int8).reshape(-1)[:n], (amax / np.float32(levels)).astype(_F32)


def _encode_int(flat: np.ndarray, bits: int, block: int) -> tuple[dict, list[memoryview]]:
    levels = (1 << (bits - 1)) - 1
    q, scales = _quantize(flat, block, levels)
    u = (q.astype(np.int16) + levels).astype(np.uint8)  # 0 .. 2·levels
    packed = np.packbits(np.unpackbits(u[:, None], axis=1)[:, 8 - bits:].reshape(-1))
    return {"codec": "int", "bits": bits, "block": block}, [_mv(packed), _mv(scales)]


def _encode_int8(flat: np.ndarray, block: int) -> tuple[dict, list[memoryview]]:
    q, scales = _quantize(flat, block, 127)
    return {"codec": "int8", "block": block}, [_mv(q), _mv(scales)]


def _encode_topk(flat: np.ndarray, ratio: float, values: str) -> tuple[dict, list[memoryview]]:
    n = flat.size
    k = topk_count(n, ratio)
    # argpartition is O(n): several times faster than torch.topk here
    idx = np.arange(n) if k >= n else np.argpartition(np.abs(flat), n - k)[n - k:]
    idx = np.sort(idx).astype(_I32)
    vals = flat[idx]
    meta = {"codec": "topk", "k": k, "values": values}
    if values == "fp32":
        return meta, [_mv(idx), _mv(vals.astype(_F32))]
    scale = np.float32(np.abs(vals).max()) if k else np.float32(0)
    v16 = (vals / scale if scale > 0 else vals).astype(_F16)
    return meta, [_mv(idx), _mv(v16), _mv(np.array([scale], dtype=_F32))]


# ---- decode ------------------------------------------------------------------------------------

def _check_meta(meta: Any, n: int) -> dict:
    if not isinstance(meta, Mapping):
        raise CodecError(f"codec meta must be a map, not {type(meta).__name__}")
    codec = meta.get("codec")
    if not isinstance(codec, str) or codec not in CODECS:
        raise CodecError(f"unknown codec {str(codec)[:32]!r}; known: {', '.join(CODECS)}")
    fields = {"none": (), "fp16": (), "int8": ("block",), "int": ("bits", "block"), "topk": ("k", "values")}[codec]
    extra = sorted(str(f)[:32] for f in set(meta) - {"codec", *fields})
    if extra:
        raise CodecError(f"{codec} meta has unexpected field {extra[0]!r}")
    missing = [f for f in fields if f not in meta]
    if missing:
        raise CodecError(f"{codec} meta lacks field {missing[0]!r}")
    out = {"codec": codec}
    if codec == "int8":
        out.update(check_params("int8", {"block": meta["block"]}))
    elif codec == "int":
        out.update(check_params("int", {"bits": meta["bits"], "block": meta["block"]}))
    elif codec == "topk":
        k, values, kmax = meta["k"], meta["values"], _topk_max_count(n)
        if not _is_int(k) or not (min(1, n) <= k <= kmax):
            raise CodecError(f"topk k={str(k)[:24]} out of range {min(1, n)}..{kmax} for {n} values")
        if values not in TOPK_VALUES:
            raise CodecError(f"topk values must be one of {', '.join(TOPK_VALUES)}, not {str(values)[:16]!r}")
        out.update(k=int(k), values=values)
    return out


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or len(shape) > MAX_DIMS:
        raise CodecError(f"shape must be a list of at most {MAX_DIMS} sizes")
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise CodecError(f"shape {list(shape)[:MAX_DIMS]} must hold non-negative ints")
    return tuple(int(d) for d in shape)


def _views(buffers: Any) -> list[memoryview]:
    if not isinstance(buffers, (list, tuple)):
        raise CodecError(f"buffers must be a list, not {type(buffers).__name__}")
    out = []
    for i, b in enumerate(buffers):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise CodecError(f"buffer {i} is a {type(b).__name__}, not bytes")
        try:
            out.append(memoryview(b).cast("B"))
        except TypeError:
            raise CodecError(f"buffer {i} is not a contiguous byte buffer") from None
    return out


def decode(meta: Mapping[str, Any], buffers: Sequence[Buffer], shape: Sequence[int],
           max_bytes: int = DEFAULT_MAX_BYTES, allowed: Optional[Collection[str]] = None) -> torch.Tensor:
    """The float32 tensor of ``shape`` (the receiver's expectation, not the sender's word) from
    untrusted ``meta`` and ``buffers``. ``max_bytes`` bounds both the decoded tensor (4 bytes a value)
    and the bytes received; ``allowed`` optionally restricts the codecs accepted. Every length is
    checked before anything is allocated; CodecError names the first problem found."""
    shape = _check_shape(shape)
    n = _numel(shape)
    if 4 * n > max_bytes:
        raise CodecError(f"tensor of shape {list(shape)} is {4 * n} bytes as float32, over the {max_bytes}-byte limit")
    views = _views(buffers)
    got = sum(v.nbytes for v in views)
    if got > max_bytes:
        raise CodecError(f"{got} bytes of buffers, over the {max_bytes}-byte limit")
    m = _check_meta(meta, n)
    if allowed is not None and m["codec"] not in allowed:
        raise CodecError(f"codec {m['codec']} is not accepted here (accepted: {', '.join(sorted(allowed))})")
    want = _buffer_lengths(m, n)
    if len(views) != len(want):
        raise CodecError(f"{m['codec']} carries {len(want)} buffer(s), got {len(views)}")
    for i, (v, w) in enumerate(zip(views, want)):
        if v.nbytes != w:
            raise CodecError(f"{m['codec']} buffer {i} is {v.nbytes} bytes; shape {list(shape)} with {_describe(m)} needs {w}")
    return torch.from_numpy(_DECODERS[m["codec"]](m, views, n).reshape(shape))


def _describe(m: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in m.items() if k != "codec") or "no parameters"


def _finite_or_raise(arr: np.ndarray, what: str) -> None:
    if not np.isfinite(arr).all():
        raise CodecError(f"{what} holds NaN or infinite values")


def _dec_none(m: dict, views: list[memoryview], n: int) -> np.ndarray:
    arr = np.frombuffer(views[0], dtype=_F32).astype(np.float32)  # a writable copy in native order
    _finite_or_raise(arr, "tensor")
    return arr


def _dec_fp16(m: dict, views: list[memoryview], n: int) -> np.ndarray:
    arr = np.frombuffer(views[0], dtype=_F16).astype(np.float32)
    _finite_or_raise(arr, "fp16 tensor")
    return arr


def _dec_int8(m: dict, views: list[memoryview], n: int) -> np.ndarray:
    q = np.frombuffer(views[0], dtype=np.int8)
    scales = np.frombuffer(views[1], dtype=_F32).astype(np.float32)
    _finite_or_raise(scales, "int8 scales")
    if scales.size and (scales.min() < 0 or scales.max() > _F32_MAX / 127):
        raise CodecError(f"int8 scales must lie in 0..{_F32_MAX / 127:.3g}")
    if n and q.min() < -127:
        raise CodecError("int8 values must lie in -127..127 (-128 is not produced by this codec)")
    return _dequant_int8(q, scales, m["block"], n)


def _dec_int(m: dict, views: list[memoryview], n: int) -> np.ndarray:
    bits, levels = m["bits"], (1 << (m["bits"] - 1)) - 1
    scales = np.frombuffer(views[1], dtype=_F32).astype(np.float32)
    _finite_or_raise(scales, "int scales")
    if scales.size and (scales.min() < 0 or scales.max() > _F32_MAX / levels):
        raise CodecError(f"int scales must lie in 0..{_F32_MAX / levels:.3g}")
    stream = np.unpackbits(np.frombuffer(views[0], dtype=np.uint8))
    if stream[n * bits:].any():
        raise CodecError("int padding bits must be zero")
    wide = np.zeros((n, 8), dtype=np.uint8)
    wide[:, 8 - bits:] = stream[: n * bits].reshape(n, bits)
    u = np.packbits(wide, axis=1).reshape(-1)
    if n and u.max() > 2 * levels:
        raise CodecError(f"int{bits} values must lie in 0..{2 * levels} (offset by {levels})")
    q = (u.astype(np.int16) - levels).astype(np.int8)
    return _dequant_int8(q, scales, m["block"], n)


def _dequant_int8(q: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
    out = q.astype(np.float32)
    full = (n // block) * block
    if full:
        blocks = out[:full].reshape(-1, block)  # a view: scaled in place
        blocks *= scales[: n // block, None]
    if full < n:
        out[full:] *= scales[-1]
    return out


def _dec_topk(m: dict, views: list[memoryview], n: int) -> np.ndarray:
    k = m["k"]
    idx = np.frombuffer(views[0], dtype=_I32)
    if k:
        if idx.min() < 0 or idx.max() >= n:
            raise CodecError(f"topk index out of range 0..{n - 1} (got {int(idx.min())}..{int(idx.max())})")
        step = np.diff(idx)  # no overflow: all in 0..n-1
        if (step == 0).any():
            raise CodecError("topk indices hold a duplicate")
        if (step < 0).any():
            raise CodecError("topk indices must be strictly increasing")
    if m["values"] == "fp32":
        vals = np.frombuffer(views[1], dtype=_F32).astype(np.float32)
        _finite_or_raise(vals, "topk values")
    else:
        vals = np.frombuffer(views[1], dtype=_F16).astype(np.float32)
        scale = np.frombuffer(views[2], dtype=_F32).astype(np.float32)
        _finite_or_raise(vals, "topk values")
        _finite_or_raise(scale, "topk scale")
        if not 0 <= scale[0] <= _F32_MAX:
            raise CodecError(f"topk scale must be non-negative, not {float(scale[0]):g}")
        if k and np.abs(vals).max() > 1:
            raise CodecError("topk fp16 values must lie in -1..1 (they are divided by the scale)")
        vals *= scale[0]
    out = np.zeros(n, dtype=np.float32)
    out[idx] = vals
    return out


_DECODERS = {"none": _dec_none, "fp16": _dec_fp16, "int8": _dec_int8, "int": _dec_int, "topk": _dec_topk}


def roundtrip(name: str, tensor: torch.Tensor, **params: Any) -> torch.Tensor:
    """decode(encode(tensor)): what the receiver would get, as float32 of the same shape."""
    meta, bufs = encode(name, tensor, **params)
    return decode(meta, bufs, tuple(tensor.shape), max_bytes=max(DEFAULT_MAX_BYTES, 8 * tensor.numel() + 64))


def fidelity(name: str, tensor: torch.Tensor, **params: Any) -> float:
    """1 − ‖decode(encode(x)) − x‖₂ / ‖x‖₂, floored at 0 (1.0 for an all-zero tensor)."""
    x = _as_array(tensor).reshape(-1).astype(np.float64)
    norm = float(np.sqrt(np.dot(x, x)))
    if norm == 0.0:
        return 1.0
    d = roundtrip(name, tensor, **params).numpy().reshape(-1) - x
    return max(0.0, 1.0 - float(np.sqrt(np.dot(d, d))) / norm)


# ---- error feedback ------------------------------------------------------------------------------

class ErrorFeedback:
    """Residual memory for lossy compression of gradients (error feedback, as in Deep Gradient
    Compression and FusionLLM's AdaTopK): each call sends ``g + residual`` through the codec and keeps
    what the receiver will not get (``g + residual − decoded``) as the slot's next residual. Over many
    steps the sum of what was sent equals the sum of the true gradients minus the last residual, so
    nothing is lost, only delayed. Works with any codec (int8 and fp16 too); ``none`` keeps nothing.

    ``slot`` is any hashable naming one stream of tensors that recur step after step: it must not
    include the step number. E.g. ``(link, micro_batch_index)`` for the activation gradients one
    stage sends upstream (each micro-batch index is a slot of its own, so that a residual is added
    to the gradient of the same position in the next step's schedule), or ``(group, param_name)`` for
    weight gradients. When a slot's tensor changes shape (a short last micro-batch, a new stage map
    with another micro-batch size) its residual is dropped, that mass is lost once, and ``resets``
    counts it. At most ``max_slots`` residuals are kept (float32, the size of the tensor each); the
    least recently used is dropped beyond that. Call ``clear()`` after a re-plan that moves layers.
    """

    def __init__(self, max_slots: int = 4096):
        if max_slots < 1:
            raise ValueError("max_slots must be at least 1")
        self.max_slots = max_slots
        self.resets = 0
        self._residual: OrderedDict[Hashable, np.ndarray] = OrderedDict()

    def encode(self, slot: Hashable, name: str, grad: torch.Tensor, **params: Any) -> tuple[dict, list[memoryview]]:
        """(meta, buffers) of ``grad`` plus the slot's residual under codec ``name`` (or a spec such
        as ``"topk:0.05"``); updates the slot's residual. ``grad`` itself is not modified."""
        base, p = _resolve(name, params)
        g = _as_array(grad)
        r = self._residual.pop(slot, None)
        if r is not None and r.shape != g.shape:
            log.debug("error feedback slot %r: shape %s -> %s, residual dropped", slot, r.shape, g.shape)
            self.resets += 1
            r = None
        if r is None:
            x = g.copy() if base != "none" else g
        else:
            x = np.add(g, r, out=r)  # the residual's buffer becomes g + residual, then the next residual
            if not (np.isfinite(x.min()) and np.isfinite(x.max())):
                raise CodecError(f"gradient plus residual of slot {slot!r} overflows float32")
        meta, bufs = _encode_array(base, p, x)
        if base != "none":  # every lossy encoder copies, so x is free to become the residual
            x -= _DECODERS[base](meta, [memoryview(b) for b in bufs], x.size).reshape(x.shape)
            self._residual[slot] = x
            while len(self._residual) > self.max_slots:
                self._residual.popitem(last=False)
        return meta, bufs

    def residual(self, slot: Hashable) -> Optional[torch.Tensor]:
        """A copy of the slot's residual (what has not reached the receiver yet), or None."""
        r = self._residual.get(slot)
        return None if r is None else torch.from_numpy(r.copy())

    def clear(self, slot: Optional[Hashable] = None) -> None:
        if slot is None:
            self._residual.clear()
        else:
            self._residual.pop(slot, None)

    def __len__(self) -> int:
        return len(self._residual)

    @property
    def residual_bytes(self) -> int:
        return sum(r.nbytes for r in self._residual.values())
