"""Islands on the wire: the exchange of pseudo-gradients between islands, once a round.

At the end of its round ``r`` a peer of island ``i`` (its stage's first replica; the others compute
the same) sends each of its layers' pseudo-gradient, compressed with error feedback
(``islands.outer``), to every peer of the other islands that holds that layer (``plan.islands.
exchange_routes``), in the background, while round ``r + 1`` computes. At the end of round ``r + 1``
it takes every island's contribution of round ``r`` (waiting only for what has not arrived: the
part of the exchange not hidden), merges them into the anchor, and replays its local steps.

What arrives is checked before anything is kept: the job, the epoch, a round this peer is about to
merge (no further ahead), a layer this peer holds, the island's sender for that layer (the
connection's authenticated peer), the codec, and the shape from this peer's own layers. A
contribution is kept once per (round, island, layer): a repeat is ignored, so none is applied
twice.

An island that falls silent is left out of a round and the others go on (``island_members``).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

from ..compress import codecs
from ..net.dataplane import RemoteError, Retry
from ..net.framing import FrameError, check_fields
from ..plan.islands import layer_owners
from ..pipeline.executor import StepFailed
from ..plan.stagemap import StageMap
from .members import CATCH_UP_AHEAD, OUTER_MEMBERS, Membership, leave_after_s  # noqa: F401 (re-exported)
from .outer import Contribution, OuterLayers
from ..robust import attacks
from ..robust.aggregate import ClipReport
from ..robust.verdicts import merge as merge_reports
from ..swarm.liveness import reachable_at
from ..models.workload import layer_charge

log = logging.getLogger("spantrain.train")

OUTER = "outer"
OUTER_FETCH = "outer_fetch"
KEEP_VERSIONS = 3  # outer states kept per layer (a re-plan resumes at one every layer still has)
PINNED_EXTRA = 2  # older outer states kept on top while another peer is fetching them
ROUNDS_AHEAD = 2  # contributions taken this many rounds past the one being merged (a fast island's)
MAX_TOKENS = 1 << 50
MAX_STALE_SENDS = 8  # an island's sends of rounds merged without it, left to finish in the background


def _owners(smap: StageMap, num_layers: int) -> list[list[tuple[str, ...]]]:
    """owners[island][layer]: the peers of each island holding each layer."""
    out = []
    for k in range(len(smap.islands)):
        out.append(layer_owners(smap.island_map(k).stages, num_layers))
    return out


class OuterSync(Membership):
    """One peer's side of the islands' exchange. ``on_event(dict)``: for the run's events."""

    attack: str = ""  # the --byzantine harness (``robust.attacks``); set by the trainer
    on_verdict = None  # (round, ClipReport by island) after each robust merge; set by the trainer

    def __init__(self, peer, on_event: Callable[[dict], None]):
        self.peer, self.on_event = peer, on_event
        self._previous: dict[int, torch.Tensor] = {}  # the stale attack's pseudo-gradients of the round before
        self.job = self.smap = None
        self.island: Optional[int] = None
        self.outer: Optional[OuterLayers] = None
        self.charges = None  # models.workload.Charges: a layer's message charged as the workload's layer
        self.round = 0  # the round this peer is in (its contributions of round - 1 are travelling)
        self._owners: list = []
        self._got: dict[tuple[int, int, int], Contribution] = {}  # (round, island, layer)
        self._arrived = asyncio.Event()
        self._sending: dict[int, asyncio.Task] = {}  # the last round's sends, by destination island
        self._first_round = 0
        self._round_base: dict[int, int] = {}  # round -> its first data step
        self._stale: list[tuple[int, asyncio.Task]] = []  # sends to islands left out of their round
        self._last_members: list[int] = []
        self._init_members()
        self.rounds: list[dict] = []  # figures of each merged round, for the report
        self.bytes_to: dict[str, int] = {}  # bytes sent, by destination
        self.sends: list[dict] = []  # each round's sending: seconds from the round's end to the last byte
        # outer states by version v (the state round v starts from): layer -> (anchor, momentum), and
        # the first data step of round v; what a new epoch resumes from (``decide.resume_point``)
        self.versions: dict[int, tuple[int, dict[int, tuple[np.ndarray, np.ndarray]]]] = {}
        # version -> time.monotonic() until which it outlives KEEP_VERSIONS: a peer fetches it, layer
        # by layer, and a whole model's state over a slow link can take longer than three rounds
        self._pins: dict[int, float] = {}

    # ---- set-up -----------------------------------------------------------------------------------
    def begin(self, job, smap: StageMap, island: int, layers: dict[int, list], num_layers: int,
              start_round: int = 0, state: Optional[dict] = None) -> None:
        """Takes part in ``smap``'s islands as a peer of ``island`` holding ``layers`` (index -> its
        parameters) of the model's ``num_layers``, from round ``start_round``: from the layers as
        they are (round 0), else from ``state`` (layer -> (anchor, momentum), ``load``)."""
        self._cancel_sends()  # the last epoch's contributions: its rounds are redone
        self.job, self.smap, self.island = job, smap, island
        self._owners = _owners(smap, num_layers)
        self._begin_members(smap)
        self.outer = OuterLayers(layers, smap.exchange_codec, job.outer_lr, job.outer_momentum,
                                 robust=job.aggregate == "robust")
        for layer, (anchor, momentum) in (state or {}).items():
            self.outer.load(layer, anchor, momentum)
        self.round = self._first_round = start_round
        self._got = {}
        self._round_base = {start_round: smap.start_data_step}
        self._keep(start_round, smap.start_data_step)

    def _keep(self, version: int, data_step: int) -> None:
        self.versions[version] = (data_step, self.outer.state())
        now = time.monotonic()
        self._pins = {v: t for v, t in self._pins.items() if t > now and v in self.versions}
        old = sorted(self.versions)[:-KEEP_VERSIONS]
        pinned = [v for v in old if v in self._pins][-PINNED_EXTRA:]
        for v in old:
            if v not in pinned:
                del self.versions[v]

    def _patience_s(self) -> float:
        """How long a peer waits for another's part of the exchange (a contribution, the keeper's
        answer, an outer state): the receive timeout plus two rounds (the others' round may end up to
        a round later than this island's: one whose last round has few steps or none waits for theirs)."""
        return self.job.recv_timeout_s + 2 * self._round_s()

    def _round_s(self) -> float:
        """The predicted seconds of a round (the slowest island's)."""
        isl = self.smap.islands
        per_island = [x.steps_per_round * x.predicted_step_s for x in isl]
        if all(per_island):
            return max(per_island)
        return self.smap.predicted_step_s * sum(x.steps_per_round for x in isl)

    def holding(self) -> dict:
        """What a new epoch can resume from here: {"layers": layer -> versions, "data_steps": version
        -> the data step it began at} (``parse_inventory``'s form)."""
        inv: dict[int, list[int]] = {}
        for v, (_d, states) in self.versions.items():
            for layer in states:
                inv.setdefault(layer, []).append(v)
        return {"layers": {k: sorted(v) for k, v in inv.items()},
                "data_steps": {v: d for v, (d, _s) in self.versions.items()}}

    def inventory(self) -> dict:
        """``holding()`` for this peer's ``/inventory`` page (JSON: string keys)."""
        return {part: {str(k): v for k, v in d.items()} for part, d in self.holding().items()}

    async def on_fetch(self, header: dict, buffers):
        """Another peer takes a layer over at a version: its anchor and momentum (float32)."""
        check_fields(header, {"job": str, "layer": int, "version": int})
        held = self.versions.get(header["version"])
        if (held is None and self.job is not None and header["job"] == self.job.job_id and self.versions
                and max(self.versions) < header["version"] <= self.round + 1):
            raise Retry(f"round {header['version'] - 1} is not merged here yet")
        if self.job is None or header["job"] != self.job.job_id or held is None or header["layer"] not in held[1]:
            raise FrameError(f"this peer holds no outer state of layer {header['layer']} at version {header['version']}")
        anchor, momentum = held[1][header["layer"]]
        # the fetcher asks for the next layer of this version next: keep it a request's time more
        self._pins[header["version"]] = time.monotonic() + self._patience_s()
        return {"data_step": held[0], "n": int(anchor.size)}, [memoryview(anchor.view(np.uint8)),
                                                                memoryview(momentum.view(np.uint8))]

    async def state_at(self, version: int, layers: dict, pages: dict, rtt_ms) -> dict:
        """This peer's ``layers``' (layer -> its parameters) outer state at ``version``: its own, or
        from a peer holding it (the same layers in another island, or this island's before the
        re-plan), nearest first (``pages``: the peers' ``/inventory`` pages, ``rtt_ms(peer)``)."""
        invs = self.parse_inventories(pages)
        out = {}
        for layer, params in layers.items():
            holders = [p for p, inv in invs.items() if version in inv["layers"].get(layer, [])]
            holders.sort(key=lambda p: (rtt_ms(p), p))
            out[layer] = await self.fetch(layer, version, holders, sum(p.numel() for p in params))
        return out

    async def fetch(self, layer: int, version: int, holders: list[str], size: int,
                    deadline: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s outer state at ``version`` from the first of ``holders`` that gives it
        (this peer's own first); with a ``deadline`` (``time.time()``), asking again while a holder
        has not merged that round yet."""
        held = self.versions.get(version)
        if held is not None and layer in held[1]:
            a, m = held[1][layer]
            return torch.from_numpy(a.copy()), torch.from_numpy(m.copy())
        while True:
            for src in holders:
                url = reachable_at(self.peer, src)
                try:
                    if url is None:
                        raise ConnectionError("no live address")
                    reply = await self.peer.client.send(
                        url, OUTER_FETCH, {"job": self.job.job_id, "layer": layer, "version": version},
                        timeout=self.job.recv_timeout_s, link=self.peer.link_to(src),
                        reply_charge=layer_charge(self.charges, layer), peer_id=src)
                    _h, bufs = reply
                    if len(bufs) != 2 or any(memoryview(b).nbytes != 4 * size for b in bufs):
                        raise FrameError(f"outer state of layer {layer} is not 2 x {size} float32")
                    a, m = (torch.from_numpy(np.frombuffer(bytes(b), dtype="<f4").copy()) for b in bufs)
                    if not (torch.isfinite(a).all() and torch.isfinite(m).all()):
                        raise FrameError(f"outer state of layer {layer} is not finite")
                    log.info("outer state of layer %d at round %d fetched from %s", layer, version,
                             self.peer.name_of(src))
                    return a, m
                except Exception as e:
                    if not (isinstance(e, RemoteError) and e.status == 503):  # (503: not merged there yet)
                        log.warning("fetching the outer state of layer %d from %s failed: %s", layer,
                                    self.peer.name_of(src), e)
            if deadline is None or time.time() >= deadline:
                raise StepFailed(f"no live peer could give the outer state of layer {layer} at round {version}")
            await asyncio.sleep(0.2)

    def _sends(self) -> dict[int, list[tuple[int, str]]]:
        """Destination island -> (layer, peer) of this peer's messages each round: none unless it is
        its stage's first replica."""
        me, k = self.peer.peer_id, self.island
        out: dict[int, list[tuple[int, str]]] = {}
        for layer in sorted(self.outer.params):
            if self._owners[k][layer][0] != me:
                continue
            for j, own in enumerate(self._owners):
                if j != k:
                    out.setdefault(j, []).extend((layer, dst) for dst in own[layer])
        return out

    def _cancel_sends(self) -> None:
        """Stops every send still under way."""
        for task in [*self._sending.values(), *(t for _j, t in self._stale)]:
            if not task.done():
                task.cancel()
        self._stale = []

    async def _settle_sends(self) -> None:
        """Before a round's sends: the last round's to its members are done (merging it waited for
        theirs, and theirs for these), those to islands left out of it go on in the background (a
        catching-up island merges them), at most ``MAX_STALE_SENDS`` an island. A send to a member
        is waited for as long as the keeper waits for an island (``leave_after_s``), no longer: a
        member whose contributions came just before its link was cut still has ours on that link,
        and waiting for them would hold this island until the link is back (it goes on in the
        background; that member, late with the next round, is left out of it and catches up)."""
        patience = leave_after_s(self._round_s())
        for j, task in self._sending.items():
            if task.done():
                continue
            if j in self._last_members:
                await asyncio.wait([task], timeout=patience)
            if not task.done():
                self._stale.append((j, task))
        self._stale = [(j, t) for j, t in self._stale if not t.done()]
        for j in {j for j, _t in self._stale}:
            mine = [t for i, t in self._stale if i == j]
            for t in mine[:-MAX_STALE_SENDS]:
                t.cancel()

    # ---- a round's end ----------------------------------------------------------------------------
    async def round_end(self, r: int, tokens: int, next_data_step: int, last: bool = False) -> dict:
        """Ends round ``r`` after ``tokens`` tokens: merges round ``r - 1``, replays, sends round ``r``'s
        contributions. ``next_data_step``: where round ``r + 1`` begins in the data. ``last``: also
        waits for round ``r``'s and merges them (the run's end: every island then holds the anchor).
        Returns the round's figures; with "rejoin": (round, its first data step) where this island,
        left out and fallen behind, goes on instead of round ``r + 1`` (its progress dropped)."""
        t0 = time.time()
        prog = self.outer.progress()
        wait = 0.0
        fig = {"round": r, "tokens": tokens, "t": t0}
        if r > self._first_round:
            wait, jump = await self._merge(r - 1)
            if jump is not None:  # its progress is dropped: it rejoins at round v + 1 from version v
                v, data_step, base = jump
                self._cancel_sends()
                self.outer.reset_to_anchor()
                self.round, self._first_round, self._round_base = v + 1, v, {v: data_step, v + 1: base}
                self._got = {key: c for key, c in self._got.items() if key[0] >= v}
                self._keep(v, data_step)
                return {**fig, "wait_s": round(wait, 4), "rejoin": (v + 1, base)}
            # the anchor every island holds now is round r's start: a re-plan can resume there (r
            # is retrained from it), at the data step round r began with
            self._keep(r, self._round_base[r])
        self.outer.replay(prog)
        if self.attack:  # the --byzantine harness: what it sends is forged, what it trains on is not
            prog = self._forge(prog, tokens)
        encoded = self.outer.encode(prog)
        for layer, (_m, _b, dec) in encoded.items():
            self._got[(r, self.island, layer)] = Contribution(tokens, dec)
        self.round = r + 1  # (round r ended here: the keeper may decide it)
        self._maybe_decide(r)
        await self._settle_sends()
        t_send = time.time()
        routes = self._sends()
        send_fig = {"round": r, "left": len(routes), "bytes": 0, "t0": t_send}
        self._sending = {j: asyncio.create_task(self._send(r, tokens, encoded, rs, send_fig))
                         for j, rs in routes.items()}
        self._round_base[r + 1] = next_data_step
        fig["wait_s"] = round(wait, 4)
        if last:
            final, jump = await self._merge(r)
            fig["final_wait_s"] = round(final, 4)
            self.outer.reset_to_anchor()
            self._keep(r + 1, next_data_step)  # the run's end: the outer state every island ends on
            await self._settle_sends()
        return fig

    def _forge(self, prog: dict[int, torch.Tensor], tokens: int) -> dict[int, torch.Tensor]:
        """The progress a Byzantine island sends (its pseudo-gradient is ``-progress``); an
        omniscient attack reads no other island's here: it forges from its own."""
        out = {}
        for i, p in prog.items():
            out[i] = -attacks.forge(self.attack, -p, float(tokens), {}, self._previous.get(i))
            self._previous[i] = -p
        return out

    async def _merge(self, r: int) -> tuple[float, Optional[tuple[int, int, int]]]:
        """Merges round ``r``: the keeper decides its members (``_decide``), every other peer asks it;
        then this peer waits for the members' contributions (up to the job's receive timeout plus
        two predicted rounds; then the epoch fails) and merges them. Where this peer's island is
        not a member it catches up instead (``_catch_up``). Returns (the seconds waited, where a
        left-out island that fell behind rejoins: (version, its data step, the next round's))."""
        t0 = time.time()
        layers = sorted(self.outer.params)
        deadline = t0 + self._patience_s()
        if self.peer.peer_id == self._keeper:
            members, latest = await self._decide(r, layers, t0 + leave_after_s(self._round_s())), None
        else:
            members, latest = await self._ask_members(r, deadline)
        self._last_members = members
        if self.island not in members:
            jump = await self._catch_up(r, members, layers, latest)
            return time.time() - t0, jump
        fetch_at = t0 + leave_after_s(self._round_s())
        while True:
            missing = [(i, layer) for i in members for layer in layers if (r, i, layer) not in self._got]
            if not missing or time.time() >= deadline:
                break
            if time.time() >= fetch_at and await self._merged_nearby(r, members, layers, missing, deadline):
                return time.time() - t0, None
            await self._wait_arrival(deadline if time.time() >= fetch_at else min(deadline, fetch_at))
        waited = time.time() - t0
        if missing:
            # merging without an island here while it (or another) merges with it would leave the
            # islands on different anchors for good: the epoch fails instead, and the planner's next
            # map resumes every island from the latest round they all hold (``begin``)
            silent = sorted({i for i, _ in missing})
            self.on_event({"kind": "island_silent", "round": r, "islands": silent, "t": time.time()})
            raise StepFailed(f"round {r}: island(s) {silent} sent no contribution within {waited:.0f}s")
        self._apply(r, members, layers, waited)
        return waited, None

    async def _merged_nearby(self, r: int, members: list[int], layers: list[int], missing, deadline: float) -> bool:
        """Contributions of round ``r`` still missing here as long as the keeper waits for an island:
        the round as merged by this island's other replicas of these layers (version ``r + 1``: the
        keeper's, where it is one) is fetched and taken instead (the same members' arithmetic: the
        same anchor). A cut that began with an island's contribution on its way to one replica and
        not the other held that replica, and its whole island, until the link was back (12 s, the
        cut-off test). False where no replica here gave it (the wait goes on)."""
        me = self.peer.peer_id
        holders = {layer: [p for p in self._owners[self.island][layer] if p != me] for layer in layers}
        if not all(holders.values()):
            return False
        silent = sorted({i for i, _ in missing})
        log.warning("round %d: island(s) %s's contributions missing here (a cut link?): taking the round as "
                    "this island's replicas merged it", r, silent)
        try:
            got = {layer: await self.fetch(layer, r + 1, holders[layer], self.outer.sizes()[layer], deadline=deadline)
                   for layer in layers}
        except StepFailed:
            return False
        for layer, (a, m) in got.items():
            self.outer.load(layer, a, m, keep_feedback=True)
        self.outer.merged_rounds += 1
        self._merged(r, members, 0.0, tokens=0, fetched=True)
        return True

    def _apply(self, r: int, members: list[int], layers: list[int], waited: float) -> None:
        contribs = {layer: [self._got[(r, i, layer)] for i in members] for layer in layers}
        self.outer.reports.clear()
        self.outer.merge(contribs)
        # how far each island's pseudo-gradient lay from the robust centre, in clip radii (> 1: clipped)
        merged = merge_reports(self.outer.reports)  # keyed by position in the round: by island from here
        by_island = ClipReport(merged.radius, {str(members[int(j)]): x for j, x in merged.ratio.items()}, (),
                               {str(members[int(j)]): x for j, x in merged.cos.items()})
        clip = {int(i): round(x, 3) for i, x in by_island.ratio.items()}
        cos = {int(i): round(x, 3) for i, x in by_island.cos.items()}
        if clip and self.on_verdict is not None:  # judged by island (``train.defence``)
            self.on_verdict(r, by_island)
        self._merged(r, members, waited, tokens=sum(c.tokens for c in contribs[layers[0]]) if layers else 0,
                     **({"clip": clip, "cos": cos} if clip else {}))

    def _merged(self, r: int, members: list[int], waited: float, **row) -> None:
        """Round ``r`` is merged here (``row``: its figures): noted in ``rounds``, its contributions dropped."""
        self.rounds.append({"round": r, "epoch": self.smap.epoch, "wait_s": round(waited, 4), "members": members, **row})
        for key in [k for k in self._got if k[0] <= r]:
            del self._got[key]

    async def _wait_arrival(self, deadline: float) -> None:
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), max(0.01, deadline - time.time()))
        except asyncio.TimeoutError:
            pass

    async def _send(self, r: int, tokens: int, encoded: dict, routes: list[tuple[int, str]], fig: dict) -> None:
        """Round ``r``'s contributions of this peer's layers to one island's holders, one after another
        (retrying a peer not ready yet, up to the job's receive timeout). ``fig``: the round's sending,
        counted in ``sends`` once its last island's is done (each island's go at once: a silent one
        holds up no other)."""
        loop = asyncio.get_running_loop()
        sent = 0
        for layer, dst in routes:
            meta, bufs, _dec = encoded[layer]
            header = {"job": self.job.job_id, "epoch": self.smap.epoch, "round": r, "island": self.island,
                      "layer": layer, "tokens": tokens, "meta": meta}
            charge = layer_charge(self.charges, layer)
            deadline = loop.time() + self.job.recv_timeout_s
            while True:
                url = reachable_at(self.peer, dst)
                try:
                    if url is None:
                        raise ConnectionError("no live address")
                    await self.peer.client.send(url, OUTER, header, bufs, timeout=self.job.recv_timeout_s,
                                                link=self.peer.link_to(dst), charge=charge, peer_id=dst)
                    nbytes = sum(memoryview(b).nbytes for b in bufs)
                    self.bytes_to[dst] = self.bytes_to.get(dst, 0) + nbytes
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
        fig["bytes"] += sent
        fig["left"] -= 1
        if fig["left"] == 0 and fig["bytes"]:
            self.sends.append({"round": r, "send_s": round(time.time() - fig["t0"], 4), "bytes": fig["bytes"]})

    # ---- what other islands send --------------------------------------------------------------------
    def _check_current(self, header: dict, what: str) -> None:
        """A message of this job's current epoch (``outer``, ``outer_members``): 503 while this peer
        has not begun its rounds or has no map of that epoch yet, 400 for another job or a past epoch."""
        if self.outer is None or self.smap is None:
            raise Retry("this peer has not begun its islands' rounds yet")
        if header["job"] != self.job.job_id:
            raise FrameError(f"{what} for another job")
        if header["epoch"] > self.smap.epoch:
            raise Retry("this peer has no stage map for that epoch yet")
        if header["epoch"] < self.smap.epoch:
            raise FrameError(f"epoch {header['epoch']} is over: this peer runs epoch {self.smap.epoch}")

    async def on_outer(self, header: dict, buffers) -> None:
        """The data plane's handler of ``outer`` messages (one layer of one island's round)."""
        check_fields(header, {"job": str, "epoch": int, "round": int, "island": int, "layer": int, "tokens": int,
                              "meta": dict})
        self._check_current(header, "contribution")
        r, i, layer, tokens = header["round"], header["island"], header["layer"], header["tokens"]
        if not 0 <= i < len(self.smap.islands) or i == self.island:
            raise FrameError(f"island {i} is not another island of this map")
        if layer not in self.outer.params:
            raise FrameError(f"this peer does not hold layer {layer}")
        if header.get("src") != self._owners[i][layer][0]:
            raise FrameError(f"layer {layer} of island {i} comes from its stage's first replica, not {str(header.get('src'))[:16]}…")
        if r < self.round - 1:
            raise FrameError(f"round {r} is merged here (this peer is in round {self.round})")
        if r > self.round + (CATCH_UP_AHEAD if self._catching_up else ROUNDS_AHEAD):
            # this peer is behind (a cut, or waiting to catch up): the sender tries again a while
            raise Retry(f"round {r} is ahead of this peer's round {self.round}")
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
        self._arrived.set()
        self._maybe_decide(r)
        return None

    @staticmethod
    def parse_inventory(page) -> Optional[dict]:
        """Another peer's ``inventory()`` from its ``/inventory`` page (untrusted): {"layers": layer ->
        versions, "data_steps": version -> data step}, or None where it has none or it is malformed."""
        try:
            raw = page["outer"]
            layers = {int(k): [int(x) for x in v][:KEEP_VERSIONS * 4] for k, v in list(raw["layers"].items())[:4096]}
            steps = {int(k): int(v) for k, v in list(raw["data_steps"].items())[:KEEP_VERSIONS * 4]}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if any(x < 0 for v in layers.values() for x in v) or any(v < 0 for v in steps.values()):
            return None
        return {"layers": layers, "data_steps": steps}

    @classmethod
    def parse_inventories(cls, pages: dict) -> dict[str, dict]:
        """Peer id -> ``parse_inventory`` of its page, for every page that holds a readable one."""
        return {p: inv for p, page in pages.items() if (inv := cls.parse_inventory(page))}

    def report(self) -> dict:
        return {"island": self.island, "round": self.round, "codec": self.smap.exchange_codec if self.smap else None,
                "bytes_sent": sum(self.bytes_to.values()),
                "bytes_to": {self.smap.name_of(d): n for d, n in self.bytes_to.items()} if self.smap else {},
                "rounds": self.rounds[-50:], "sends": self.sends[-50:], "left_out": self.left_out[-50:],
                "left_out_totals": {str(e): t for e, t in self.left_out_totals.items()}, "rejoins": self.rejoins[-50:],
                "digests": {str(i): hashlib.sha256(a.numpy().tobytes()).hexdigest()[:16]
                            for i, a in self.outer.anchor.items()} if self.outer else {}}
