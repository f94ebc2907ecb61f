"""Islands on the wire: the exchange of pseudo-gradients between islands, once a round.

At the end of its round ``r`` a peer of island ``i`` (its stage's first replica; the others compute
the same) sends each of its layers' pseudo-gradient, compressed with error feedback
(``train.outer``), to every peer of the other islands that holds that layer (``plan.islands.
exchange_routes``), in the background, while round ``r + 1`` computes. At the end of round ``r + 1``
it takes every island's contribution of round ``r`` (waiting only for what has not arrived: the
part of the exchange not hidden), merges them into the anchor, and replays its local steps.

What arrives is checked before anything is kept: the job, the epoch, a round this peer is about to
merge (no further ahead), a layer this peer holds, the island's sender for that layer (the
connection's authenticated peer), the codec, and the shape from this peer's own layers. A
contribution is kept once per (round, island, layer): a repeat is ignored, so none is applied
twice. An island silent past the job's receive timeout is left out of the round (the others'
tokens weigh the average) and named in the run's events.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Callable, Optional

from ..compress import codecs
from ..net.dataplane import RemoteError, Retry
from ..net.framing import FrameError, check_fields
from ..plan.islands import layer_owners
from ..plan.stagemap import StageMap
from .outer import Contribution, OuterLayers

log = logging.getLogger("spantrain.train")

OUTER = "outer"
ROUNDS_AHEAD = 2  # contributions taken this many rounds past the one being merged (a fast island's)
MAX_TOKENS = 1 << 50


def _owners(smap: StageMap, num_layers: int) -> list[list[tuple[str, ...]]]:
    """owners[island][layer]: the peers of each island holding each layer."""
    out = []
    for k in range(len(smap.islands)):
        out.append(layer_owners(smap.island_map(k).stages, num_layers))
    return out


class OuterSync:
    """One peer's side of the islands' exchange. ``on_event(dict)``: for the run's events."""

    def __init__(self, peer, on_event: Callable[[dict], None]):
        self.peer, self.on_event = peer, on_event
        self.job = self.smap = None
        self.island: Optional[int] = None
        self.outer: Optional[OuterLayers] = None
        self.charges = None  # train.workload.Charges: a layer's message charged as the workload's layer
        self.round = 0  # the round this peer is in (its contributions of round - 1 are travelling)
        self._owners: list = []
        self._got: dict[tuple[int, int, int], Contribution] = {}  # (round, island, layer)
        self._arrived = asyncio.Event()
        self._arrival: dict[tuple[int, int], float] = {}  # (round, island) -> when its last layer came
        self._sending: Optional[asyncio.Task] = None
        self._round_ended: dict[int, float] = {}
        self.rounds: list[dict] = []  # figures of each merged round, for the report
        self.bytes_sent = 0
        self.sends: list[dict] = []  # each round's sending: seconds from the round's end to the last byte
        self.left_out: list[tuple[int, int]] = []  # (round, island) merged without it

    # ---- set-up -----------------------------------------------------------------------------------
    def begin(self, job, smap: StageMap, island: int, layers: dict[int, list], num_layers: int,
              start_round: int = 0) -> None:
        """Takes part in ``smap``'s islands as a peer of ``island`` holding ``layers`` (index -> its
        parameters) of the model's ``num_layers``, from round ``start_round``."""
        self.job, self.smap, self.island = job, smap, island
        self._owners = _owners(smap, num_layers)
        self.outer = OuterLayers(layers, smap.exchange_codec, job.outer_lr, job.outer_momentum)
        self.round = start_round
        self._got = {k: v for k, v in self._got.items() if k[0] >= start_round - 1}

    def _sends(self) -> list[tuple[int, str]]:
        """(layer, destination) of this peer's messages each round: none unless it is its stage's first replica."""
        me, k = self.peer.peer_id, self.island
        out = []
        for layer in sorted(self.outer.params):
            if self._owners[k][layer][0] != me:
                continue
            for j, own in enumerate(self._owners):
                if j != k:
                    out.extend((layer, dst) for dst in own[layer])
        return out

    # ---- a round's end ----------------------------------------------------------------------------
    async def round_end(self, r: int, tokens: int, last: bool = False) -> dict:
        """Ends round ``r`` after ``tokens`` tokens: merges round ``r - 1``, replays, sends round ``r``'s
        contributions. ``last``: also waits for round ``r``'s and merges them (the run's end: every
        island then holds the anchor). Returns the round's figures."""
        t0 = time.time()
        self._round_ended[r] = t0
        prog = self.outer.progress()
        wait = 0.0
        if r > 0:
            wait = await self._merge(r - 1)
        self.outer.replay(prog)
        encoded = self.outer.encode(prog)
        own = {layer: Contribution(tokens, dec) for layer, (_m, _b, dec) in encoded.items()}
        for layer, c in own.items():
            self._got[(r, self.island, layer)] = c
        if self._sending is not None and not self._sending.done():
            await self._sending  # (merging r - 1 waited for everyone's, so the previous sends are done)
        self._sending = asyncio.create_task(self._send(r, tokens, encoded))
        self.round = r + 1
        fig = {"round": r, "tokens": tokens, "wait_s": round(wait, 4), "t": t0}
        if last:
            fig["final_wait_s"] = round(await self._merge(r), 4)
            self.outer.reset_to_anchor()
            await self._sending
        return fig

    async def _merge(self, r: int) -> float:
        """Waits for every island's contributions of round ``r`` (up to the job's receive timeout,
        then goes on without the silent ones) and merges them. Returns the seconds waited."""
        t0 = time.time()
        layers = sorted(self.outer.params)
        n = len(self.smap.islands)
        deadline = t0 + self.job.recv_timeout_s
        while True:
            missing = [(i, layer) for i in range(n) for layer in layers if (r, i, layer) not in self._got]
            if not missing or time.time() >= deadline:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), max(0.01, deadline - time.time()))
            except asyncio.TimeoutError:
                pass
        waited = time.time() - t0
        silent = sorted({i for i, _ in missing})
        for i in silent:
            self.left_out.append((r, i))
            log.warning("round %d: island %d sent nothing within %.0fs: merged without it", r, i, waited)
            self.on_event({"kind": "island_left_out", "round": r, "island": i, "t": time.time()})
        contribs = {layer: [self._got[(r, i, layer)] for i in range(n) if (r, i, layer) in self._got]
                    for layer in layers}
        self.outer.merge(contribs)
        arrivals = [t for (rr, i), t in self._arrival.items() if rr == r]
        ended = self._round_ended.get(r)
        exchange_s = max(arrivals) - ended if arrivals and ended else None
        self.rounds.append({"round": r, "wait_s": round(waited, 4), "islands": n - len(silent),
                            "exchange_s": round(exchange_s, 4) if exchange_s is not None else None,
                            "tokens": sum(c.tokens for c in contribs[layers[0]]) if layers else 0})
        for key in [k for k in self._got if k[0] <= r]:
            del self._got[key]
        for key in [k for k in self._arrival if k[0] <= r]:
            del self._arrival[key]
        return waited

    async def _send(self, r: int, tokens: int, encoded: dict) -> None:
        """Round ``r``'s contributions of this peer's layers, to every holder in the other islands,
        one after another (retrying a peer not ready yet, up to the job's receive timeout)."""
        loop = asyncio.get_running_loop()
        t0, sent = time.time(), 0
        for layer, dst in self._sends():
            meta, bufs, _dec = encoded[layer]
            header = {"job": self.job.job_id, "epoch": self.smap.epoch, "round": r, "island": self.island,
                      "layer": layer, "tokens": tokens, "meta": meta}
            charge = self.charges.params[layer] if self.charges and layer < len(self.charges.params) else 1.0
            deadline = loop.time() + self.job.recv_timeout_s
            while True:
                url = self.peer.data_url_of(dst)
                try:
                    if url is None:
                        raise ConnectionError("no live address")
                    await self.peer.client.send(url, OUTER, header, bufs, timeout=self.job.recv_timeout_s,
                                                link=self.peer.link_to(dst), charge=charge, peer_id=dst)
                    nbytes = sum(memoryview(b).nbytes for b in bufs)
                    self.bytes_sent += nbytes
                    sent += nbytes
                    break
                except RemoteError as e:
                    if e.status != 503 or loop.time() > deadline:
                        log.warning("round %d layer %d: %s refused the contribution: %s", r, layer,
                                    self.smap.name_of(dst), e)
                        break
                except (OSError, ConnectionError, asyncio.TimeoutError) as e:
                    if loop.time() > deadline:
                        log.warning("round %d layer %d: cannot reach %s: %r", r, layer, self.smap.name_of(dst), e)
                        break
                await asyncio.sleep(0.2)
        if sent:
            self.sends.append({"round": r, "send_s": round(time.time() - t0, 4), "bytes": sent})

    # ---- what other islands send --------------------------------------------------------------------
    async def on_outer(self, header: dict, buffers) -> None:
        """The data plane's handler of ``outer`` messages (one layer of one island's round)."""
        check_fields(header, {"job": str, "epoch": int, "round": int, "island": int, "layer": int, "tokens": int,
                              "meta": dict})
        if self.outer is None or self.smap is None:
            raise Retry("this peer has not begun its islands' rounds yet")
        if header["job"] != self.job.job_id:
            raise FrameError("contribution for another job")
        if header["epoch"] > self.smap.epoch:
            raise Retry("this peer has no stage map for that epoch yet")
        if header["epoch"] < self.smap.epoch:
            raise FrameError(f"epoch {header['epoch']} is over: this peer runs epoch {self.smap.epoch}")
        r, i, layer, tokens = header["round"], header["island"], header["layer"], header["tokens"]
        if not 0 <= i < len(self.smap.islands) or i == self.island:
            raise FrameError(f"island {i} is not another island of this map")
        if layer not in self.outer.params:
            raise FrameError(f"this peer does not hold layer {layer}")
        if header.get("src") != self._owners[i][layer][0]:
            raise FrameError(f"layer {layer} of island {i} comes from its stage's first replica, not {str(header.get('src'))[:16]}…")
        if not self.round - 1 <= r <= self.round + ROUNDS_AHEAD:
            raise FrameError(f"round {r} is not one this peer merges now (it is in round {self.round})")
        if not 0 <= tokens < MAX_TOKENS:
            raise FrameError("tokens out of range")
        if (r, i, layer) in self._got:
            return None  # a repeat (a retried send): kept once
        base = codecs.parse_spec(self.smap.exchange_codec)[0]
        n = self.outer.sizes()[layer]
        try:
            delta = codecs.decode(header["meta"], buffers, (n,), max_bytes=4 * n + 4096, allowed=(base,))
        except codecs.CodecError as e:
            raise FrameError(f"contribution of layer {layer}: {e}") from None
        self._got[(r, i, layer)] = Contribution(tokens, delta)
        self._arrival[(r, i)] = time.time()
        self._arrived.set()
        return None

    def report(self) -> dict:
        return {"island": self.island, "round": self.round, "codec": self.smap.exchange_codec if self.smap else None,
                "bytes_sent": self.bytes_sent, "rounds": self.rounds[-50:], "sends": self.sends[-50:],
                "left_out": [list(x) for x in self.left_out],
                "digests": {str(i): hashlib.sha256(a.numpy().tobytes()).hexdigest()[:16]
                            for i, a in self.outer.anchor.items()} if self.outer else {}}
