"""The live dashboard every peer serves: ``GET /`` (a page shipped in the package, nothing fetched
from the internet) and ``GET /swarm`` (what the page draws, as JSON).

``/swarm`` is the swarm as this peer can see it: the members from its DHT view, and each live
member's ``/status`` and ``/measurements`` fetched peer to peer (bounded: at most ``MAX_PEERS``
members, ``MAX_BODY`` bytes and ``FETCH_TIMEOUT_S`` each; a member that does not answer shows as
such). Any peer gives the same picture. Answers are cached for ``TTL_S`` so that several open
pages cost the swarm one round of fetches a second, not one per page.
"""
from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Optional

MAX_PEERS = 64
MAX_BODY = 1 << 20
FETCH_TIMEOUT_S = 2.0
TTL_S = 1.0
STATIC = os.path.join(os.path.dirname(__file__), "static")

# of a member's /status, what the page draws (its full status stays at its own /status)
TRAIN_KEYS = ("stage", "num_stages", "epoch", "step", "steps_done", "steps_total", "loss", "error", "planner",
              "replans", "recent_losses", "plan", "events", "links_mbps", "groups", "recent_steps",
              "tokens_per_s", "stage_seconds", "memory", "loss_history", "throughput_history",
              "step_breakdown", "cpu")


@functools.lru_cache(maxsize=1)
def page() -> bytes:
    """The page, read once (it ships in the package and does not change while the peer runs)."""
    with open(os.path.join(STATIC, "dashboard.html"), "rb") as f:
        return f.read()


def _member(status: Optional[dict], measurements: Optional[dict], record: dict, error: str = "") -> dict:
    out = {"peer_id": record["peer_id"], "name": record["name"], "state": record["state"],
           "progress": record.get("progress", {}), "reachable": status is not None, "error": error}
    if status is not None:
        train = status.get("train") or {}
        out["device"] = status.get("device")
        out["region"] = status.get("region")
        out["uptime_s"] = status.get("uptime_s")
        out["train"] = {k: train.get(k) for k in TRAIN_KEYS}
        net = status.get("network") if isinstance(status.get("network"), dict) else {}
        out["reach"] = net.get("reach")
        out["paths"] = {dst: {"path": u.get("path"), "via": u.get("via")}
                        for dst, u in (net.get("paths") or {}).items() if isinstance(u, dict)}
    if measurements is not None:
        out["links"] = {dst: {k: m.get(k) for k in ("rtt_ms", "mbps", "status")}
                        for dst, m in (measurements.get("links") or {}).items() if isinstance(m, dict)}
        out["tflops"] = measurements.get("tflops")
    return out


class SwarmView:
    """``/swarm`` of ``peer`` (a ``peer.Peer``)."""

    def __init__(self, peer) -> None:
        self.peer = peer
        self._cached: Optional[tuple[float, dict]] = None
        self._lock = asyncio.Lock()

    async def _fetch(self, record: dict, own: dict) -> dict:
        """A member's part of /swarm (``own``: this peer's /status, which it needs no round trip for)."""
        if record["peer_id"] == self.peer.peer_id:
            return _member(own, self.peer.dataplane.local_json("/measurements"), record)
        url = self.peer.data_url_of(record["peer_id"])
        if url is None:
            return _member(None, None, record, "no data-plane address")
        # any failure of a member shows on the page, as the member's error
        st, meas = await asyncio.gather(*(self.peer.client.get_json(url, path, MAX_BODY, FETCH_TIMEOUT_S)
                                          for path in ("/status", "/measurements")), return_exceptions=True)
        if isinstance(st, BaseException):
            return _member(None, None, record, f"{type(st).__name__}: {st}")
        return _member(st, None if isinstance(meas, BaseException) else meas, record)

    async def snapshot(self) -> dict:
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < TTL_S:
                return self._cached[1]
            own = self.peer.status()
            records = own["members"][:MAX_PEERS]
            members = await asyncio.gather(*(self._fetch(r, own) for r in records))
            d = {"t": time.time(), "swarm": own["swarm"], "self": own["name"] or own["peer_id"],
                 "member_count": own["member_count"], "shown": len(members), "members": list(members)}
            self._cached = (time.monotonic(), d)
            return d


def install(peer, dataplane) -> SwarmView:
    """Adds ``GET /`` and ``GET /swarm`` to ``dataplane`` (before it starts)."""
    view = SwarmView(peer)
    dataplane.add_get("/", lambda: (page(), "text/html; charset=utf-8"))
    dataplane.add_async_json_get("/swarm", view.snapshot)
    return view

