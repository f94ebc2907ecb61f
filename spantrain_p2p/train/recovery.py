"""Recovery: the state of every layer survives the loss of any one peer.

After each step a peer keeps a snapshot of its layers (weights and optimizer state) and, unless a
replica of its stage holds them anyway, copies them to a buddy (``decide.choose_buddy``), with its
recent losses. A peer that takes over layers in a new epoch loads them from its own snapshot, a
live replica or a buddy's copy (nearest first); the planner resumes from the latest step every
layer survives at (``decide.resume_point`` over the peers' inventories)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from typing import Callable, Optional

from ..net.framing import FrameError, check_fields
from ..osproc import name_thread
from ..pipeline.executor import StepFailed
from ..pipeline.hostcopy import HostCopier
from ..plan.stagemap import StageMap
from ..models import state as layer_state
from ..models.checkpoint import CheckpointDir
from ..models.state import LayerState
from .decide import FAILURE_SPACED_MAX, choose_buddy
from ..models.workload import layer_charge

log = logging.getLogger("spantrain.train")

LOSS_ROWS = FAILURE_SPACED_MAX  # recent loss rows sent along with a buddy copy: copies may be this many steps apart
# the steps an inventory names stay held this long: a re-plan's map reaches its peers within it
# (lan-8 on this box, 2026-11-27 12:48 UTC: every improving re-plan's epoch broke at once, its
# resume step gone from every store by the time the map came, 3 steps later)
INVENTORY_HOLD_S = 15.0
_COST_PER_BYTE: dict[bool, float] = {}


class _Behind:
    """The snapshot thread's work on a CPU stage's states, asked as a CUDA event is: ``query`` (done?)
    and ``synchronize`` (wait; raises what the work raised)."""

    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()

    async def wait(self) -> None:
        """Returns once the work is done (woken by it once, not polling it; not cancelling it when
        the waiter is: a later ``synchronize`` still has it)."""
        await asyncio.shield(asyncio.wrap_future(self.future))


def copy_cost_s_per_byte(encrypted: bool = True, nbytes: int = 4 << 20) -> float:
    """CPU seconds a byte of a buddy copy costs its two ends, measured once per process on this
    machine: the sender's encoding, sealing and socket writes, the receiver's socket reads into a
    buffer of its own, opening and decoding (validation included), of a ``nbytes`` layer state,
    through the functions a copy goes through, across a local socket pair (the best of 3 rounds,
    both threads' CPU). What ``decide.copy_every`` weighs against failures. (The planner's machine
    stands for the swarm's: a peer's copies cost what its own CPU makes of them.) Without the
    socket it read 1.3-1.6 ns a byte in the side-by-side's runs (copies every 4-5 steps), where
    the copies' turns on the senders' event loops alone took 2.9 ns a copied byte (17.7 ms of CPU
    a second for 6.2 MB/s of copies, ``scripts/loop_cpu.py``, 2026-11-30); with it, 2.3 (every 5)."""
    if encrypted not in _COST_PER_BYTE:
        import socket
        import threading

        import torch

        from ..net.secure import Opener, Sealer

        state = [("p:w", torch.randn(nbytes // 4))]
        best = math.inf
        for _ in range(3):
            key = bytes(32)
            sealer, opener = Sealer(key), Opener(key)
            ours, theirs = socket.socketpair()
            received: list = []
            reader_cpu = [0.0]

            def receive(total: int) -> None:
                # plain: straight into the frame's buffer, as the data plane's server receives
                c0 = time.thread_time()
                buf, got = bytearray(1 << 18 if encrypted else total), 0
                with memoryview(buf) as view:
                    while got < total:
                        n = theirs.recv_into(view if encrypted else view[got:])
                        if not n:
                            break
                        got += n
                        if encrypted:
                            received.extend(opener.feed(view[:n]))
                if not encrypted:
                    received.append(buf)
                reader_cpu[0] = time.thread_time() - c0
            try:
                t0 = time.thread_time()
                header, bufs = layer_state.encode(state)
                out = [rec for buf in bufs for rec in sealer.seal(buf)] if encrypted else bufs
                reader = threading.Thread(target=receive, args=(sum(memoryview(b).nbytes for b in out),))
                reader.start()
                for b in out:
                    ours.sendall(b)
                sender_cpu = time.thread_time() - t0
                reader.join()
                t1 = time.thread_time()
                whole = received[0] if len(received) == 1 else b"".join(received)
                layer_state.decode(header, [memoryview(whole)], {"p:w": (nbytes // 4,)})
                best = min(best, sender_cpu + reader_cpu[0] + time.thread_time() - t1)
            finally:
                ours.close()
                theirs.close()
        _COST_PER_BYTE[encrypted] = best / nbytes
    return _COST_PER_BYTE[encrypted]


def recent_rows(loss_sums: dict, upto: int) -> list[list]:
    """The [step, loss sum, count, epoch] rows of the ``LOSS_ROWS`` steps up to ``upto`` that have
    one: what a buddy copy carries (copies are at most that many steps apart). Looked up, not sorted
    out of the whole run's: a step's snapshot sorted every row of the run, 3.4 ms at 10,000 steps."""
    return [[s, *loss_sums[s]] for s in range(upto - LOSS_ROWS + 1, upto + 1) if s in loss_sums]


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
        # a CUDA stage's snapshot is copied to host memory on a side stream while the next step
        # computes (a synchronous copy of a GPT-2-small stage's weights and Adam state took about as
        # long as its step), a CPU stage's on the snapshot thread: ``_copied`` completes with the
        # latest one's copies (a CUDA event, or ``_Behind``)
        self._copier: Optional[HostCopier] = None
        self._copied = None
        self._snapshot_thread: Optional[concurrent.futures.ThreadPoolExecutor] = None  # a CPU stage's (``_capture_behind``)
        self.charges = None  # models.workload.Charges with a workload: a fetched layer is the workload's layer

    def start(self, job, handle, checkpoints: Optional[CheckpointDir] = None) -> None:
        """``checkpoints``: a checkpoint directory to take layer states from (``--resume``)."""
        self.job, self.handle, self.checkpoints = job, handle, checkpoints
        if checkpoints is not None:
            held = checkpoints.inventory()
            log.info("resuming from %s: %d layer(s), latest steps %s", checkpoints.directory, len(held),
                     sorted({max(s) for s in held.values()}) if held else "none")

    def inventory(self) -> dict[int, list[int]]:
        """What this peer holds whole: layer -> steps (its snapshots, a buddy's copies, a checkpoint's)."""
        return self._holdings()[0]

    def partial_inventory(self) -> dict[int, dict[int, frozenset]]:
        """What this peer holds of sharded layers in part: layer -> step -> the parameters whose
        optimizer state its part lacks."""
        return self._holdings()[1]

    def page(self) -> dict:
        """This peer's ``/inventory`` page (JSON: string keys): what it holds whole, and in part; what
        it names stays held a while (``Store.hold``), for a planner that resumes from it."""
        self._hold()
        whole, part = self._holdings()
        return {"inventory": {str(k): v for k, v in whole.items()},
                "partial": {str(k): {str(s): sorted(lack) for s, lack in v.items()} for k, v in part.items()}}

    def _hold(self) -> None:
        until = time.monotonic() + INVENTORY_HOLD_S
        self.store.hold(until)
        self.copies.hold(until)

    def _holdings(self) -> tuple[dict[int, list[int]], dict[int, dict[int, frozenset]]]:
        """(``inventory``, ``partial_inventory``), from one look at each state held."""
        whole: dict[int, list[int]] = {}
        part: dict[int, dict[int, frozenset]] = {}
        for layer, step in sorted(set(self.store.keys()) | set(self.copies.keys())):
            lack = layer_state.missing(self._held(layer, step))
            if lack:
                part.setdefault(layer, {})[step] = lack
            else:
                whole.setdefault(layer, []).append(step)
        if self.checkpoints is not None:
            for layer, steps in self.checkpoints.inventory().items():
                whole[layer] = sorted(set(whole.get(layer, [])) | set(steps))
        return whole, part

    def _held(self, layer: int, step: int):
        """The state of (layer, step) this peer holds, in memory or in its checkpoint directory
        (its own part of a sharded layer put together with a buddy's copy of another part)."""
        st, copy = self.store.get(layer, step), self.copies.get(layer, step)
        if st is None:
            st = copy
        elif copy is not None:
            st = layer_state.merge(st, copy)
        if st is None and self.checkpoints is not None:
            st = self.checkpoints.load(layer, step, self._expected_layer_shapes(layer))
        return st

    def adopt(self, smap: StageMap, islands: bool = False) -> None:
        """The map this peer runs now (buddy copies are checked against it and the one before). A new
        epoch redoes the steps after its start: whatever this peer holds after it, of any layer, is
        of the abandoned timeline and goes. A peer that kept a stage's snapshots after it left the
        stage, and took the stage again after the steps had been redone without it, resumed from its
        own stale snapshot of the same step: its weights parted from its replicas', their checks of
        its work failed and the honest peer was evicted (tests/test_robust.py, one run in five)."""
        if not self._maps or self._maps[-1] is not smap:
            self._maps = [*self._maps[-1:], smap]
            if not (islands or smap.islands):  # (an islands map starts at a round, from the outer state;
                # ``islands``: this is one island's part of such a map)
                for held in (self.store, self.copies):
                    for layer in {layer for layer, _ in held.keys()}:
                        held.drop_after(layer, smap.start_step)

    # ---- after each step --------------------------------------------------------------------------
    def snapshot(self, smap: StageMap, stage: int, layers, opt, first: int, step: int,
                 loss_rows: list, run: LayerState = (), foreign: Optional[list] = None) -> list[tuple[int, LayerState]]:
        """Keeps the state after ``step`` completed steps (with ``run``'s scalars of the whole run
        in every layer's), and sends a copy to the buddy peer (with ``loss_rows``, this peer's
        recent [step, loss sum, count, epoch]). Returns the (layer, state) pairs, readable once
        ``settled`` (or ``settle``) returns: a CUDA stage's are copied on a side stream, a CPU
        stage's on a thread of their own, while the next step computes (``before_update`` holds
        the optimizer's next step until they are). ``foreign`` (a sharded stage): per layer, the
        parameters whose optimizer state another replica holds."""
        copier = self._copier_for(layers)
        if copier is None and not (foreign and any(foreign)):
            states = self._capture_behind(layers, opt, run, first)
        else:
            states = [(first + i, layer_state.capture(layer, opt, run, foreign[i] if foreign else frozenset(), copier))
                      for i, layer in enumerate(layers)]
            if copier is not None:
                self._copied = copier.mark()
        every = smap.copy_every  # copies only after multiples of it: the steps every peer keeps a while
        for i, st in states:
            self.store.put(i, step, st, pin_every=every)
        buddy = choose_buddy(smap, stage, self.peer.peer_id, self.rtt_ms) if step % every == 0 else None
        if buddy is not None and (self._buddy_push is None or self._buddy_push.done()):
            self._buddy_push = asyncio.create_task(self._push_to_buddy(buddy, states, step, loss_rows[-LOSS_ROWS:],
                                                                       smap.epoch))
        return states

    def _capture_behind(self, layers, opt, run: LayerState, first: int) -> list[tuple[int, LayerState]]:
        """A CPU stage's states: walked here, copied on the snapshot thread, each an empty list until
        then. On a cee-3region cloud peer the snapshot took 2.4-2.8 ms of the event loop between two
        steps, its replica waiting; with the copies here the loop spent 24.5-25.0 ms of CPU a step
        against 26.0-27.5, and the gap between steps was 1.9-3.1 ms against 3.3-4.0 (the thread:
        1.4 ms a step; 2026-11-29). ``clone_all`` lets go of the GIL while it copies; the walk is
        Python and stays on the loop (walked on the thread as well, the steps were 115-119 ms
        against 110-116: most likely its hold of the GIL as the next step began). Nothing of a stage's state is
        written before ``before_update``, and its readers wait for ``settled``."""
        walks = [layer_state.walk(layer, opt, run) for layer in layers]
        states: list[tuple[int, LayerState]] = [(first + i, []) for i in range(len(layers))]

        def copy() -> None:
            for (_, st), done in zip(states, layer_state.copied(walks)):
                st.extend(done)
        if self._snapshot_thread is None:
            self._snapshot_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot",
                                                                          initializer=name_thread, initargs=("snapshot",))
        self._copied = _Behind(self._snapshot_thread.submit(copy))
        return states

    def _copier_for(self, layers) -> Optional[HostCopier]:
        device = next((p.device for layer in layers for p in layer.parameters()), None)
        if device is None or device.type != "cuda":
            return None
        if self._copier is None or self._copier.stream.device != device:
            self._copier = HostCopier(device)
        return self._copier

    def before_update(self) -> None:
        """Call before the stage's weights or optimizer state change on the device (its optimizer
        step, a load): the device stream waits for the latest snapshot's copies (no host wait); a CPU
        stage's thread waits for the snapshot thread (done long before, as a rule: it had the step)."""
        if isinstance(self._copied, _Behind):
            self._copied.synchronize()  # (on the compute thread: the loop never waits here)
        elif self._copied is not None:
            import torch

            torch.cuda.current_stream(self._copier.stream.device).wait_event(self._copied)

    async def settled(self) -> None:
        """Returns once the latest snapshot is readable in host memory (one taken while it waited
        included): read the store right after it, with no await between."""
        while self._copied is not None:
            done = self._copied
            if isinstance(done, _Behind):
                # woken once by the snapshot thread: polled like a CUDA event, the loop set a timer
                # every millisecond of the copy (57 a second a peer on the side-by-side's 1F1B)
                await done.wait()  # (raises what the snapshot thread raised)
            else:
                await HostCopier.wait(None, done)
            if done is self._copied:
                return

    def settle(self) -> None:
        """``settled``, blocking (a checkpoint written at once)."""
        if self._copied is not None:
            self._copied.synchronize()

    async def _push_to_buddy(self, buddy: str, states, step: int, rows: list, epoch: int = 0) -> None:
        try:
            await self.settled()
            for i, (layer, st) in enumerate(states):
                header, bufs = layer_state.encode(st)
                header.update({"job": self.job.job_id, "layer": layer, "step": step, "epoch": epoch})
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
    async def load(self, layers, opt, first: int, step: int, foreign: Optional[list] = None) -> dict:
        """Puts the layers in their state after ``step`` steps: fresh at step 0, else from this peer's
        own snapshot or checkpoint directory, a live replica or a buddy's copy (nearest first).
        Returns the run's scalars the states carried (``s:`` entries; empty for fresh layers).
        ``foreign`` (a sharded stage): per layer, the parameters whose optimizer state another
        replica holds: those of a layer's state may be missing; the others are put together from
        the parts the live peers hold."""
        invs = None
        run: dict = {}
        await self.settled()
        self.before_update()
        for i, layer in enumerate(layers):
            idx = first + i
            skip = foreign[i] if foreign else frozenset()
            st = self._held(idx, step)
            if st is None and step == 0:
                self.store.drop_after(idx, 0)
                self.store.put(idx, 0, layer_state.capture(layer, opt, foreign=skip))  # built from the job's seed
                continue
            if st is None or layer_state.missing(st) - skip:
                if invs is None:
                    invs = await self.holdings()
                st = await self._fetch_layer(idx, step, invs, st, skip)
                self.on_event({"kind": "fetched", "layer": idx, "step": step, "t": time.time()})
            layer_state.apply(layer, opt, st, skip)
            run = run or layer_state.run_entries(st)
            # the steps kept for the copy interval stay (a second crash before the next copy lands
            # resumes there again); the abandoned timeline after ``step`` goes
            self.store.drop_after(idx, step)
            self.store.put(idx, step, st, pin_every=self._maps[-1].copy_every if self._maps else 1)
        return run

    async def gather(self, step: int) -> dict:
        """Every layer of the model in its state after ``step`` steps (layer -> state): from this
        peer's own snapshots and copies, else from the live peers that hold it, nearest first (the
        trained model put together from where its stages trained: the Python API's weights)."""
        out, invs = {}, None
        for i in range(self.handle.num_layers):
            await self.settled()  # (the trainer may have snapshotted again while a layer was fetched)
            st = self._held(i, step)
            if st is None or layer_state.missing(st):
                if invs is None:
                    invs = await self.holdings()
                st = await self._fetch_layer(i, step, invs, st)
            out[i] = st
        return out

    async def inventories(self) -> dict[str, dict[int, list[int]]]:
        """What every other live peer holds whole: peer id -> layer -> steps."""
        return {pid: whole for pid, (whole, _) in (await self.holdings()).items()}

    async def holdings(self) -> dict[str, tuple[dict[int, list[int]], dict[int, dict[int, frozenset]]]]:
        """What every other live peer holds: peer id -> (layer -> steps held whole, layer -> step ->
        the parameters whose optimizer state its part lacks)."""
        out = {}
        for pid, got in (await self.inventory_pages()).items():
            try:
                whole = {int(k): [int(x) for x in v][:16] for k, v in list(got["inventory"].items())[:4096]}
                part = {int(k): {int(s): frozenset(str(n)[:256] for n in lack[:4096]) for s, lack in list(v.items())[:16]}
                        for k, v in list(got.get("partial", {}).items())[:4096]}
                out[pid] = (whole, part)
            except Exception as e:  # a malformed page: that peer holds nothing we can use
                log.info("bad inventory from %s: %s", self.peer.name_of(pid), e)
        return out

    async def resume_inventories(self) -> list[dict[int, list[int]]]:
        """Per peer (this one included), the layers and steps it holds whole, and the ones that the
        parts of sharded layers held across the peers make whole (``state.covered``)."""
        held = await self.holdings()
        self._hold()  # the planner trains on too until its map comes
        whole, part = self._holdings()
        return [*(w for w, _ in held.values()), whole, layer_state.covered([*(p for _, p in held.values()), part])]

    async def inventory_pages(self) -> dict[str, dict]:
        """Every other live peer's ``/inventory`` page, as it sent it (untrusted): peer id -> page. A
        peer the swarm evicted (``StageMap.evicted``) is asked nothing: what it hands over is what it
        forged (a joiner of a stage fetched its layers from the replica just evicted for attacking)."""
        out = {}
        for r in self.peer.live_members():
            if r.peer_id == self.peer.peer_id or not r.data_url or r.peer_id in self.peer.evicted:
                continue
            try:
                out[r.peer_id] = await self.peer.client.status(r.data_url, timeout=3.0, path="/inventory")
            except Exception as e:  # an unreachable peer holds nothing we can use
                log.info("no inventory from %s: %s", self.peer.name_of(r.peer_id), e)
        return out

    async def _fetch_layer(self, layer: int, step: int, invs: dict, have: Optional[LayerState] = None,
                           skip: frozenset = frozenset()) -> LayerState:
        """The state of ``layer`` at ``step`` from the nearest peers holding it (``invs``: their
        ``holdings``), whole but for ``skip``: from one holding it whole, or put together from
        ``have`` and the parts others hold."""
        def lacks(st) -> frozenset:
            return layer_state.missing(st) - skip if st is not None else frozenset({"*"})

        whole = [p for p, (w, _) in invs.items() if step in w.get(layer, [])]
        parts = [p for p, (_, part) in invs.items() if step in part.get(layer, {})]
        st = have
        for src in sorted(whole, key=lambda p: (self.rtt_ms(p), p)) + sorted(parts, key=lambda p: (self.rtt_ms(p), p)):
            if not lacks(st):
                break
            if src in parts and st is not None and not (lacks(st) - invs[src][1][layer][step]):
                continue  # its part lacks what this one does
            try:
                reply = await self.peer.client.send(
                    self.peer.data_url_of(src), "fetch", {"job": self.job.job_id, "layer": layer, "step": step},
                    timeout=self.job.recv_timeout_s, link=self.peer.link_to(src),
                    reply_charge=layer_charge(self.charges, layer))
                got = layer_state.decode(*reply, self._expected_layer_shapes(layer))
                st = got if st is None else layer_state.merge(st, got)
                log.info("layer %d at step %d fetched from %s", layer, step, self.peer.name_of(src))
            except Exception as e:
                log.warning("fetching layer %d from %s failed: %s", layer, self.peer.name_of(src), e)
        if lacks(st):
            raise StepFailed(f"no live peer could give layer {layer} at step {step}"
                             + (f" (the optimizer state of {sorted(lacks(st))[:3]})" if st is not None else ""))
        return st

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
        epoch, cur = header.get("epoch", 0), self._maps[-1] if self._maps else None
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise FrameError("a copy's epoch must be an int")
        if cur is not None and epoch < cur.epoch and step > cur.start_step:
            # taken in an epoch before this one, after the step this one redoes from: of an abandoned
            # timeline (``adopt`` dropped its like; a copy in flight must not bring one back)
            raise FrameError(f"a copy of step {step} from epoch {epoch}, abandoned: epoch {cur.epoch} redoes from "
                             f"step {cur.start_step}")
        self.copies.put(layer, step, layer_state.decode(header, buffers, self._expected_layer_shapes(layer)),
                        merge_parts=True)
        self._hold_losses(header.get("losses"))
        return None

    @staticmethod
    def _owns_alone(smap: StageMap, peer: object, layer: int) -> bool:
        """Whether ``peer`` holds (its part of) ``layer``'s state alone in ``smap`` (only such a peer
        sends buddy copies): the one peer of its stage, or a replica of a sharded stage."""
        k = smap.stage_of(peer) if isinstance(peer, str) else None
        if k is None:
            return False
        st = smap.stages[k]
        return (len(st.peers) == 1 or st.shard) and st.layers[0] <= layer < st.layers[1]

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
        await self.settled()
        st = self._held(layer, step)
        if st is None:
            raise FrameError(f"this peer holds no state of layer {layer} at step {step}")
        return layer_state.encode(st)
