"""The data plane's wire constants and errors, shared by its server and its client.

A framed request is ``b"STQ1"``, the kind's length (1 byte), the frame's length (8 bytes,
big-endian), the kind (ASCII), then the frame (see ``framing``); its answer is ``b"STR1"``, a
status (2 bytes, HTTP's codes), the body's length (8 bytes), then the body.
"""
from __future__ import annotations

import struct

REQUEST = struct.Struct(">4sBQ")  # magic, kind length, frame length
ANSWER = struct.Struct(">4sHQ")  # magic, status, body length
REQUEST_MAGIC, ANSWER_MAGIC = b"STQ1", b"STR1"
MAX_KIND_BYTES = 64
# at most this much is received in one go: copying several MiB at once holds the event loop (and the
# pings and emulated delays it times) for a millisecond or more; asyncio's own reads take 256 KiB
RECV_BYTES = 256 << 10
PIECE_BYTES = 1 << 22  # a big buffer goes out in pieces, each once the socket took the last
SMALL_BYTES = 64 << 10  # a message or answer up to this size goes out in one write


class Retry(Exception):
    """Raised by a handler that cannot take the message yet (e.g. it has no stage map): 503."""


class RemoteError(RuntimeError):
    """The other peer refused a message; ``status`` is the HTTP code, the message its reason."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
