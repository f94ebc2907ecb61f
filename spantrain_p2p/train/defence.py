"""A replica's defence against the other replicas of its stage: it judges each step's clip reports
(``robust.verdicts``) and, when one replica is convicted, publishes its accusation in the DHT
(``measure`` kind ``accuse``, signed, under its own peer id). The planner evicts a peer that more
than half of the other replicas of its stage accuse (``evictions``): a lone liar evicts nobody.

Pure bookkeeping and one DHT write per conviction; the evicted peer is refused by every peer that
adopts the stage map listing it (``Peer.evicted``)."""
from __future__ import annotations

import logging
from typing import Callable, Mapping, Optional, Sequence

from ..robust.aggregate import ClipReport
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
        self.island_verdicts = Verdicts(window=3, convict_of=2, opposed_of=3)
        self.previous: dict = {}  # the --byzantine harness's honest parts of the step before (``stale``)
        self.seen: dict = {}  # digests of the other replicas' parts of the step before (``GradientSum``)
        self.replays: dict[str, int] = {}  # peer -> steps it sent a part of the step before again
        self.job_id = ""
        self.name_of: Callable[[str], str] = lambda p: p[:12]

    def weights(self, weights: Optional[dict]) -> Optional[dict]:
        """A stage's robust-sum weights with the peers this replica convicted at 0: every honest
        replica convicts at the same step from the same parts, so all leave them out alike."""
        if weights is None or not self.verdicts.convicted:
            return weights
        return {p: (0.0 if p in self.verdicts.convicted else w) for p, w in weights.items()}

    def judge(self, step: int, reports: list[ClipReport], replayed: Sequence[str] = ()) -> None:
        new = []
        for p in replayed:  # a part sent again bit for bit: a replay, convicted at the second
            self.replays[p] = self.replays.get(p, 0) + 1
            if self.replays[p] >= REPLAYS and p not in self.verdicts.convicted:
                self.verdicts.convicted[p] = step
                new.append(p)
        judged = [r for r in reports if r.radius > 0 or r.clipped]
        if judged:
            new += self.verdicts.add(step, merge(judged))
        self._convict(step, new)

    def judge_islands(self, round_: int, report: ClipReport, island_peers: Callable[[int], list[str]]) -> None:
        """One round's merge, judged by island (``report`` keyed by island index): a convicted
        island's peers are accused, every one of them (they sent what it forged)."""
        new = self.island_verdicts.add(round_, report)
        peers = [p for i in new for p in island_peers(int(i))]
        if peers:
            self.verdicts.convicted.update({p: round_ for p in peers})
            self._convict(round_, peers, "round")

    def _convict(self, step: int, new: list[str], what: str = "step") -> None:
        for peer_id in new:
            log.warning("%s %d: convicting %s: what it sent lay far outside the others' (up to %.0f x the clip "
                        "radius) or pointed away from them; accusing it", what, step, self.name_of(peer_id),
                        self.verdicts.max_ratio.get(peer_id, 0.0))
            self.events({"kind": "accused", "peer": self.name_of(peer_id), "step": step})
            self.peer.spawn(self._accuse(), "accuse")

    async def _accuse(self) -> None:
        try:
            await measure.publish(self.peer, ACCUSE, {"job": self.job_id, "peers": sorted(self.verdicts.convicted)})
        except Exception as e:
            log.warning("publishing an accusation failed: %s", e)

    def status(self) -> dict:
        out = self.verdicts.summary()
        out["replays"] = dict(self.replays)
        if self.island_verdicts.history:
            out["islands"] = self.island_verdicts.summary()
        return out


def evictions(accusations: Mapping[str, tuple[str, list[str]]], stages: list[tuple[str, ...]], job_id: str,
              islands: Sequence[Sequence[str]] = ()) -> dict[str, int]:
    """{peer: how many accused it} for each peer that more than half of the *other* replicas of its
    stage accuse (``accusations``: accuser -> (job id, accused peers)); only accusations of this job
    by a replica of the accused's own stage count. With ``islands`` (each island's peers), a peer is
    judged by the peers of the other islands instead: more than half of them must accuse it (with
    fewer than 3 islands, nobody is judged)."""
    if islands:  # two islands (or replicas) cannot tell which one lies
        judges = {x: [a for other in islands if other is not isl for a in other]
                  for isl in islands for x in isl} if len(islands) >= 3 else {}
    else:
        judges = {x: [a for a in peers if a != x] for peers in stages if len(peers) >= 3 for x in peers}
    out = {}
    for x, by_whom in judges.items():
        by = [a for a in by_whom if (acc := accusations.get(a, ("", [])))[0] == job_id and x in acc[1]]
        if 2 * len(by) > len(by_whom):
            out[x] = len(by)
    return out


def parse_accusation(d: dict) -> tuple[str, list[str]]:
    job, peers = d.get("job"), d.get("peers")
    if not isinstance(job, str) or not isinstance(peers, list) or len(peers) > 64 or not all(
            isinstance(p, str) and len(p) <= 128 for p in peers):
        raise ValueError("an accusation is {job, peers: [peer id, ...]}")
    return job, peers


async def read_accusations(peer, log_bad) -> dict:
    return await measure.read(peer, ACCUSE, parse_accusation, log_bad)
