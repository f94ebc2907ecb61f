"""The probe's messages on the data plane, shared by pings (``ping``) and bulk probes (``prober``).

Server side: register ``handle_probe`` for the message kind ``PROBE_KIND`` ("probe") on the peer's
``DataPlaneServer``. It echoes small pings and swallows bulk payloads, answering with their size.
Client side: ``probe_sender`` sends probe messages to one peer before a deadline.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from . import framing

if TYPE_CHECKING:
    from .client import DataPlaneClient

PROBE_KIND = "probe"
PROBE_VERSION = 1
MAX_PING_BYTES = 1024


async def handle_probe(header: dict, buffers: list[memoryview]) -> tuple[dict, list]:
    """Data-plane handler for ``PROBE_KIND``: ``{"op": "ping", "seq": n}`` is echoed with its (small)
    payload; ``{"op": "bulk"}`` is answered with ``{"nbytes": received}`` only."""
    framing.check_fields(header, {"v": int, "op": str})
    if header["v"] != PROBE_VERSION:
        raise framing.FrameError(f"probe version {header['v']} is not {PROBE_VERSION}")
    size = sum(b.nbytes for b in buffers)
    if header["op"] == "ping":
        seq = header.get("seq")
        if size > MAX_PING_BYTES:
            raise framing.FrameError(f"a ping carries at most {MAX_PING_BYTES} bytes, not {size}")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise framing.FrameError("ping needs an int 'seq'")
        return {"v": PROBE_VERSION, "op": "pong", "seq": seq}, [bytes(b) for b in buffers]
    if header["op"] == "bulk":
        return {"v": PROBE_VERSION, "op": "ack", "nbytes": size}, []
    raise framing.FrameError(f"probe op must be 'ping' or 'bulk', not {header['op']!r}")


def probe_sender(client: "DataPlaneClient", url: str, link: Any, deadline: Union[float, Callable[[], float]],
                 clock: Callable[[], float], compensate: bool = True) -> Callable[[dict, Sequence[Any]], Any]:
    """A ``send(header, buffers)`` of probe messages to ``url`` (over the emulated ``link``, if any)
    that gives up at ``deadline`` (on ``clock``; a callable: read at each send, it may move);
    ``compensate`` as in ``DataPlaneClient.send``."""
    async def send(header: dict, buffers: Sequence[Any]) -> Any:
        left = (deadline() if callable(deadline) else deadline) - clock()
        if left <= 0:
            raise asyncio.TimeoutError()
        return await client.send(url, PROBE_KIND, {"v": PROBE_VERSION, **header}, buffers, timeout=left, link=link,
                                 compensate=compensate)
    return send
