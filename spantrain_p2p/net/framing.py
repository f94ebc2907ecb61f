"""Framed messages of the data plane: a msgpack header, then raw buffers.

Wire form: ``b"STP1"`` magic, a 4-byte big-endian header length, the msgpack header (a map with
``"buffers": [len, …]`` listing the byte length of each raw buffer that follows), then the buffers
back to back. Every length is checked against the bytes actually present and against limits
before anything is allocated, so a hostile or truncated frame gives ``FrameError``, never a crash.

Untrusted content: ``check_fields`` checks a frame header's fields; ``strict_from_dict`` builds a
frozen dataclass (a measurement, a profile, a config) from an untrusted map.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
import types
import typing
from typing import Any, Iterable, Optional, Sequence, TypeVar

import msgpack

T = TypeVar("T")

MAGIC = b"STP1"
_PREFIX = struct.Struct(">4sI")
MAX_HEADER_BYTES = 64 << 10
MAX_BUFFERS = 64
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20


class FrameError(ValueError):
    """A frame that is malformed or over a limit; the message says which."""


def encode(header: dict, buffers: Sequence[bytes | memoryview] = ()) -> list[bytes | memoryview]:
    """The frame as a list of chunks (header bytes first, then the buffers uncopied)."""
    if "buffers" in header:
        raise ValueError("'buffers' is reserved in frame headers")
    views = [memoryview(b).cast("B") for b in buffers]
    head = msgpack.packb({**header, "buffers": [v.nbytes for v in views]}, use_bin_type=True)
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header is {len(head)} bytes, over {MAX_HEADER_BYTES}")
    return [_PREFIX.pack(MAGIC, len(head)) + head, *views]


def frame_size(chunks: Sequence[bytes | memoryview]) -> int:
    return sum(memoryview(c).nbytes for c in chunks)


def decode_header(prefix_and_header: bytes | memoryview) -> tuple[dict, int]:
    """Parses magic + length + header from the start of a frame (bytes, or a view of the whole
    frame: nothing is copied but the header's own fields): (header, bytes consumed)."""
    if len(prefix_and_header) < _PREFIX.size:
        raise FrameError("frame shorter than its prefix")
    magic, hlen = _PREFIX.unpack_from(prefix_and_header)
    if magic != MAGIC:
        raise FrameError("not a SpanTrain frame (bad magic)")
    if hlen > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {hlen} bytes is over the {MAX_HEADER_BYTES} limit")
    end = _PREFIX.size + hlen
    if len(prefix_and_header) < end:
        raise FrameError("frame truncated inside its header")
    try:
        header = msgpack.unpackb(
            prefix_and_header[_PREFIX.size : end], raw=False, strict_map_key=True, max_bin_len=0
        )
    except Exception as e:
        raise FrameError(f"frame header is not valid msgpack ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise FrameError("frame header must be a map")
    lens = header.get("buffers")
    if not isinstance(lens, list) or len(lens) > MAX_BUFFERS or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lens
    ):
        raise FrameError(f"frame header needs 'buffers': a list of at most {MAX_BUFFERS} byte lengths")
    return header, end


def decode(frame: bytes | memoryview, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[dict, list[memoryview]]:
    """(header, buffers) of a whole frame; buffers are views into ``frame`` (no copy)."""
    view = memoryview(frame).cast("B")
    if view.nbytes > max_bytes:
        raise FrameError(f"frame of {view.nbytes} bytes is over the {max_bytes}-byte limit")
    # the view itself: copying its first 64 KiB as bytes cost every tensor message that much memory
    # traffic on the receiving event loop, for a header of a few hundred bytes
    header, pos = decode_header(view)
    lens = header.pop("buffers")
    if pos + sum(lens) != view.nbytes:
        raise FrameError(f"frame length {view.nbytes} does not match its header ({pos} + {sum(lens)} bytes)")
    buffers = []
    for n in lens:
        buffers.append(view[pos : pos + n])
        pos += n
    return header, buffers


def check_fields(header: dict, spec: dict[str, type | tuple[type, ...]]) -> None:
    """Raises FrameError unless each named header field is present with the given type."""
    for name, typ in spec.items():
        v: Any = header.get(name)
        if v is None or isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
            raise FrameError(f"frame header field {name!r} missing or not {getattr(typ, '__name__', typ)}")


def strict_from_dict(cls: type[T], d: Any, what: str, required: Optional[Iterable[str]] = None) -> T:
    """The frozen dataclass ``cls`` built from the untrusted map ``d`` (off the network, a file),
    else ValueError saying what is wrong (``what`` names the thing, e.g. "device profile").

    ``d`` has no field that ``cls`` lacks and every field of ``required`` (default: all of them);
    each value has its field's annotated type: an ``int`` is no bool, a ``float`` is a finite int
    or float, ``Optional[X]`` is None or an X, ``tuple[X, ...]`` is a list or tuple of X (built as
    a tuple). Other annotations are left to the class, whose ``__post_init__`` checks the ranges
    and how the fields fit together."""
    if not isinstance(d, typing.Mapping):
        raise ValueError(f"{what} must be a map, not {type(d).__name__}")
    hints = _field_types(cls)
    unknown = [k for k in d if k not in hints]
    if unknown:
        raise ValueError(f"{what} has unknown fields {sorted(map(str, unknown))[:8]}")
    missing = [name for name in (hints if required is None else required) if name not in d]
    if missing:
        raise ValueError(f"{what} lacks fields {sorted(missing)}")
    return cls(**{name: _typed(v, hints[name], f"{what} field {name!r}") for name, v in d.items()})


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"strict_from_dict builds dataclasses, not {cls!r}")
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _typed(v: Any, hint: Any, where: str) -> Any:
    """``v`` if it has the annotated type ``hint`` (tuples built from lists), else ValueError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if v is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        return _typed(v, options[0], where) if len(options) == 1 else v
    if hint is bool:
        ok = isinstance(v, bool)
    elif hint is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif hint is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    elif hint is str:
        ok = isinstance(v, str)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{where} must be a list, not {type(v).__name__}")
        return tuple(_typed(x, args[0], f"{where}[{i}]") for i, x in enumerate(v))
    else:
        return v  # the class checks what its annotation cannot say
    if not ok:
        kind = "a finite number" if hint is float else f"{'an' if hint is int else 'a'} {hint.__name__}"
        raise ValueError(f"{where} must be {kind}, not {_short(v)}")
    return v


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
