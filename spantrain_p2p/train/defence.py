"""A peer's defence against the other members of its job, in two parts:

- against the other replicas of its stage: it judges each step's clip reports (``robust.verdicts``)
  and convicts a replica that keeps lying; the planner evicts a peer that more than half of the
  other replicas of its stage accuse (``evictions``): a lone liar evicts nobody;
- against its neighbours in the pipeline: every activation and activation gradient it receives
  passes the statistical gate (``robust.gate``) before it is computed with; a refused tensor fails
  the step (nothing computed from it is kept) and its sender is accused; the planner evicts a
  peer that more than half of the peers receiving its tensors accuse (``gate_evictions``).
Accusations go in the DHT (``measure`` kind ``accuse``, signed, under the accuser's own peer id).

Pure bookkeeping and one DHT write per conviction; the evicted peer is refused by every peer that
adopts the stage map listing it (``Peer.evicted``)."""
from __future__ import annotations

import logging
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import torch

from ..pipeline.executor import StepFailed
from ..robust import attacks
from ..robust.aggregate import ClipReport
from ..robust.gate import Gate
from ..robust.verdicts import Verdicts, merge
from ..swarm import measure
from ..swarm.keys import ACCUSE

log = logging.getLogger("spantrain.train")

REPLAYS = 2  # steps a replica may send its part of the step before again (a stale, replayed gradient)


class Defence:
    def __init__(self, peer, events: Callable[[dict], None]):
        self.peer, self.events = peer, events
        self.verdicts = Verdicts()
        # islands: by island index, one judgment per round (a round is many steps of evidence)
        # (an honest island's pseudo-gradient lay within 0.55 radii at cosine >= 0.49 in every round of
        # 1,000 clean steps, fp32 and bf16; far or against once is a round's worth of steps, and convicts)
        self.island_verdicts = Verdicts(window=3, convict_of=1, opposed_of=3, against_of=1)
        self.previous: dict = {}  # the --byzantine harness's honest parts of the step before (``stale``)
        self.seen: dict = {}  # digests of the other replicas' parts of the step before (``GradientSum``)
        self.replays: dict[str, int] = {}  # peer -> steps it sent a part of the step before again
        self.job_id = ""
        self.name_of: Callable[[str], str] = lambda p: p[:12]
        self.gate: Optional[Gate] = None  # the boundary gate (``start``: on with the defences)
        self.gate_accused: dict[str, int] = {}  # neighbour -> the step its tensor was refused at
        self.verified: dict[str, int] = {}  # replica -> the step a recomputation of its work failed at
        self.on_suspect: Callable[[str, int, int], None] = lambda peer, step, mb: None  # (the verifier's)

    def start(self, job) -> None:
        """The job's defences: on with the robust sum (``--aggregate robust``, the default), off with
        ``--aggregate sum`` (an undefended run, the harness's reference)."""
        self.job_id = job.job_id
        if job.aggregate == "robust" and self.gate is None:
            self.gate = Gate(zeros_ok=job.precision == "fp16")  # fp16 sends an overflowed tensor as zeros

    def adopt(self, smap) -> None:
        """A new stage map: its job and names, and its evicted peers refused from now on and gone
        from the gate's references (an evicted attacker's tensors, pardoned, had set "the others'
        level" at its boundary: the honest senders there were refused next and evicted too)."""
        self.peer.evicted.update(smap.evicted)
        self.job_id, self.name_of = smap.job_id, smap.name_of
        if self.gate is not None:
            self.gate.forget(smap.evicted)

    async def check_boundary(self, kind: str, src: str, step: int, mb: int, t):
        """The gate on a received ``kind`` tensor of ``src``: a refused one fails the step, once
        its sender's accusation is in the DHT (the planner reads it before it re-plans). Returns
        the tensor to compute with in its place (one pardoned, scaled), or None: ``t`` as it is."""
        if self.gate is None:
            return None
        verdict = self.gate.judge(kind, src, t, step, mb)
        if verdict is None:
            return None
        what, why = verdict
        if what == "pardon":  # the swarm kept its sender through the re-plans: taken, at the limit
            log.warning("step %d: micro-batch %d's %s from %s: %s", step, mb, kind, self.name_of(src), why)
            self.events({"kind": "pardoned", "peer": self.name_of(src), "step": step, "why": why[:200]})
            self.on_suspect(src, step, mb)
            return t * self.gate.pardoned[(kind, step, mb)]
        if what == "suspect":  # taken; its replicas recompute it
            log.info("step %d: micro-batch %d's %s from %s is odd (%s): naming it to its replicas' checks", step, mb,
                     kind, self.name_of(src), why)
            self.on_suspect(src, step, mb)
            return None
        first = src not in self.gate_accused
        self.gate_accused.setdefault(src, step)
        log.warning("step %d: refusing micro-batch %d's %s from %s: %s; accusing it", step, mb, kind,
                    self.name_of(src), why)
        if first:
            self.events({"kind": "accused", "peer": self.name_of(src), "step": step, "why": why[:200]})
        await self._accuse()
        raise StepFailed(f"{kind} of micro-batch {mb} from {self.name_of(src)} refused by the gate: {why}")

    def accuse_neighbour(self, src: str, step: int, why: str) -> None:
        """A neighbour caught by what it sent this peer (a signed manifest that says otherwise):
        judged like a refused tensor, by the peers receiving its tensors."""
        if src in self.gate_accused:
            return
        self.gate_accused[src] = step
        log.warning("step %d: accusing %s: %s", step, self.name_of(src), why)
        self.events({"kind": "accused", "peer": self.name_of(src), "step": step, "why": why[:200]})
        self.peer.spawn(self._accuse(), "accuse")

    def convict_verified(self, whom: str, step: int, why: str) -> None:
        """A replica whose micro-batch this peer recomputed and found forged: convicted like one the
        robust sum's verdicts convict (judged by the stage's other replicas, who check it from now on:
        this peer names it in its manifests)."""
        log.warning("step %d: verification failed: %s: %s", step, self.name_of(whom), why)
        # (not in ``verdicts.convicted``: the other replicas have not seen it, and their sums must
        # equal this one's, so its part stays in until the planner evicts it)
        if whom not in self.verified:
            self.verified[whom] = step
            self._convict(step, [whom], why=why)

    @staticmethod
    def sender(send, attack: str):
        """The executor's send, forging what it sends where the ``--byzantine`` attack is a pipeline one."""
        if attack not in attacks.BOUNDARY:
            return send
        g = torch.Generator().manual_seed(29)

        async def forged(kind, step, mb, t):
            await send(kind, step, mb, attacks.forge_boundary(attack, t, g))
        return forged

    def judge(self, step: int, reports: list[ClipReport], replayed: Sequence[str] = (), excused: set[str] = frozenset()) -> None:
        new = []
        for p in replayed:  # a part sent again bit for bit: a replay, convicted at the second
            self.replays[p] = self.replays.get(p, 0) + 1
            if self.replays[p] >= REPLAYS and p not in self.verdicts.convicted:
                self.verdicts.convicted[p] = step
                new.append(p)
        judged = [r for r in reports if r.radius > 0 or r.clipped]
        if judged:
            new += self.verdicts.add(step, merge(judged), excused)
        self._convict(step, new)

    def judge_islands(self, round_: int, report: ClipReport, island_peers: Callable[[int], list[str]]) -> None:
        """One round's merge, judged by island (``report`` keyed by island index): a convicted
        island's peers are accused, every one of them (they sent what it forged)."""
        new = self.island_verdicts.add(round_, report)
        peers = [p for i in new for p in island_peers(int(i))]
        if peers:
            self.verdicts.convicted.update({p: round_ for p in peers})
            self._convict(round_, peers, "round")

    def _convict(self, step: int, new: list[str], what: str = "step", why: str = "") -> None:
        for peer_id in new:
            if not why:
                log.warning("%s %d: convicting %s: what it sent lay far outside the others' (up to %.0f x the clip "
                            "radius) or pointed away from them; accusing it", what, step, self.name_of(peer_id),
                            self.verdicts.max_ratio.get(peer_id, 0.0))
            self.events({"kind": "accused", "peer": self.name_of(peer_id), "step": step, **({"why": why[:200]} if why else {})})
            self.peer.spawn(self._accuse(), "accuse")

    async def _accuse(self) -> None:
        try:
            await measure.publish(self.peer, ACCUSE, {"job": self.job_id, "peers": sorted({**self.verdicts.convicted, **self.verified}),
                                                      "gate": sorted(self.gate_accused)})
        except Exception as e:
            log.warning("publishing an accusation failed: %s", e)

    def status(self) -> dict:
        out = self.verdicts.summary()
        out["replays"] = dict(self.replays)
        if self.island_verdicts.history:
            out["islands"] = self.island_verdicts.summary()
        if self.gate is not None:
            out["gate"] = {**self.gate.status(), "accused": {self.name_of(p): s for p, s in self.gate_accused.items()}}
        if self.verified:
            out["verified_against"] = {self.name_of(p): s for p, s in self.verified.items()}
        return out


class Accusation(NamedTuple):
    job: str
    peers: list[str]  # convicted by the robust sum's verdicts
    gate: list[str] = []  # refused by the boundary gate


def evictions(accusations: Mapping[str, Accusation], stages: list[tuple[str, ...]], job_id: str,
              islands: Sequence[Sequence[str]] = ()) -> dict[str, int]:
    """{peer: how many accused it} for each peer that more than half of the *other* replicas of its
    stage accuse (``accusations``: accuser -> its accusation); only accusations of this job by a
    replica of the accused's own stage count. With ``islands`` (each island's peers), a peer is
    judged by the peers of the other islands instead: more than half of them must accuse it (with
    fewer than 3 islands, nobody is judged)."""
    if islands:  # two islands (or replicas) cannot tell which one lies
        judges = {x: [a for other in islands if other is not isl for a in other]
                  for isl in islands for x in isl} if len(islands) >= 3 else {}
    else:
        judges = {x: [a for a in peers if a != x] for peers in stages if len(peers) >= 3 for x in peers}
    out = {}
    for x, by_whom in judges.items():
        by = [a for a in by_whom if (acc := accusations.get(a, _NONE)).job == job_id and x in acc.peers]
        if 2 * len(by) > len(by_whom):
            out[x] = len(by)
    return out


_NONE = Accusation("", [], [])


def receivers(assignments: Sequence[Sequence[str]]) -> dict[str, set[str]]:
    """{peer: the peers that receive its tensors}, from one pipeline's micro-batch assignment per
    stage (``StageInfo.assign``): micro-batch m's activation goes from stage k's peer of m to stage
    k+1's, its gradient back to stage k-1's."""
    out: dict[str, set[str]] = {}
    for k, row in enumerate(assignments):
        for m, x in enumerate(row):
            got = out.setdefault(x, set())
            for j in (k - 1, k + 1):
                if 0 <= j < len(assignments) and m < len(assignments[j]) and assignments[j][m] != x:
                    got.add(assignments[j][m])
    return out


def gate_evictions(accusations: Mapping[str, Accusation], receivers_of: Mapping[str, set[str]], job_id: str,
                   spent: set[str] = frozenset()) -> dict[str, list[str]]:
    """{peer: its accusers} for each peer that more than half of the peers receiving its tensors
    accuse of a tensor the gate refused. A lone accuser (the only receiver of a peer's tensors)
    can evict once: ``spent`` names those whose lone accusation already evicted someone (their
    later accusations need a second accuser), so a lying receiver costs the swarm one peer."""
    out, spent = {}, set(spent)
    for x, judges in sorted(receivers_of.items()):
        by = sorted(a for a in judges if (acc := accusations.get(a, _NONE)).job == job_id and x in acc.gate)
        if by and 2 * len(by) > len(judges) and (len(by) >= 2 or by[0] not in spent):
            out[x] = by
            if len(by) == 1:
                spent.add(by[0])
    return out


def parse_accusation(d: dict) -> Accusation:
    job, peers, gate = d.get("job"), d.get("peers"), d.get("gate", [])
    if not isinstance(job, str) or not all(isinstance(x, list) and len(x) <= 64 and all(
            isinstance(p, str) and len(p) <= 128 for p in x) for x in (peers, gate)):
        raise ValueError("an accusation is {job, peers: [peer id, ...], gate: [peer id, ...]}")
    return Accusation(job, peers, gate)


async def read_accusations(peer, log_bad) -> dict:
    return await measure.read(peer, ACCUSE, parse_accusation, log_bad)
