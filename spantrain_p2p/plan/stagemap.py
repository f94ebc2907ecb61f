"""The stage map: which peers run which layers, in which pipeline order, under which epoch.

The map the peers follow: a plan (``train.planning.to_stage_map``) or, where no plan is made
(the ``even`` plan kind, no measurements, a model without a FLOP model), ``placeholder_map``, the
rule every peer computes the same way (layers split evenly over the ready peers in peer-id order). Its stages are
``plan.types.Stage``; ``to_dict`` / ``from_dict`` are its wire form (validated on receipt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..pipeline.schedule import SCHEDULE_NAMES
from .types import Stage, compression_ratio

MAX_STAGES = 4096


@dataclass(frozen=True)
class StageMap:
    epoch: int
    job_id: str
    stages: tuple[Stage, ...]
    start_step: int = 0
    names: tuple[tuple[str, str], ...] = ()  # (peer id, human name) for display
    schedule: str = ""  # "" = the job's
    term: int = 0  # the planner's election term that published it
    predicted_step_s: float = 0.0  # the planner's cost-model prediction (0: none)
    bottleneck: str = ""
    error: str = ""  # set by a planner that cannot continue the run: peers stop with this message
    compression: tuple[str, ...] = ()  # the plan's codec per hop (what its prediction assumed; () = none)
    reason: str = ""  # why the planner published it (first plan, a peer gone, a predicted gain), for people

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of(self, peer_id: str) -> Optional[int]:
        for i, s in enumerate(self.stages):
            if peer_id in s.peers:
                return i
        return None

    def name_of(self, peer_id: str) -> str:
        return dict(self.names).get(peer_id) or peer_id[:12]

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "job_id": self.job_id, "start_step": self.start_step,
                "stages": [{"peers": list(s.peers), "layers": list(s.layers), "shares": list(s.shares)}
                           for s in self.stages],
                "names": [list(x) for x in self.names], "schedule": self.schedule, "term": self.term,
                "predicted_step_s": self.predicted_step_s, "bottleneck": self.bottleneck, "error": self.error,
                "compression": list(self.compression), "reason": self.reason}

    def summary(self) -> dict:
        """The contract form of the run summary: peers by name, layer ranges."""
        return {"epoch": self.epoch, "term": self.term, "schedule": self.schedule,
                "predicted_step_s": self.predicted_step_s, "bottleneck": self.bottleneck,
                "compression": list(self.compression), "reason": self.reason,
                "stages": [{"peers": [self.name_of(p) for p in s.peers], "layers": list(s.layers),
                            "microbatch_share": {self.name_of(p): round(v, 4) for p, v in s.share_of().items()}}
                           for s in self.stages]}

    @classmethod
    def from_dict(cls, d: Any, num_layers: int) -> "StageMap":
        """Validates an untrusted stage map against the job's layer count."""
        if not isinstance(d, dict):
            raise ValueError("stage map must be a map")
        epoch, job_id, start = d.get("epoch"), d.get("job_id"), d.get("start_step", 0)
        if not (isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**62):
            raise ValueError("stage map epoch must be a non-negative int")
        if not isinstance(job_id, str) or len(job_id) > 128:
            raise ValueError("stage map job_id must be a short string")
        if not (isinstance(start, int) and not isinstance(start, bool) and 0 <= start < 2**62):
            raise ValueError("stage map start_step must be a non-negative int")
        raw = d.get("stages")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_STAGES:
            raise ValueError("stage map needs 1 to 4096 stages")
        stages, expect, seen = [], 0, set()
        for i, s in enumerate(raw):
            if not isinstance(s, dict):
                raise ValueError(f"stage {i} must be a map")
            peers, layers = s.get("peers"), s.get("layers")
            if not isinstance(peers, list) or not peers or not all(isinstance(p, str) and len(p) <= 128 for p in peers):
                raise ValueError(f"stage {i} needs a non-empty list of peer ids")
            if seen & set(peers) or len(set(peers)) != len(peers):
                raise ValueError(f"stage {i}: a peer appears in two places")
            seen |= set(peers)
            if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(x, int) for x in layers)):
                raise ValueError(f"stage {i} layers must be [first, last_exclusive]")
            if layers[0] != expect or layers[1] <= layers[0]:
                raise ValueError(f"stage {i} layers {layers} do not continue from layer {expect}")
            expect = layers[1]
            shares = s.get("shares", [])
            if not isinstance(shares, list) or (shares and len(shares) != len(peers)) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e9 for x in shares
            ) or (shares and sum(shares) <= 0):
                raise ValueError(f"stage {i} shares must be one non-negative number per peer, not all zero")
            stages.append(Stage(tuple(peers), (layers[0], layers[1]), tuple(float(x) for x in shares)))
        if expect != num_layers:
            raise ValueError(f"stage map covers layers [0, {expect}) of a {num_layers}-layer model")
        names = d.get("names", [])
        if not isinstance(names, list) or len(names) > MAX_STAGES * 8 or not all(
            isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) and len(y) <= 128 for y in x) for x in names
        ):
            raise ValueError("stage map names must be [peer id, name] pairs")
        schedule, term = d.get("schedule", ""), d.get("term", 0)
        pred, bottleneck = d.get("predicted_step_s", 0.0), d.get("bottleneck", "")
        if schedule not in ("", *SCHEDULE_NAMES):
            raise ValueError(f"stage map schedule {schedule!r} is unknown")
        if not (isinstance(term, int) and not isinstance(term, bool) and 0 <= term < 2**62):
            raise ValueError("stage map term must be a non-negative int")
        if isinstance(pred, bool) or not isinstance(pred, (int, float)) or not 0 <= pred < 1e9 or pred != pred:
            raise ValueError("stage map predicted_step_s must be a non-negative number")
        if not isinstance(bottleneck, str) or len(bottleneck) > 200:
            raise ValueError("stage map bottleneck must be a short string")
        error = d.get("error", "")
        if not isinstance(error, str) or len(error) > 1000:
            raise ValueError("stage map error must be a short string")
        reason = d.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 300:
            raise ValueError("stage map reason must be a short string")
        comp = d.get("compression", [])
        if not isinstance(comp, list) or len(comp) not in (0, len(stages) - 1) or \
                not all(isinstance(c, str) and len(c) <= 32 for c in comp):
            raise ValueError("stage map compression must be one codec name per hop")
        try:
            for c in comp:
                compression_ratio(c)
        except (ValueError, KeyError):
            raise ValueError(f"stage map compression {comp[:3]!r}: unknown codec") from None
        return cls(epoch, job_id, tuple(stages), start, tuple((a, b) for a, b in names), schedule, term,
                   float(pred), bottleneck, error, tuple(comp), reason)


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as equal as possible, the larger ones first."""
    if not 0 < num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, first = [], 0
    for i in range(num_stages):
        n = base + (1 if i < extra else 0)
        out.append((first, first + n))
        first += n
    return out


def placeholder_map(peer_ids: list[str], num_layers: int, job_id: str, epoch: int = 1,
                    names: dict[str, str] | None = None, start_step: int = 0, num_stages: int = 0) -> StageMap:
    """Layers split evenly over the peers in peer-id order.

    ``num_stages`` 0: one peer per stage (at most one stage per layer; extra peers stand by).
    Otherwise the peers are dealt into that many stages in order, the first stages getting one
    more peer when they do not divide evenly: the peers of a stage are data-parallel replicas.
    """
    peers = sorted(peer_ids)
    names = names or {}
    if num_stages <= 0:
        peers = peers[:num_layers]
        groups = [(p,) for p in peers]
    else:
        n = min(num_stages, num_layers, len(peers))
        base, extra = divmod(len(peers), n)
        groups, i = [], 0
        for k in range(n):
            size = base + (1 if k < extra else 0)
            groups.append(tuple(peers[i:i + size]))
            i += size
    ranges = even_split(num_layers, len(groups))
    return StageMap(epoch, job_id, tuple(Stage(g, r) for g, r in zip(groups, ranges)), start_step,
                    tuple((p, names.get(p, "")) for g in groups for p in g))
