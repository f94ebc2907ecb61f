"""Recovery: the state of every layer survives the loss of any one peer.

After each step a peer keeps a snapshot of its layers (weights and optimizer state) and, unless a
replica of its stage holds them anyway, copies them to a buddy (``decide.choose_buddy``), with its
recent losses. A peer that takes over layers in a new epoch loads them from its own snapshot, a
live replica or a buddy's copy (nearest first); the planner resumes from the latest step every
layer survives at (``decide.resume_point`` over the peers' inventories)."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable, Optional

from ..net.framing import FrameError, check_fields
from ..pipeline.executor import StepFailed
from ..plan.stagemap import StageMap
from ..models import state as layer_state
from ..models.checkpoint import CheckpointDir
from ..models.state import LayerState
from .decide import choose_buddy
from ..models.workload import layer_charge

log = logging.getLogger("spantrain.train")

LOSS_ROWS = 8  # recent loss rows sent along with a buddy copy


class Recovery:
    """This peer's snapshots and the copies it holds for others (``store``), and the losses a
    buddy sent along (``held_losses``). ``rtt_ms(peer id)`` orders buddies and sources;
    ``on_event(dict)`` records what was fetched, for the run's report."""

    def __init__(self, peer, rtt_ms: Callable[[str], float], on_event: Callable[[dict], None]):
        self.peer, self.rtt_ms, self.on_event = peer, rtt_ms, on_event
        self.job = self.handle = self.checkpoints = None
        self.store = layer_state.Store(keep_steps=3)  # own snapshots, by (layer, step)
        # copies buddies sent, kept apart: a copy is taken only from the peer the map gives that layer
        self.copies = layer_state.Store(keep_steps=3)
        self._maps: list = []  # the stage maps this peer ran lately (a copy may come from the one before)
        self.held_losses: dict[int, tuple[float, int, int]] = {}  # a buddy's recent loss_sums, reported for it
        self._buddy_push: Optional[asyncio.Task] = None
        self.charges = None  # models.workload.Charges with a workload: a fetched layer is the workload's layer

    def start(self, job, handle, checkpoints: Optional[CheckpointDir] = None) -> None:
        """``checkpoints``: a checkpoint directory to take layer states from (``--resume``)."""
        self.job, self.handle, self.checkpoints = job, handle, checkpoints
        if checkpoints is not None:
            held = checkpoints.inventory()
            log.info("resuming from %s: %d layer(s), latest steps %s", checkpoints.directory, len(held),
                     sorted({max(s) for s in held.values()}) if held else "none")

    def inventory(self) -> dict[int, list[int]]:
        """What this peer holds: layer -> steps (its snapshots, a buddy's copies, a checkpoint's)."""
        inv = self.store.inventory()
        for layer, steps in self.copies.inventory().items():
            inv[layer] = sorted(set(inv.get(layer, [])) | set(steps))
        if self.checkpoints is not None:
            for layer, steps in self.checkpoints.inventory().items():
                inv[layer] = sorted(set(inv.get(layer, [])) | set(steps))
        return inv

    def _held(self, layer: int, step: int):
        """The state of (layer, step) this peer holds, in memory or in its checkpoint directory."""
        st = self.store.get(layer, step)
        if st is None:
            st = self.copies.get(layer, step)
        if st is None and self.checkpoints is not None:
            st = self.checkpoints.load(layer, step, self._expected_layer_shapes(layer))
        return st

    def adopt(self, smap: StageMap) -> None:
        """The map this peer runs now (buddy copies are checked against it and the one before)."""
        if not self._maps or self._maps[-1] is not smap:
            self._maps = [*self._maps[-1:], smap]

    # ---- after each step --------------------------------------------------------------------------
    def snapshot(self, smap: StageMap, stage: int, layers, opt, first: int, step: int,
                 loss_rows: list, run: LayerState = ()) -> list[tuple[int, LayerState]]:
        """Keeps the state after ``step`` completed steps (with ``run``'s scalars of the whole run
        in every layer's), and sends a copy to the buddy peer (with ``loss_rows``, this peer's
        recent [step, loss sum, count, epoch]). Returns the (layer, state) pairs."""
        states = [(first + i, layer_state.capture(layer, opt, run)) for i, layer in enumerate(layers)]
        for i, st in states:
            self.store.put(i, step, st)
        buddy = choose_buddy(smap, stage, self.peer.peer_id, self.rtt_ms)
        if buddy is not None and (self._buddy_push is None or self._buddy_push.done()):
            self._buddy_push = asyncio.create_task(self._push_to_buddy(buddy, states, step, loss_rows[-LOSS_ROWS:]))
        return states

    async def _push_to_buddy(self, buddy: str, states, step: int, rows: list) -> None:
        try:
            for i, (layer, st) in enumerate(states):
                header, bufs = layer_state.encode(st)
                header.update({"job": self.job.job_id, "layer": layer, "step": step})
                if i == 0 and rows:
                    header["losses"] = rows  # first, so the copy of a step never arrives without its loss
                url = self.peer.data_url_of(buddy)
                if url is None:
                    return
                await self.peer.client.send(url, "ckpt", header, bufs, timeout=self.job.recv_timeout_s,
                                            link=self.peer.link_to(buddy))
        except Exception as e:
            log.info("copy of step %d to buddy %s failed: %s", step, self.peer.name_of(buddy), e)

    # ---- taking over layers -----------------------------------------------------------------------
    async def load(self, layers, opt, first: int, step: int) -> dict:
        """Puts the layers in their state after ``step`` steps: fresh at step 0, else from this peer's
        own snapshot or checkpoint directory, a live replica or a buddy's copy (nearest first).
        Returns the run's scalars the states carried (``s:`` entries; empty for fresh layers)."""
        invs = None
        run: dict = {}
        for i, layer in enumerate(layers):
            idx = first + i
            st = self._held(idx, step)
            if st is None and step == 0:
                self.store.put(idx, 0, layer_state.capture(layer, opt))  # built from the job's seed: the initial state
                continue
            if st is None:
                if invs is None:
                    invs = await self.inventories()
                st = await self._fetch_layer(idx, step, invs)
                self.on_event({"kind": "fetched", "layer": idx, "step": step, "t": time.time()})
            layer_state.apply(layer, opt, st)
            run = run or layer_state.run_entries(st)
            self.store.put(idx, step, st)
        return run

    async def inventories(self) -> dict[str, dict[int, list[int]]]:
        """What every other live peer holds: peer id -> layer -> steps."""
        out = {}
        for pid, got in (await self.inventory_pages()).items():
            try:
                out[pid] = {int(k): [int(x) for x in v][:16] for k, v in list(got["inventory"].items())[:4096]}
            except Exception as e:  # a malformed page: that peer holds nothing we can use
                log.info("bad inventory from %s: %s", self.peer.name_of(pid), e)
        return out

    async def inventory_pages(self) -> dict[str, dict]:
        """Every other live peer's ``/inventory`` page, as it sent it (untrusted): peer id -> page."""
        out = {}
        for r in self.peer.live_members():
            if r.peer_id == self.peer.peer_id or not r.data_url:
                continue
            try:
                out[r.peer_id] = await self.peer.client.status(r.data_url, timeout=3.0, path="/inventory")
            except Exception as e:  # an unreachable peer holds nothing we can use
                log.info("no inventory from %s: %s", self.peer.name_of(r.peer_id), e)
        return out

    async def _fetch_layer(self, layer: int, step: int, invs: dict) -> list:
        holders = [p for p, inv in invs.items() if step in inv.get(layer, [])]
        for src in sorted(holders, key=lambda p: (self.rtt_ms(p), p)):
            try:
                reply = await self.peer.client.send(
                    self.peer.data_url_of(src), "fetch", {"job": self.job.job_id, "layer": layer, "step": step},
                    timeout=self.job.recv_timeout_s, link=self.peer.link_to(src),
                    reply_charge=layer_charge(self.charges, layer))
                st = layer_state.decode(*reply, self._expected_layer_shapes(layer))
                log.info("layer %d at step %d fetched from %s", layer, step, self.peer.name_of(src))
                return st
            except Exception as e:
                log.warning("fetching layer %d from %s failed: %s", layer, self.peer.name_of(src), e)
        raise StepFailed(f"no live peer could give layer {layer} at step {step}")

    # ---- what others send and ask -----------------------------------------------------------------
    def _expected_layer_shapes(self, layer: int) -> dict:
        return layer_state.expected_shapes(self.handle.meta_layers()[layer])  # built once (ModelHandle.warm)

    def _check_layer_header(self, header: dict) -> tuple[int, int]:
        check_fields(header, {"job": str, "layer": int, "step": int})
        if self.job is None or header["job"] != self.job.job_id:
            raise FrameError("layer state for another job")
        if not 0 <= header["layer"] < self.handle.num_layers or not 0 <= header["step"] <= self.job.steps:
            raise FrameError("layer or step out of range")
        return header["layer"], header["step"]

    async def on_ckpt(self, header: dict, buffers) -> None:
        """A buddy's copy of one of its layers after a step: held for recovery."""
        layer, step = self._check_layer_header(header)
        src = header.get("src")
        if not any(self._owns_alone(m, src, layer) for m in self._maps):
            raise FrameError(f"a copy of layer {layer} from {str(src)[:16]}, which the stage map does not give it alone")
        self.copies.put(layer, step, layer_state.decode(header, buffers, self._expected_layer_shapes(layer)))
        self._hold_losses(header.get("losses"))
        return None

    @staticmethod
    def _owns_alone(smap: StageMap, peer: object, layer: int) -> bool:
        """Whether ``peer`` holds ``layer`` alone in ``smap`` (only such a peer sends buddy copies)."""
        k = smap.stage_of(peer) if isinstance(peer, str) else None
        if k is None:
            return False
        st = smap.stages[k]
        return len(st.peers) == 1 and st.layers[0] <= layer < st.layers[1]

    def _hold_losses(self, rows) -> None:
        """Keeps a buddy's recent (step, loss sum, count, epoch) rows, so that if it dies before its
        report is read, its part of the loss curve is still reported (by this peer)."""
        if rows is None:
            return
        if not isinstance(rows, list) or len(rows) > LOSS_ROWS:
            raise FrameError("losses must be a short list of [step, sum, count, epoch]")
        for row in rows:
            if (not isinstance(row, list) or len(row) != 4 or not all(isinstance(x, int) for x in row[::2])
                    or not isinstance(row[1], (int, float)) or not isinstance(row[2], int)
                    or not math.isfinite(row[1]) or not 0 < row[2] <= self.job.num_micro_batches
                    or not 0 <= row[0] < self.job.steps or row[3] < 0):
                raise FrameError(f"bad loss row {str(row)[:80]}")
            self.held_losses[row[0]] = (float(row[1]), row[2], row[3])
        for st in sorted(self.held_losses)[:-LOSS_ROWS * 4]:
            del self.held_losses[st]

    async def on_fetch(self, header: dict, buffers):
        """Another peer takes over a layer: send it the state held for (layer, step)."""
        layer, step = self._check_layer_header(header)
        st = self._held(layer, step)
        if st is None:
            raise FrameError(f"this peer holds no state of layer {layer} at step {step}")
        return layer_state.encode(st)
