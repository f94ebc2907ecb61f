"""Verified computation on the wire (``robust.verify`` has the pure parts and the protocol).

Each peer of a job with the defences on keeps its pipeline messages (``ledger``, fed by the
transport) and, where its stage has replicas, signs a manifest of their digests at the end of each
step for them (``publish``). At its gradient sum, a replica runs the step's checks (``begin_checks``, ``end_checks``): for
each chosen micro-batch of another replica, it sends that peer's signed manifest to the neighbours
at both ends of the micro-batch (``vfetch``: they answer a replica of that peer's stage only); each
checks the manifest against what crossed the wire between them (a peer that signed other than what
it sent or received is accused, as a tensor the gate refuses) and answers with the messages. The
replica checks them against the signed digests and recomputes the micro-batch (the same layers,
weights and inputs, on its compute thread): further than the tolerance from what the peer sent
convicts it (``Defence``: judged with the robust sum's verdicts, by the stage's other replicas).
Fetched messages that disagree with the signed digests convict nobody here (the neighbour, or the
peer, lies: the neighbour has accused the peer when it is the peer).
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
from typing import Optional

from ..net.framing import FrameError
from ..pipeline.executor import _Mb
from ..pipeline.messages import ACT, GRAD, Expect, decode_tensor
from ..robust import verify as vf
from ..swarm.records import BadRecord, open_payload, sign_payload

log = logging.getLogger("spantrain.train")

MANIFEST_KIND, FETCH_KIND, SUSPECT_KIND = "vmanifest", "vfetch", "vsuspect"
NAMED_STEPS = 20  # a peer named a suspect is checked every step for this many steps
MAX_SUSPECTS = 2  # suspects checked in one step (a liar naming everyone costs a bounded share)
FETCH_WAIT_S = 30.0  # how long a neighbour holds a check's fetch for messages not kept yet
MANIFEST_WAIT_S = 5.0  # how long a check waits for the checked peer's manifest (honest ones come with its sum)
WITHHELD = 3  # checks in a row that found no manifest of a peer: it withholds them (convicted)
MAX_MANIFEST_BYTES = 256 * 1024
KEEP_MANIFESTS = 64  # (peer, step) manifests kept


class Verifier:
    def __init__(self, peer, defence, transport):
        self.peer, self.defence, self.transport = peer, defence, transport
        self.ledger = vf.Ledger()
        self.on = False  # the job's defences are on and it verifies (``start``)
        self.p = 0.0
        self.tolerance = 0.0
        self.job = None
        self.smap = None
        self.rng = random.Random()  # no seed: the peer checked cannot guess which micro-batch
        self.manifests: dict[tuple[str, int], tuple[dict, dict, list]] = {}  # (peer, step) -> (signed, mbs, suspects)
        self._arrived: dict[tuple[str, int], asyncio.Event] = {}
        self.named: dict[str, int] = {}  # suspects named by other replicas' manifests or a gate -> step
        self.targeted: dict[tuple[str, int], int] = {}  # (suspect, step) -> the micro-batch a gate found odd
        self.checks = 0
        self.skipped: dict[str, int] = {}  # why checks were not made
        self.failed: dict[str, int] = {}  # peer -> checks it failed
        self.max_error = 0.0  # the largest relative error a passed check had (the float noise seen)
        self.missing: dict[str, int] = {}  # peer -> checks in a row that found no manifest of it
        self.active = False  # this epoch's map has a stage with replicas (else nothing is kept)
        self._changed = asyncio.Event()

    def start(self, job) -> None:
        self.job = job
        self.on = job.aggregate == "robust" and job.verify > 0
        self.p = float(job.verify)
        self.tolerance = vf.TOLERANCE.get(job.precision, 0.1)

    def begin_epoch(self, smap) -> None:
        self._kept()  # the fetches waiting on the old epoch's messages end
        self.smap = smap
        self.active = self.on and any(len(st.peers) >= 2 for st in smap.stages)
        self.ledger.clear()
        self.manifests.clear()

    # ---- what the transport tells ---------------------------------------------------------------------
    def sent(self, dst: str, header: dict, buffers) -> None:
        if self.active and header.get("kind") in (ACT, GRAD):
            self.ledger.put(f"send/{header['kind']}", dst, header, buffers)
            self._kept()

    def received(self, src: str, header: dict, buffers) -> None:
        if self.active and header.get("kind") in (ACT, GRAD):
            self.ledger.put(f"recv/{header['kind']}", src, header, buffers)
            self._kept()

    def _kept(self) -> None:
        """Wakes the fetches waiting for a message to be kept."""
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- manifests --------------------------------------------------------------------------------------
    def publish(self, step: int, to: list[str]) -> None:
        """Signs this step's manifest and sends it to ``to`` (its replicas), in the background (a late
        manifest only delays a check)."""
        if not self.on:
            return
        mine = self.ledger.mine(step)
        dests = sorted(to)
        suspects = sorted({**self.defence.verdicts.convicted, **self.defence.verified})
        signed = sign_payload(vf.manifest(self.job.job_id, self.smap.epoch, step, mine, suspects),
                              self.peer.identity, MAX_MANIFEST_BYTES)
        header = {"job": self.job.job_id, "epoch": self.smap.epoch, "step": step}
        bufs = [signed["body"], signed["key"], signed["sig"]]
        for dst in dests:
            self.peer.spawn(self._send(dst, header, bufs), "manifest")

    async def _send(self, dst: str, header: dict, bufs) -> None:
        url = self.peer.data_url_of(dst)
        if url is None:
            return
        try:
            await self.peer.client.send(url, MANIFEST_KIND, dict(header), bufs, timeout=self.job.recv_timeout_s,
                                        link=self.peer.link_to(dst), peer_id=dst)
        except Exception as e:
            log.debug("manifest to %s failed: %s", self.peer.name_of(dst), e)

    async def on_manifest(self, header: dict, buffers):
        src = header["src"]
        smap = self.smap
        if not self.on or smap is None or header.get("job") != self.job.job_id or header.get("epoch") != smap.epoch:
            raise FrameError("no manifest is taken for that job or epoch")
        if smap.stage_of(src) is None:
            raise FrameError("a manifest comes from a peer of the stage map")
        signed, signer, (job, epoch, step, mbs, suspects) = self._open(buffers)
        if signer != src or job != self.job.job_id or epoch != smap.epoch or header.get("step") != step:
            raise FrameError("a manifest must be its sender's own, of this job, epoch and step")
        key = (src, step)
        self.manifests[key] = (signed, mbs, suspects)
        for old in sorted(self.manifests, key=lambda k: k[1])[:max(0, len(self.manifests) - KEEP_MANIFESTS)]:
            del self.manifests[old]
        if (ev := self._arrived.get(key)) is not None:  # a check waits for it
            ev.set()
        for s in suspects:
            if s != self.peer.peer_id and smap.stage_of(s) == smap.stage_of(self.peer.peer_id):
                self.named.setdefault(s, step)
        return None

    @staticmethod
    def _open(buffers) -> tuple[dict, str, tuple]:
        """(signed value, signer, parsed manifest) of a manifest's 3 buffers; FrameError saying why not."""
        if len(buffers) != 3 or sum(b.nbytes for b in buffers) > MAX_MANIFEST_BYTES + 4096:
            raise FrameError("a manifest is 3 buffers (body, key, signature)")
        signed = {"body": bytes(buffers[0]), "key": bytes(buffers[1]), "sig": bytes(buffers[2])}
        try:
            signer, payload = open_payload(signed, MAX_MANIFEST_BYTES)
            return signed, signer, vf.parse_manifest(payload)
        except (BadRecord, ValueError) as e:
            raise FrameError(f"bad manifest: {e}") from None

    # ---- suspects a gate names ------------------------------------------------------------------------------
    def name_suspect(self, whom: str, step: int, mb: int) -> None:
        """A neighbour's tensor was odd (the gate): its replicas check that micro-batch, and it, from now on."""
        smap = self.smap
        k = smap.stage_of(whom) if self.on and smap is not None else None
        if k is None:
            return
        header = {"job": self.job.job_id, "epoch": smap.epoch, "step": step, "mb": mb, "peer": whom}
        for dst in smap.stages[k].peers:
            if dst != whom:
                self.peer.spawn(self._note(dst, header), "suspect")

    async def _note(self, dst: str, header: dict) -> None:
        url = self.peer.data_url_of(dst)
        try:
            if url is not None:
                await self.peer.client.send(url, SUSPECT_KIND, dict(header), timeout=self.job.recv_timeout_s,
                                            link=self.peer.link_to(dst), peer_id=dst)
        except Exception as e:
            log.debug("suspect note to %s failed: %s", self.peer.name_of(dst), e)

    async def on_suspect(self, header: dict, buffers):
        smap, me = self.smap, self.peer.peer_id
        step, mb, whom = header.get("step"), header.get("mb"), header.get("peer")
        if not self.on or smap is None or header.get("job") != self.job.job_id or header.get("epoch") != smap.epoch:
            raise FrameError("no suspect is taken for that job or epoch")
        if not isinstance(step, int) or not isinstance(mb, int) or not isinstance(whom, str) or whom == me \
                or smap.stage_of(whom) is None or smap.stage_of(whom) != smap.stage_of(me) or smap.stage_of(header["src"]) is None:
            raise FrameError("a suspect is another replica of this peer's stage, named by a peer of the map")
        self.named[whom] = max(step, self.named.get(whom, step))
        self.targeted[(whom, step)] = mb
        if len(self.targeted) > 256:
            self.targeted.pop(next(iter(self.targeted)))
        return None

    # ---- a replica's checks -------------------------------------------------------------------------------
    async def on_fetch(self, header: dict, buffers):
        """A replica of ``peer``'s stage asks for the messages this peer exchanged with ``peer`` in
        (step, mb): answered once both are here (a check starts with its step), or when the wait
        ends. Shown ``peer``'s signed manifest of that step (a checker whose fetched messages did
        not match it): where it says other than what crossed the wire, ``peer`` is accused."""
        src, smap = header["src"], self.smap
        step, mb, whom = header.get("step"), header.get("mb"), header.get("peer")
        if not self.on or smap is None or header.get("job") != self.job.job_id or header.get("epoch") != smap.epoch:
            raise FrameError("no check is served for that job or epoch")
        if not isinstance(step, int) or not isinstance(mb, int) or not isinstance(whom, str):
            raise FrameError("a check asks for {step, mb, peer}")
        k = smap.stage_of(whom)
        if k is None or whom == src or smap.stage_of(src) != k:
            raise FrameError("only a replica of that peer's stage may check it")
        if buffers:
            _signed, signer, (job, epoch, m_step, mbs, _s) = self._open(buffers)
            if signer != whom or job != self.job.job_id or epoch != smap.epoch or m_step != step:
                raise FrameError("the manifest shown is not that peer's of this job, epoch and step")
            wrong = vf.disagreements({mb: mbs.get(mb, {})}, self.ledger.mine(step),
                                     {mb: self.ledger.exchanged(step, whom).get(mb, [])})
            if wrong:
                self.defence.accuse_neighbour(whom, step, f"its signed manifest of step {step} says other than "
                                                          f"what it exchanged with this peer ({wrong[0]})")
        loop = asyncio.get_running_loop()
        end = loop.time() + min(FETCH_WAIT_S, self.transport.timeout_s())
        while len(kept := [(slot, got) for slot in vf.SLOTS if (got := self.ledger.get(step, mb, slot, whom))]) < 2 \
                and loop.time() < end and self.smap is smap:  # (a neighbour exchanges 2 messages a micro-batch)
            try:
                await asyncio.wait_for(self._changed.wait(), end - loop.time())
            except TimeoutError:
                break
        entries, bufs = [], []
        for slot, got in kept:
            entries.append({"slot": slot, "header": got[0], "n": len(got[1])})
            bufs += got[1]
        return {"entries": entries}, bufs

    def _mbs_of(self, st) -> dict[str, list[int]]:
        row = st.assignments[st.k]
        return {p: [m for m, x in enumerate(row) if x == p] for p in st.replicas if p != self.peer.peer_id}

    def begin_checks(self, step: int, st) -> Optional[asyncio.Task]:
        """At the start of a step: its checks of the other replicas of this stage (suspects, and
        one at random with probability p), running beside the step (they wait for the messages and
        recompute as these come: not in the step's way). ``st``: the trainer's stage."""
        if not self.active or len(st.replicas) < 2 or self.job.precision == "fp16":
            return None
        named = [p for p, at in self.named.items() if at >= step - NAMED_STEPS]
        suspects = [p for p in {**dict.fromkeys(named), **self.defence.verdicts.convicted, **self.defence.verified}
                    if p in st.replicas and p != self.peer.peer_id]
        if len(suspects) > MAX_SUSPECTS:
            suspects = self.rng.sample(suspects, MAX_SUSPECTS)
        picks = vf.choose(self.rng, self.p, self._mbs_of(st), suspects)
        return asyncio.create_task(self._checks(step, st, picks)) if picks else None

    async def end_checks(self, step: int, st, started: Optional[asyncio.Task]) -> None:
        """Before this peer's optimizer step (its weights are still the checked peers'): the
        micro-batches a gate named during the step are checked, and every check ends."""
        late = [(whom, mb) for (whom, s), mb in list(self.targeted.items()) if s == step and whom in st.replicas]
        for key in [(whom, step) for whom, _ in late]:
            self.targeted.pop(key, None)
        if late and self.active and self.job.precision != "fp16":
            await self._checks(step, st, late)
        if started is not None:
            await started

    async def _checks(self, step: int, st, picks: list[tuple[str, int]]) -> None:
        for whom, mb in picks:
            try:
                await self._check_one(step, st, whom, mb)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a check that cannot be made convicts nobody
                self.skipped[type(e).__name__] = self.skipped.get(type(e).__name__, 0) + 1
                log.info("step %d: no check of %s's micro-batch %d: %s", step, self.smap.name_of(whom), mb, e)

    async def _manifest_of(self, whom: str, step: int) -> Optional[tuple[dict, dict]]:
        """``whom``'s manifest of ``step`` (its micro-batches' digests), waited for a while; None if
        it did not come (``WITHHELD`` such checks in a row convict it)."""
        key = (whom, step)
        if key not in self.manifests:
            ev = self._arrived.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), min(MANIFEST_WAIT_S, self.transport.timeout_s()))
            except TimeoutError:
                pass
            finally:
                self._arrived.pop(key, None)
        if key not in self.manifests:
            self.missing[whom] = self.missing.get(whom, 0) + 1
            if self.missing[whom] >= WITHHELD:
                self._convict(whom, step, f"no manifest of its steps came in {WITHHELD} checks in a row")
            return None
        self.missing.pop(whom, None)
        return self.manifests[key][:2]

    async def _fetch(self, at: str, step: int, mb: int, whom: str, manifest: list = ()) -> dict:
        """slot (as ``whom`` names it) -> (header, buffers) of the messages ``at`` exchanged with
        ``whom`` in (step, mb); ``manifest``: ``whom``'s signed manifest, shown to ``at``."""
        reply = await self.peer.client.send(
            self.peer.data_url_of(at), FETCH_KIND,
            {"job": self.job.job_id, "epoch": self.smap.epoch, "step": step, "mb": mb, "peer": whom}, manifest,
            timeout=self.transport.timeout_s(), link=self.peer.link_to(at), peer_id=at)
        if reply is None:
            raise FrameError("no reply")
        header, bufs = reply
        entries, i, out = header.get("entries"), 0, {}
        if not isinstance(entries, list) or len(entries) > len(vf.SLOTS):
            raise FrameError("a check's reply lists at most 4 messages")
        for e in entries:
            n = e.get("n") if isinstance(e, dict) else None
            if not isinstance(n, int) or not 0 <= n <= 16 or e.get("slot") not in vf.SLOTS or not isinstance(e.get("header"), dict):
                raise FrameError("bad entry in a check's reply")
            out[vf.OTHER_END[e["slot"]]] = (e["header"], bufs[i:i + n])
            i += n
        return out

    async def _check_one(self, step: int, st, whom: str, mb: int) -> None:
        """Fetches the micro-batch's messages from both ends, recomputes it, then holds both against
        ``whom``'s signed manifest: what it sent, further than the tolerance from the recomputation,
        convicts it."""
        k, n = st.k, len(st.assignments)
        name = self.smap.name_of(whom)
        ends = [st.assignments[j][mb] for j in (k - 1, k + 1) if 0 <= j < n]
        fetched = await asyncio.gather(*(self._fetch(at, step, mb, whom) for at in ends))
        msgs = {slot: (at, h, bufs) for at, got in zip(ends, fetched) for slot, (h, bufs) in got.items()}
        shapes = st.shapes
        ins = [("recv/act", ACT, st.assignments[k - 1][mb], shapes[st.first])] if k > 0 else []
        ins += [("recv/grad", GRAD, st.assignments[k + 1][mb], shapes[st.last])] if k < n - 1 else []
        outs = [("send/act", ACT, whom, shapes[st.last])] if k < n - 1 else []
        outs += [("send/grad", GRAD, whom, shapes[st.first])] if k > 0 else []
        t = {}
        for slot, kind, src, shape in ins + outs:
            if slot not in msgs:
                raise FrameError(f"no {slot} of micro-batch {mb} was kept")
            _at, h, bufs = msgs[slot]
            if "comp" in h:
                raise FrameError("compressed messages are not recomputed")
            expect = Expect(kind, self.job.job_id, self.smap.epoch, frozenset([src]), tuple(shape),
                            len(st.assignments[k]), dtype=st.wire)
            t[slot] = decode_tensor(h, [memoryview(b) for b in bufs], expect, (step, step))[2]
        mine = await st.executor.recompute(step, mb, t.get("recv/act"), t.get("recv/grad"))
        got_manifest = await self._manifest_of(whom, step)
        if got_manifest is None:
            raise FrameError(f"no manifest of step {step} came")
        signed, mbs = got_manifest
        said = mbs.get(mb, {})
        for slot, (at, h, bufs) in msgs.items():
            if vf.digest(h, bufs) != said.get(slot):  # the neighbour, or the peer, lies: shown, the neighbour knows
                await self._fetch(at, step, mb, whom, [signed["body"], signed["key"], signed["sig"]])
                raise FrameError(f"{self.smap.name_of(at)}'s {slot} of micro-batch {mb} is not what {name} signed")
        self.checks += 1
        for slot, _kind, _src, _shape in outs:
            err = vf.relative_error(t[slot], mine[slot])
            if not math.isfinite(err) or err > self.tolerance:
                return self._convict(whom, step, f"its {slot[5:]} of micro-batch {mb} at step {step} is {err:.3g} "
                                                 f"(relative) from this peer's recomputation (tolerance {self.tolerance:g})")
            self.max_error = max(self.max_error, err)

    def _convict(self, whom: str, step: int, why: str) -> None:
        self.failed[whom] = self.failed.get(whom, 0) + 1
        self.defence.convict_verified(whom, step, why)

    def status(self) -> dict:
        return {"p": self.p, "checks": self.checks, "failed": {self.peer.name_of(p): n for p, n in self.failed.items()},
                "skipped": dict(self.skipped), "max_relative_error": float(f"{self.max_error:.3g}"),
                "tolerance": self.tolerance}
