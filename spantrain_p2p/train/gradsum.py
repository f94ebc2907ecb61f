"""The replicas of a stage sum their weight gradients, layer by layer, during the last backward."""
from __future__ import annotations

import asyncio
import hashlib
from typing import Optional

import torch

from ..pipeline.executor import StepFailed
from ..pipeline.hostcopy import HostCopier
from ..pipeline.loss_scale import sanitized
from ..pipeline.messages import GSUM
from ..robust import attacks
from ..robust.gate import SHARED
from ..robust.aggregate import MIN_PEERS, ClipReport, robust_sum

BUCKET_BYTES = 4 << 20


def layer_buckets(layer_numels: list[list[int]], bucket_bytes: int = BUCKET_BYTES,
                  owners: Optional[list[str]] = None) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each layer's parameters, as (layer, [(index among all the layers' parameters, numel), ...])
    buckets of at most ``bucket_bytes`` (a bigger parameter alone): one message each, sent as
    soon as that layer's gradients are final, while the backward goes on below it. With
    ``owners`` (per parameter, a sharded stage's), a bucket holds one owner's parameters only."""
    out: list[tuple[int, list[tuple[int, int]]]] = []
    i = 0
    for layer, numels in enumerate(layer_numels):
        groups: dict[str, list[tuple[int, int]]] = {}
        for n in numels:
            groups.setdefault(owners[i] if owners is not None else "", []).append((i, n))
            i += 1
        for group in groups.values():
            cur: list[tuple[int, int]] = []
            size = 0
            for j, n in group:
                if cur and size + 4 * n > bucket_bytes:
                    out.append((layer, cur))
                    cur, size = [], 0
                cur.append((j, n))
                size += 4 * n
            if cur:
                out.append((layer, cur))
    return out


def _fingerprint(t: torch.Tensor) -> bytes:
    """Cheap and exact enough to tell a part sent again bit for bit: 4096 strided elements and the
    sum (hashing a whole large model's gradient every step would cost more than the step)."""
    flat = t.reshape(-1)
    sample = flat[:: max(1, flat.numel() // 4096)][:4096].contiguous()
    return hashlib.blake2b(sample.view(torch.uint8).numpy().tobytes() + repr(float(flat.sum())).encode(),
                           digest_size=16).digest()


class GradientSum:
    """One step's all-reduce (sum) of a stage's weight gradients among its replicas, bucket by
    bucket: a layer's buckets go to the other replicas as soon as the executor says its gradients
    are final (``layer_done``, during the step's last backward op; ``run_step`` tells every layer
    by its end), so the transfers overlap the backward of the layers below; ``finish`` adds every
    replica's part up in peer-id order (every replica ends with bit-identical gradients) and sets
    them. ``transport`` sends and receives the parts (``send_to``, ``receive``). With
    ``sanitize`` (fp16), a part that overflowed is sent as zeros and sets ``overflowed`` (the wire
    takes no inf; the step is skipped everywhere).

    With ``weights`` (replica -> its micro-batches this step), the parts are added up by
    ``robust.aggregate.robust_sum`` (CenteredClip: a clean step's sum is the plain one, bit for
    bit); ``reports`` then holds each bucket's ``ClipReport``. ``attack`` (the ``--byzantine``
    harness) makes this replica send forged parts instead of its own; ``previous`` keeps its honest
    parts of the step before (the ``stale`` attack).

    With ``owners`` (bucket -> the replica that owns its optimizer state, ``train.shard``), a bucket
    goes to its owner only and only its owner sums it (a reduce-scatter): this replica's gradients of
    the buckets it does not own stay its own (unused; its optimizer does not hold them)."""

    def __init__(self, transport, me: str, step: int, params: list[torch.nn.Parameter],
                 buckets: list[tuple[int, list[tuple[int, int]]]], others: list[str], sanitize: bool = False,
                 weights: Optional[dict[str, float]] = None, attack: str = "",
                 previous: Optional[dict[int, torch.Tensor]] = None, seen: Optional[dict] = None, gate=None,
                 owners: Optional[list[str]] = None):
        if owners is not None and (weights is not None or gate is not None):
            raise ValueError("a sharded stage sums plainly: the robust sum needs every part at every replica")
        self.transport, self.me, self.step, self.params, self.buckets, self.others = \
            transport, me, step, params, buckets, others
        self.sanitize = sanitize
        self.weights, self.attack = weights, attack
        self.previous = previous if previous is not None else {}
        self.reports: list[ClipReport] = []
        # (peer, bucket) -> (step, digest) of the part it sent last: a part sent again bit for bit at
        # another step (a replayed, stale gradient) is reported; honest parts differ every step (other data)
        self.seen = seen if seen is not None else {}
        self.replayed: set[str] = set()
        self._early: dict[int, dict[str, torch.Tensor]] = {}  # parts an omniscient attacker read first
        self.overflowed = False
        self._copier = HostCopier(params[0].device if params else torch.device("cpu"))
        self.local: list[Optional[asyncio.Future]] = [None] * len(buckets)  # each bucket's part, in host memory
        # each bucket's own work, started with its part (``_bucket``): its sum, or its parts for the
        # whole gradient's judgement, done as the parts come in rather than all after the backward
        self.work: dict[int, asyncio.Task] = {}
        self._tail = SHARED if gate is not None and buckets else 0
        self.by_layer: dict[int, list[int]] = {}
        for k, (layer, _) in enumerate(buckets):
            self.by_layer.setdefault(layer, []).append(k)
        self.sends: list[asyncio.Task] = []
        self.gate = gate  # robust.gate.Gate: its boundary medians ride along, for the other replicas' gates
        self.odd_inputs: set[str] = set()  # replicas whose received tensors were odd this step (not judged)
        self.owners = owners
        # the map this sum belongs to: the compute thread may still say a layer is done after the step
        # was abandoned, and a part sent then must not pass for the next map's (its micro-batches differ)
        self.epoch = transport.smap.epoch if getattr(transport, "smap", None) is not None else None
        self.closed = False

    def _start(self, k: int, t: torch.Tensor) -> None:
        """Copies bucket ``k`` to host memory (on a CUDA device, while the backward goes on) and
        sends it to the other replicas."""
        if self.closed:
            return
        host, done = self._copier.start(t)
        if done is None and not (self.attack and k < len(self.buckets)):
            # nothing to wait for (in host memory, not forged): its sends are queued now, ahead of the
            # step's own continuation (queued by the compute thread after this layer's news); as a task's
            # later turn they waited a median 1 ms behind it, the step's last bucket with them (cee-3region)
            part = self._with_medians(k, self._sanitized(host))
            self._send(k, part)
            self.local[k] = asyncio.get_running_loop().create_future()
            self.local[k].set_result(part)
        else:
            async def ready() -> torch.Tensor:
                part = self._sanitized(await self._copier.wait(host, done))
                if self.attack and k < len(self.buckets):
                    part = await self._forge(k, part)
                part = self._with_medians(k, part)
                if self.closed:
                    raise asyncio.CancelledError()
                self._send(k, part)
                return part
            self.local[k] = asyncio.ensure_future(ready())
        self.work[k] = asyncio.ensure_future(self._bucket(k))

    def _sanitized(self, part: torch.Tensor) -> torch.Tensor:
        if self.sanitize:
            part, bad = sanitized(part)
            self.overflowed |= bad
        return part

    def _with_medians(self, k: int, part: torch.Tensor) -> torch.Tensor:
        if self.gate is not None and k == len(self.buckets) - 1:  # the gate's medians ride on the last bucket
            part = torch.cat([part, torch.tensor(self.gate.shared(self.step), dtype=part.dtype)])
        return part

    def _send(self, k: int, part: torch.Tensor) -> None:
        self.sends += [asyncio.create_task(self.transport.send_to(dst, GSUM, self.step, k, part, epoch=self.epoch))
                       for dst in self._receivers(k)]

    def _receivers(self, k: int) -> list[str]:
        """Who sums bucket ``k`` besides this replica: every other one, or its owner (sharded; the
        step's loss, after the buckets, goes to every replica either way)."""
        if self.owners is None or k >= len(self.owners):
            return self.others
        return [self.owners[k]] if self.owners[k] != self.me else []

    def _sums(self, k: int) -> bool:
        return self.owners is None or k >= len(self.owners) or self.owners[k] == self.me

    async def _forge(self, k: int, honest: torch.Tensor) -> torch.Tensor:
        weights = self.weights or {}
        others = {}
        if self.attack in attacks.OMNISCIENT:  # it reads the honest parts first (they come unasked)
            self._early[k] = {src: await self.transport.receive((f"{GSUM}/{src}", self.step, k), GSUM, src)
                              for src in self.others}
            tail = SHARED if self.gate is not None and k == len(self.buckets) - 1 else 0
            others = {src: (t[:t.numel() - tail], float(weights.get(src, 1))) for src, t in self._early[k].items()}
        forged = attacks.forge(self.attack, honest, float(weights.get(self.me, 1)), others, self.previous.get(k))
        self.previous[k] = honest
        return forged

    def layer_done(self, layer: int) -> None:
        for k in self.by_layer.get(layer, ()):
            if self.local[k] is None:
                ps = [self.params[i] for i, _ in self.buckets[k][1]]
                self._start(k, torch.cat([p.grad.detach().reshape(-1) if p.grad is not None
                                          else torch.zeros(p.numel(), device=p.device) for p in ps]))

    def losses_done(self, losses: list[float]) -> None:
        """This replica's losses of the step (the last stage's), as its last forward ends: their sum
        goes to the other replicas then, beside the backward (``finish`` is given the same). Sent
        after the backward, it was the last message a cee-3region replica waited for: 2.7 ms from
        the later replica's send to the other's inbox, the emulated link pricing 0.5."""
        self._start_loss((sum(losses), len(losses)))

    def _start_loss(self, loss: tuple[float, int]) -> None:
        """Starts the loss's part, the bucket after the gradients', once a step."""
        if len(self.local) > len(self.buckets):  # (sent already, with the last forward)
            return
        self.local.append(None)
        self._start(len(self.buckets), torch.tensor([float(loss[0]), float(loss[1])], dtype=torch.float32))

    async def finish(self, loss: Optional[tuple[float, int]] = None) -> Optional[tuple[float, int]]:
        """Sums the step's gradients (and, on the last stage, ``loss``: this replica's (sum, count)
        of micro-batch losses rides along, and the whole step's is returned)."""
        try:
            if loss is not None:
                self._start_loss(loss)
            done = [await self.work[k] for k in range(len(self.local))]
            summed = self._totals(done)
            for (_, bucket), total in zip(self.buckets, summed):
                if total is None:
                    continue
                # views of the bucket's sum (a tensor of its own), each moved to its parameter's
                # device: a copy of each on the host too cost a cee-3region replica 0.45 ms of its
                # step's tail here, the views 0.12
                for (i, _), g in zip(bucket, torch.split(total, [n for _, n in bucket])):
                    p = self.params[i]
                    p.grad = g.view_as(p).to(p.device)
            await asyncio.gather(*self.sends)
        except BaseException as e:
            await self.cancel()
            for p in self.params:
                p.grad = None
            if isinstance(e, asyncio.CancelledError):
                raise
            raise StepFailed(f"step {self.step}: gradient averaging with {len(self.others)} replica(s) failed: {e}") from e
        if loss is not None:
            return float(summed[-1][0]), int(round(float(summed[-1][1])))
        return None

    async def _bucket(self, k: int) -> Optional[tuple[str, object]]:
        """Bucket ``k``'s work, as soon as its parts are here (a task from ``_start``): None where
        another replica sums it (sharded); ("sum", total) added up in peer-id order (zeros where no
        part has a weight above 0); ("each", (total, report)) a robust sum of too few replicas to
        judge, bucket by bucket the same sum; ("whole", parts) for the robust sum of the whole
        gradient at once (``finish``). The gate's medians, on the last bucket, are taken off here;
        another replica's part sent again bit for bit at another step is noted (``replayed``).
        When the backward ends, only the step's last bucket (the first layer's, done last) is left
        to do: the rest was done as the parts came in (all after the backward, they held both
        cee-3region replicas' loops 3.2-3.4 ms, the later one's last send queued behind them)."""
        mine = await self.local[k]
        if not self._sums(k):  # sharded: its owner sums it
            return None
        parts = {self.me: mine}
        early = self._early.pop(k, {})
        for src in self.others:
            parts[src] = early[src] if src in early else \
                await self.transport.receive((f"{GSUM}/{src}", self.step, k), GSUM, src)
        tail = self._tail
        if tail and k == len(self.buckets) - 1:  # the replicas' boundary medians: taken, not summed
            self.odd_inputs = self.gate.take_shared({src: t[-tail:].tolist() for src, t in parts.items()}, self.me)
            parts = {src: t[:-tail] for src, t in parts.items()}
            mine = parts[self.me]
        if self.weights is None or k >= len(self.buckets):
            total = torch.zeros_like(mine)
            for src in sorted(parts):
                total += parts[src]
            return "sum", total
        for src, t in parts.items():
            if src != self.me:
                # (a step redone after a re-plan brings the same parts again: not a replay)
                digest = _fingerprint(t)
                before = self.seen.get((src, k))
                if before is not None and before[1] == digest and before[0] != self.step and bool(t.any()):
                    self.replayed.add(src)
                self.seen[(src, k)] = (self.step, digest)
        keep = [p for p in parts if self.weights.get(p, 1) > 0]
        if not keep:
            return "sum", torch.zeros_like(mine)
        if sum(1 for p in keep if self.weights.get(p, 0) > 0) < MIN_PEERS:
            # too few to judge: robust_sum adds the parts up as they are, so bucket by bucket it is the
            # same sum, bit for bit, without a copy of every replica's whole gradient first (two GPT-2
            # stage replicas: 0.48 s of copying and 0.30 s of summing a step, against 0.14 s)
            return "each", robust_sum({p: parts[p] for p in keep}, self.weights)
        return "whole", parts

    def _totals(self, done: list[Optional[tuple[str, object]]]) -> list[Optional[torch.Tensor]]:
        """Each bucket's sum from its work (``_bucket``), and the step's robust report: the buckets
        judged together are judged on each replica's whole gradient at once (one clip factor per
        replica, and one pass: per bucket, a small model paid 10 % of its step in the fixed cost of
        many small operations). A part of weight 0 is left out."""
        whole = [d[1] for d in done if d is not None and d[0] == "whole"]
        judged = iter(self._robust_whole(whole)) if whole else iter(())
        out, idle, each = [], {}, False
        for d in done:
            if d is None:
                out.append(None)
            elif d[0] == "whole":
                out.append(next(judged))
            elif d[0] == "each":
                total, rep = d[1]
                each = True
                idle.update(rep.ratio)
                out.append(total)
            else:
                out.append(d[1])
        if each and not whole:
            self.reports.append(ClipReport(0.0, idle, tuple(sorted(idle))) if idle else ClipReport(0.0))
        return out

    def _robust_whole(self, buckets: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        keep = [p for p in buckets[0] if self.weights.get(p, 1) > 0]
        whole = {p: torch.cat([b[p].reshape(-1) for b in buckets]) for p in keep}
        total, report = robust_sum(whole, self.weights)
        self.reports.append(report)
        out, offset = [], 0
        for b in buckets:
            n = b[keep[0]].numel()
            out.append(total[offset:offset + n])
            offset += n
        return out

    async def cancel(self) -> None:
        self.closed = True  # a layer the compute thread says is done from now on is not sent
        pending = [f for f in self.local if f is not None] + list(self.work.values()) + self.sends
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in self.sends:  # sends a part started while it was being cancelled
            t.cancel()
        await asyncio.gather(*self.sends, return_exceptions=True)
