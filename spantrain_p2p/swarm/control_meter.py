"""What this peer's control plane costs: its DHT calls and the bytes they move, per method and key.

A swarm's control plane is its DHT traffic: heartbeats and member reads, measurements, the
planner's lease, stage maps (``keys``). ``ControlMeter.attach(p2p)`` wraps one ``hivemind.P2P``
instance (before the ``DHTNode`` registers its handlers on it) so that every unary protobuf call
this peer makes (``out``) and every one it answers (``in``) is counted: calls, request and response
bytes (protobuf sizes: what the p2p daemon carries less libp2p's own framing and encryption),
failures, and the largest value seen per key. Calls are named by their method (``rpc_find``,
``rpc_store``, ``rpc_ping``) and the swarm key they touch (``members``, ``stagemap``...; a request
of several keys of different names counts under ``several``, a lookup of a node id or a key of
another swarm under ``routing``). ``snapshot()`` is what ``/status`` shows under ``control``.

Nothing here changes a call: a counter that fails to count (an unexpected message) counts it
under ``other`` and the call goes on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from . import keys

__all__ = ["ControlMeter", "key_names", "rates", "run_rates", "window_rates"]

_MEASURE = (keys.PROFILES, keys.LINKS, keys.GROUPS, keys.PINGS, keys.ACCUSE)


def key_names(swarm: str) -> dict[bytes, str]:
    """DHT ids (as ``DHTID.to_bytes()``) of every key of ``swarm``, to the key's short name."""
    from hivemind.dht.routing import DHTID

    named = {
        "planner": keys.lease_key(swarm), "stagemap": keys.stagemap_key(swarm), "keyreq": keys.keyreq_key(swarm),
        "groupkey": keys.groupkey_key(swarm),
    }
    ids = {DHTID.generate(source=k).to_bytes(): name for name, k in named.items()}
    bucketed = {"members": keys.members_keys(swarm), "job": keys.job_keys(swarm),
                **{w: keys.measure_keys(swarm, w) for w in _MEASURE}}
    for name, ks in bucketed.items():  # one row for all buckets of a kind
        ids.update({DHTID.generate(source=k).to_bytes(): name for k in ks})
    return ids


@dataclass
class _Row:
    calls: int = 0
    failed: int = 0
    bytes_out: int = 0  # request bytes, in the direction of the call
    bytes_back: int = 0  # response bytes

    def as_dict(self) -> dict:
        return {"calls": self.calls, "failed": self.failed, "bytes_out": self.bytes_out, "bytes_back": self.bytes_back}


class ControlMeter:
    def __init__(self, swarm: str, clock=time.monotonic):
        self._names = key_names(swarm)
        self._clock = clock
        self.since = clock()
        self.out: dict[tuple[str, str], _Row] = {}  # (method, key name) -> calls this peer made
        self.served: dict[tuple[str, str], _Row] = {}  # calls this peer answered
        self.largest: dict[str, int] = {}  # key name -> largest value (bytes) stored or returned

    # ---- naming ---------------------------------------------------------------------------------
    def _key_of(self, request: Any) -> str:
        ids: Iterable[bytes] = getattr(request, "keys", None) or ()
        found = {self._names.get(bytes(k), "routing") for k in ids}
        if not found:
            return "-"
        return found.pop() if len(found) == 1 else "several"

    def _note_values(self, request: Any, response: Any) -> None:
        for k, v in zip(getattr(request, "keys", ()) or (), getattr(request, "values", ()) or ()):
            self._note(self._names.get(bytes(k), "routing"), len(v))
        results = getattr(response, "results", None)
        if results is not None:
            for k, r in zip(getattr(request, "keys", ()) or (), results):
                if r.value:
                    self._note(self._names.get(bytes(k), "routing"), len(r.value))

    def _note(self, name: str, size: int) -> None:
        if size > self.largest.get(name, 0):
            self.largest[name] = size

    def _count(self, table: dict, method: str, request: Any, response: Any, ok: bool) -> None:
        try:
            row_key = (method.rsplit(".", 1)[-1], self._key_of(request))
            size_in = request.ByteSize()
            size_back = response.ByteSize() if response is not None else 0
            self._note_values(request, response)
        except Exception:  # never let counting break a call
            row_key, size_in, size_back = ("other", "-"), 0, 0
        row = table.get(row_key)
        if row is None:
            row = table[row_key] = _Row()
        row.calls += 1
        row.failed += 0 if ok else 1
        row.bytes_out += size_in
        row.bytes_back += size_back

    def tally(self, served: bool, method: str, key: str, bytes_out: int, bytes_back: int, ok: bool = True) -> None:
        """Counts one call that is not a DHT call (a SWIM ping on the data plane, ``peer.swim_loop``):
        ``served`` where this peer answered it, its request and response bytes."""
        row = (self.served if served else self.out).setdefault((method, key), _Row())
        row.calls += 1
        row.failed += 0 if ok else 1
        row.bytes_out += bytes_out
        row.bytes_back += bytes_back

    # ---- wrapping a P2P instance ------------------------------------------------------------------
    def attach(self, p2p: Any) -> None:
        """Counts ``p2p``'s unary protobuf calls from now on, and the unary handlers added after this."""
        call, add = p2p.call_protobuf_handler, p2p.add_protobuf_handler
        meter = self

        async def call_protobuf_handler(peer_id, name, input, output_protobuf_type):
            if not hasattr(input, "ByteSize"):  # a stream: not the DHT's, not counted
                return await call(peer_id, name, input, output_protobuf_type)
            response = None
            try:
                response = await call(peer_id, name, input, output_protobuf_type)
                return response
            finally:
                meter._count(meter.out, name, input, response, response is not None)

        async def add_protobuf_handler(name, handler, input_protobuf_type, *, stream_input=False,
                                       stream_output=False, balanced=False):
            if not stream_input and not stream_output:
                inner = handler

                async def handler(request, context):
                    response = None
                    try:
                        response = await inner(request, context)
                        return response
                    finally:
                        meter._count(meter.served, name, request, response, response is not None)

            return await add(name, handler, input_protobuf_type, stream_input=stream_input,
                             stream_output=stream_output, balanced=balanced)

        p2p.call_protobuf_handler = call_protobuf_handler
        p2p.add_protobuf_handler = add_protobuf_handler

    # ---- what /status shows -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Totals since the meter started: per ``method key`` row, and the bytes this peer sent and
        received in all (a call's request is sent by the caller, its response by the one answering)."""
        sent = sum(r.bytes_out for r in self.out.values()) + sum(r.bytes_back for r in self.served.values())
        received = sum(r.bytes_back for r in self.out.values()) + sum(r.bytes_out for r in self.served.values())
        return {
            "since_s": round(self._clock() - self.since, 3),
            "calls_out": sum(r.calls for r in self.out.values()),
            "calls_served": sum(r.calls for r in self.served.values()),
            "bytes_sent": sent,
            "bytes_received": received,
            "out": {f"{m} {k}": r.as_dict() for (m, k), r in sorted(self.out.items())},
            "served": {f"{m} {k}": r.as_dict() for (m, k), r in sorted(self.served.items())},
            "largest_value": dict(sorted(self.largest.items())),
        }


def rates(before: dict, after: dict) -> Optional[dict]:
    """Per-second rates between two ``snapshot()``s of one peer (None if no time passed)."""
    dt = after["since_s"] - before["since_s"]
    if dt <= 0:
        return None
    return {
        "window_s": round(dt, 3),
        "bytes_sent_per_s": (after["bytes_sent"] - before["bytes_sent"]) / dt,
        "bytes_received_per_s": (after["bytes_received"] - before["bytes_received"]) / dt,
        "calls_out_per_s": (after["calls_out"] - before["calls_out"]) / dt,
        "calls_served_per_s": (after["calls_served"] - before["calls_served"]) / dt,
    }


def run_rates(snap: dict) -> dict:
    """A peer's control plane over its whole life so far (``snapshot()``'s totals per second): what
    the run summary gives per peer."""
    dt = max(snap["since_s"], 1e-9)
    return {"seconds": snap["since_s"], "bytes_per_s": round((snap["bytes_sent"] + snap["bytes_received"]) / dt, 1),
            "calls_out_per_s": round(snap["calls_out"] / dt, 2), "calls_served_per_s": round(snap["calls_served"] / dt, 2),
            "largest_value": snap["largest_value"]}


def window_rates(before: dict, after: dict) -> Optional[dict]:
    """A peer's control plane between two ``snapshot()``s (say, from its first stage map to the end
    of its run: a training swarm's): the totals per second, and per ``out``/``served`` row (method and
    key) its calls and bytes (request + response) a second."""
    totals = rates(before, after)
    if totals is None:
        return None
    dt = totals["window_s"]
    rows = {}
    for side in ("out", "served"):
        for name, r in after[side].items():
            b = before[side].get(name, {"calls": 0, "bytes_out": 0, "bytes_back": 0})
            calls = r["calls"] - b["calls"]
            if calls > 0:
                rows[f"{side} {name}"] = {"calls_per_s": round(calls / dt, 3), "bytes_per_s": round(
                    (r["bytes_out"] + r["bytes_back"] - b["bytes_out"] - b["bytes_back"]) / dt, 1)}
    return {**{k: round(v, 3) for k, v in totals.items()},
            "bytes_per_s": round(totals["bytes_sent_per_s"] + totals["bytes_received_per_s"], 1), "rows": rows}
