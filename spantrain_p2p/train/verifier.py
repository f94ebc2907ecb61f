"""Verified computation on the wire (``robust.verify`` has the pure parts and the protocol).

Each peer of a job with the defences on keeps its pipeline messages of the last few steps
(``ledger``, fed by the transport). A replica runs checks of the other replicas of its stage
beside each step (``begin_checks``, ``end_checks``): for each chosen micro-batch of another replica
it fetches the messages from the neighbours at both ends of it (``vfetch``: they answer a replica
of that peer's stage only, once the messages are there), recomputes the micro-batch on its compute
thread (the same layers, weights and inputs: before its optimizer step), then asks the peer to
sign the digests of what it received and sent for that micro-batch (``vattest``). If they are the
fetched messages' and the recomputation is further than the tolerance from what the peer sent,
the peer is convicted (``Defence``: judged by the stage's other replicas, whom the checker tells
to check it at every step from then on). If they are not, the neighbour whose messages differ is
shown the signed digests: it accuses the peer if the peer signed a lie about their messages (as a
tensor the gate refuses), and nobody is convicted by the checker (the neighbour may be the liar).
A peer that does not attest in 3 checks in a row is convicted. One signature per check, none per
step: a step's work is the digests of its messages (SHA-256 of each, at both ends).
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
from typing import Optional

from ..net.dataplane import RemoteError
from ..net.framing import FrameError
from ..pipeline.executor import _Mb
from ..pipeline.messages import ACT, GRAD, Expect, decode_tensor
from ..robust import verify as vf
from ..swarm.records import BadRecord, open_payload, sign_payload

log = logging.getLogger("spantrain.train")

ATTEST_KIND, FETCH_KIND, SUSPECT_KIND = "vattest", "vfetch", "vsuspect"
NAMED_STEPS = 20  # a peer named a suspect is checked every step for this many steps
MAX_SUSPECTS = 2  # suspects checked in one step (a liar naming everyone costs a bounded share)
FETCH_WAIT_S = 30.0  # how long a neighbour holds a check's fetch for messages not kept yet
ATTEST_WAIT_S = 5.0  # how long a check waits for the checked peer's signed digests
WITHHELD = 3  # checks in a row a peer did not attest: it withholds them (convicted)
MAX_ATTEST_BYTES = 4096


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
        self.named: dict[str, int] = {}  # suspects named by a checker or a gate -> the step
        self.targeted: dict[tuple[str, int], int] = {}  # (suspect, step) -> the micro-batch a gate found odd
        self.checks = 0
        self.skipped: dict[str, int] = {}  # why checks were not made
        self.failed: dict[str, int] = {}  # peer -> checks it failed
        self.max_error = 0.0  # the largest relative error a passed check had (the float noise seen)
        self.missing: dict[str, int] = {}  # peer -> checks in a row it did not attest
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

    def _ours(self, header: dict, smap) -> bool:
        """A request of this job and this peer's current epoch (while it verifies)."""
        return self.on and smap is not None and header.get("job") == self.job.job_id and header.get("epoch") == smap.epoch

    # ---- attestations -------------------------------------------------------------------------------------
    async def on_attest(self, header: dict, buffers):
        """A replica of this peer's stage checks one of its micro-batches: the digests of what this
        peer received and sent for it, signed."""
        src, smap = header["src"], self.smap
        step, mb = header.get("step"), header.get("mb")
        if not self._ours(header, smap):
            raise FrameError("no attestation for that job or epoch")
        if not isinstance(step, int) or not isinstance(mb, int):
            raise FrameError("an attestation is asked for {step, mb}")
        k = smap.stage_of(self.peer.peer_id)
        if k is None or src == self.peer.peer_id or smap.stage_of(src) != k:
            raise FrameError("only a replica of this peer's stage may ask")
        # what it attests must all be here: a checker may ask before a gradient sent to this peer
        # has arrived (its sender keeps it once sent)
        want = 2 * ((k > 0) + (k < smap.num_stages - 1))
        loop = asyncio.get_running_loop()
        end = loop.time() + ATTEST_WAIT_S - 1.0
        while len(self.ledger.mine(step).get(mb, {})) < want and loop.time() < end and self.smap is smap:
            try:
                await asyncio.wait_for(self._changed.wait(), end - loop.time())
            except TimeoutError:
                break
        signed = sign_payload(vf.attestation(self.job.job_id, smap.epoch, step, mb, self.ledger.mine(step).get(mb, {})),
                              self.peer.identity, MAX_ATTEST_BYTES)
        return {}, [signed["body"], signed["key"], signed["sig"]]

    async def _attested(self, whom: str, step: int, mb: int) -> Optional[tuple[list, dict]]:
        """(the signed value's 3 buffers, slot -> digest) that ``whom`` signed for (step, mb); None if
        it did not answer in time (``WITHHELD`` such checks in a row convict it)."""
        try:
            reply = await self.peer.client.send(
                self.peer.data_url_of(whom), ATTEST_KIND, {"job": self.job.job_id, "epoch": self.smap.epoch,
                                                           "step": step, "mb": mb},
                timeout=min(ATTEST_WAIT_S, self.transport.timeout_s()), link=self.peer.link_to(whom), peer_id=whom)
            bufs = reply[1] if reply is not None else []
            signed, signer, (job, epoch, a_step, a_mb, slots) = self._open(bufs)
            if signer != whom or job != self.job.job_id or epoch != self.smap.epoch or (a_step, a_mb) != (step, mb):
                raise FrameError("an attestation of another peer, job, epoch or micro-batch")
        except (OSError, asyncio.TimeoutError, FrameError, RemoteError) as e:
            self._not_attested(whom, step, f"it did not attest ({e})")
            return None
        return [signed["body"], signed["key"], signed["sig"]], slots

    def _not_attested(self, whom: str, step: int, why: str) -> None:
        """A check that got no attestation from ``whom``, or one its neighbours' messages contradict:
        ``WITHHELD`` in a row convict it (an honest peer attests what crossed the wire)."""
        self.missing[whom] = self.missing.get(whom, 0) + 1
        if self.missing[whom] >= WITHHELD:
            self._convict(whom, step, f"{WITHHELD} checks in a row without a true attestation: {why}")

    @staticmethod
    def _open(buffers) -> tuple[dict, str, tuple]:
        """(signed value, signer, parsed attestation) of its 3 buffers; FrameError saying why not."""
        if len(buffers) != 3 or sum(b.nbytes for b in buffers) > MAX_ATTEST_BYTES + 4096:
            raise FrameError("an attestation is 3 buffers (body, key, signature)")
        signed = {"body": bytes(buffers[0]), "key": bytes(buffers[1]), "sig": bytes(buffers[2])}
        try:
            signer, payload = open_payload(signed, MAX_ATTEST_BYTES)
            return signed, signer, vf.parse_attestation(payload)
        except (BadRecord, ValueError) as e:
            raise FrameError(f"bad attestation: {e}") from None

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
        if not self._ours(header, smap):
            raise FrameError("no suspect is taken for that job or epoch")
        if not isinstance(step, int) or not isinstance(mb, int) or not isinstance(whom, str) or whom == me \
                or smap.stage_of(whom) is None or smap.stage_of(whom) != smap.stage_of(me) or smap.stage_of(header["src"]) is None:
            raise FrameError("a suspect is another replica of this peer's stage, named by a peer of the map")
        self.named[whom] = max(step, self.named.get(whom, step))
        if mb >= 0:  # a gate's: that very micro-batch (a checker's conviction names none)
            self.targeted[(whom, step)] = mb
        if len(self.targeted) > 256:
            self.targeted.pop(next(iter(self.targeted)))
        return None

    # ---- a replica's checks -------------------------------------------------------------------------------
    async def on_fetch(self, header: dict, buffers):
        """A replica of ``peer``'s stage asks for the messages this peer exchanged with ``peer`` in
        (step, mb): answered once both are here (a check starts with its step), or when the wait
        ends. Shown what ``peer`` signed for them (a checker whose fetched messages did not match
        it): where it says other than what crossed the wire, ``peer`` is accused."""
        src, smap = header["src"], self.smap
        step, mb, whom = header.get("step"), header.get("mb"), header.get("peer")
        if not self._ours(header, smap):
            raise FrameError("no check is served for that job or epoch")
        if not isinstance(step, int) or not isinstance(mb, int) or not isinstance(whom, str):
            raise FrameError("a check asks for {step, mb, peer}")
        k = smap.stage_of(whom)
        if k is None or whom == src or smap.stage_of(src) != k:
            raise FrameError("only a replica of that peer's stage may check it")
        if buffers:
            _signed, signer, (job, epoch, a_step, a_mb, slots) = self._open(buffers)
            if signer != whom or job != self.job.job_id or epoch != smap.epoch or (a_step, a_mb) != (step, mb):
                raise FrameError("the attestation shown is not that peer's of this job, epoch and micro-batch")
            wrong = vf.disagreements({mb: slots}, self.ledger.mine(step),
                                     {mb: self.ledger.exchanged(step, whom).get(mb, [])})
            if wrong:
                self.defence.accuse_neighbour(whom, step, f"it signed for step {step} other than what it "
                                                          f"exchanged with this peer ({wrong[0]})")
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

    @staticmethod
    async def drop_checks(started: Optional[asyncio.Task]) -> None:
        """A step that failed: its checks are cancelled (and awaited, so none writes a verdict later)."""
        if started is not None:
            started.cancel()
            await asyncio.gather(started, return_exceptions=True)

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

    async def _fetch(self, at: str, step: int, mb: int, whom: str, shown: list = ()) -> dict:
        """slot (as ``whom`` names it) -> (header, buffers) of the messages ``at`` exchanged with
        ``whom`` in (step, mb); ``shown``: what ``whom`` signed for them, shown to ``at``."""
        reply = await self.peer.client.send(
            self.peer.data_url_of(at), FETCH_KIND,
            {"job": self.job.job_id, "epoch": self.smap.epoch, "step": step, "mb": mb, "peer": whom}, shown,
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
        """Fetches the micro-batch's messages from both ends, recomputes it, then holds them against
        what ``whom`` signs for them: what it sent, further than the tolerance from the
        recomputation, convicts it."""
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
        attested = await self._attested(whom, step, mb)
        if attested is None:
            raise FrameError(f"{name} did not attest micro-batch {mb} of step {step}")
        shown, said = attested
        for slot, (at, h, bufs) in msgs.items():
            if vf.digest(h, bufs) != said.get(slot):  # the neighbour, or the peer, lies: shown, the neighbour knows
                await self._fetch(at, step, mb, whom, shown)
                self._not_attested(whom, step, "what it attested did not match what its neighbours kept")
                raise FrameError(f"{self.smap.name_of(at)}'s {slot} of micro-batch {mb} is not what {name} signed")
        gate = self.defence.gate
        if gate is not None and any(gate.beyond(kind, src, t[slot]) for slot, kind, src, _shape in ins):
            # an input past the gate's limit, that the checked peer signed it received: it refused it
            # (no step) or took it scaled (``Gate.pardoned``), and the sender is judged for it; the
            # work on it is not recomputed from it as sent (an honest receiver of a pardoned tensor
            # was convicted so). Checked after the attestation: a neighbour that answers the fetch
            # with a tensor it never sent is caught by the digests, not let off
            self.skipped["odd input"] = self.skipped.get("odd input", 0) + 1
            return
        mine = await st.executor.recompute(step, mb, t.get("recv/act"), t.get("recv/grad"))
        self.checks += 1
        self.missing.pop(whom, None)
        for slot, _kind, _src, _shape in outs:
            err = vf.relative_error(t[slot], mine[slot])
            if not math.isfinite(err) or err > self.tolerance:
                return self._convict(whom, step, f"its {slot[5:]} of micro-batch {mb} at step {step} is {err:.3g} "
                                                 f"(relative) from this peer's recomputation (tolerance {self.tolerance:g})")
            self.max_error = max(self.max_error, err)

    def _convict(self, whom: str, step: int, why: str) -> None:
        self.failed[whom] = self.failed.get(whom, 0) + 1
        first = whom not in self.defence.verified
        self.defence.convict_verified(whom, step, why)
        if first:  # the stage's other replicas check it at every step from now on
            self.name_suspect(whom, step, -1)

    def status(self) -> dict:
        return {"p": self.p, "checks": self.checks, "failed": {self.peer.name_of(p): n for p, n in self.failed.items()},
                "skipped": dict(self.skipped), "max_relative_error": float(f"{self.max_error:.3g}"),
                "tolerance": self.tolerance}
