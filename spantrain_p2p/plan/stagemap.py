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
from .islands import exchange_ratio
from .types import RECOMPUTE, Stage, compression_ratio

MAX_STAGES = 4096
MAX_ISLANDS = 64
MAX_COPY_EVERY = 10_000


@dataclass(frozen=True)
class Island:
    """One island of a map with islands (``--sync islands``): the next ``stages`` of the map's
    stages form its own pipeline over all layers; it takes ``steps_per_round`` steps a round."""

    stages: int
    steps_per_round: int
    schedule: str = ""
    compression: tuple[str, ...] = ()
    predicted_step_s: float = 0.0

    def to_dict(self) -> dict:
        return {"stages": self.stages, "steps_per_round": self.steps_per_round, "schedule": self.schedule,
                "compression": list(self.compression), "predicted_step_s": self.predicted_step_s}


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
    # with islands: ``stages`` is every island's pipeline one after the other (``island_map``)
    islands: tuple[Island, ...] = ()
    exchange_codec: str = ""  # the islands' pseudo-gradient codec
    sync_reason: str = ""  # why global or islands (--sync auto), for people
    # with islands, ``start_step`` is the round the islands start at (from the outer state of that
    # round, ``islands.exchange``) and this the first data step of that round
    start_data_step: int = 0
    # peers convicted of attacking the job (``robust.verdicts``): refused by every peer from this map on
    evicted: tuple[str, ...] = ()
    # buddy copies of layer states are sent after steps that are multiples of this, and every peer
    # keeps its own snapshots of the last few such steps: where a copy takes longer than a step (a big
    # stage on a slow link), a crash still finds a step every layer was kept at (``decide.copy_every``)
    copy_every: int = 1

    @property
    def head(self) -> tuple[int, int]:
        """(term, epoch): how maps are ordered. Two planners of different terms (each took the other
        for dead) may both publish an epoch of the same number; the higher term's is the newer."""
        return (self.term, self.epoch)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def island_of(self, peer_id: str) -> Optional[int]:
        """The island ``peer_id`` trains in (None: not in the map, or a map without islands)."""
        k = self.stage_of(peer_id)
        if k is None or not self.islands:
            return None
        for i, (first, last) in enumerate(self.island_ranges()):
            if first <= k < last:
                return i
        return None

    def island_ranges(self) -> list[tuple[int, int]]:
        return _ranges(self.islands)

    def island_peers(self) -> list[list[str]]:
        """Each island's peers, sorted (none without islands)."""
        return [sorted({p for st in self.stages[a:b] for p in st.peers}) for a, b in self.island_ranges()]

    def island_map(self, i: int) -> "StageMap":
        """Island ``i``'s own pipeline as a stage map of the same epoch (what its peers run)."""
        first, last = self.island_ranges()[i]
        isl = self.islands[i]
        peers = {p for st in self.stages[first:last] for p in st.peers}
        return StageMap(self.epoch, self.job_id, self.stages[first:last], self.start_step,
                        tuple(x for x in self.names if x[0] in peers), isl.schedule or self.schedule, self.term,
                        isl.predicted_step_s, self.bottleneck, self.error, isl.compression, self.reason,
                        start_data_step=self.start_data_step, copy_every=self.copy_every)

    def members(self) -> list[str]:
        """Every peer of the map, stage by stage (a replicated stage's peers in their order)."""
        return [p for st in self.stages for p in st.peers]

    def stage_of(self, peer_id: str) -> Optional[int]:
        for i, s in enumerate(self.stages):
            if peer_id in s.peers:
                return i
        return None

    def name_of(self, peer_id: str) -> str:
        return dict(self.names).get(peer_id) or peer_id[:12]

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "job_id": self.job_id, "start_step": self.start_step,
                "stages": [{"peers": list(s.peers), "layers": list(s.layers), "shares": list(s.shares),
                            **({"recompute": s.recompute} if s.recompute != "none" else {}),
                            **({"shard": True} if s.shard else {})}
                           for s in self.stages],
                "names": [list(x) for x in self.names], "schedule": self.schedule, "term": self.term,
                "predicted_step_s": self.predicted_step_s, "bottleneck": self.bottleneck, "error": self.error,
                "compression": list(self.compression), "reason": self.reason,
                **({"islands": [x.to_dict() for x in self.islands], "exchange_codec": self.exchange_codec,
                    "start_data_step": self.start_data_step} if self.islands else {}),
                **({"sync_reason": self.sync_reason} if self.sync_reason else {}),
                **({"evicted": list(self.evicted)} if self.evicted else {}),
                **({"copy_every": self.copy_every} if self.copy_every != 1 else {})}

    def summary(self) -> dict:
        """The contract form of the run summary: peers by name, layer ranges."""
        return {"epoch": self.epoch, "term": self.term, "schedule": self.schedule,
                "predicted_step_s": self.predicted_step_s, "bottleneck": self.bottleneck,
                "compression": list(self.compression), "reason": self.reason,
                "stages": [{"peers": [self.name_of(p) for p in s.peers], "layers": list(s.layers),
                            "microbatch_share": {self.name_of(p): round(v, 4) for p, v in s.share_of().items()},
                            "recompute": s.recompute, "shard": s.shard}
                           for s in self.stages],
                **({"islands": [{**x.to_dict(), "peers": sorted(self.name_of(p) for st in self.stages[a:b]
                                                                   for p in st.peers)}
                                for x, (a, b) in zip(self.islands, self.island_ranges())],
                    "exchange_codec": self.exchange_codec} if self.islands else {}),
                **({"sync_reason": self.sync_reason} if self.sync_reason else {}),
                **({"evicted": [self.name_of(p) for p in self.evicted]} if self.evicted else {}),
                **({"copy_every": self.copy_every} if self.copy_every != 1 else {})}

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
        islands = _islands_from(d.get("islands", []), len(raw))
        starts = {a for a, _b in _ranges(islands)}
        stages, expect, seen = [], 0, set()
        for i, s in enumerate(raw):
            if i in starts and i > 0:
                if expect != num_layers:
                    raise ValueError(f"an island's stages cover layers [0, {expect}) of a {num_layers}-layer model")
                expect = 0
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
            recompute = s.get("recompute", "none")
            if recompute not in RECOMPUTE:
                raise ValueError(f"stage {i} recompute must be one of {RECOMPUTE}")
            shard = s.get("shard", False)
            if not isinstance(shard, bool):
                raise ValueError(f"stage {i} shard must be true or false")
            stages.append(Stage(tuple(peers), (layers[0], layers[1]), tuple(float(x) for x in shares), recompute,
                                shard))
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
        comp = _codecs_from(d.get("compression", []), len(stages) - 1, "stage map compression")
        codec, why = d.get("exchange_codec", ""), d.get("sync_reason", "")
        if not isinstance(codec, str) or len(codec) > 32 or bool(codec) != bool(islands):
            raise ValueError("stage map exchange_codec must name a codec where the map has islands, only there")
        if codec:
            exchange_ratio(codec)  # ValueError naming it, if no codec
        if not isinstance(why, str) or len(why) > 300:
            raise ValueError("stage map sync_reason must be a short string")
        sds = d.get("start_data_step", 0)
        if not (isinstance(sds, int) and not isinstance(sds, bool) and 0 <= sds < 2**62):
            raise ValueError("stage map start_data_step must be a non-negative int")
        evicted = d.get("evicted", [])
        if not isinstance(evicted, list) or len(evicted) > MAX_STAGES or not all(
                isinstance(p, str) and len(p) <= 128 for p in evicted) or seen & set(evicted):
            raise ValueError("stage map evicted must be a list of peer ids not in its stages")
        every = d.get("copy_every", 1)
        if not (isinstance(every, int) and not isinstance(every, bool) and 1 <= every <= MAX_COPY_EVERY):
            raise ValueError(f"stage map copy_every must be an int from 1 to {MAX_COPY_EVERY}")
        return cls(epoch, job_id, tuple(stages), start, tuple((a, b) for a, b in names), schedule, term,
                   float(pred), bottleneck, error, comp, reason, islands, codec, why, sds, tuple(evicted), every)


def _ranges(islands: tuple[Island, ...]) -> list[tuple[int, int]]:
    """[first, last) of each island's stages in the map's list."""
    out, first = [], 0
    for isl in islands:
        out.append((first, first + isl.stages))
        first += isl.stages
    return out


def _codecs_from(comp: Any, hops: int, what: str) -> tuple[str, ...]:
    if not isinstance(comp, list) or len(comp) not in (0, hops) or \
            not all(isinstance(c, str) and len(c) <= 32 for c in comp):
        raise ValueError(f"{what} must be one codec name per hop")
    try:
        for c in comp:
            compression_ratio(c)
    except (ValueError, KeyError):
        raise ValueError(f"{what} {comp[:3]!r}: unknown codec") from None
    return tuple(comp)


def _islands_from(raw: Any, num_stages: int) -> tuple[Island, ...]:
    """A map's islands from untrusted data: each a run of its stages, together all of them."""
    if not isinstance(raw, list) or len(raw) == 1 or len(raw) > MAX_ISLANDS:
        raise ValueError(f"stage map islands must be a list of 2 to {MAX_ISLANDS} (or none)")
    out = []
    for i, x in enumerate(raw):
        if not isinstance(x, dict):
            raise ValueError(f"island {i} must be a map")
        n, h, sched, pred = x.get("stages"), x.get("steps_per_round"), x.get("schedule", ""), x.get("predicted_step_s", 0.0)
        if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= num_stages):
            raise ValueError(f"island {i}: stages must be a count of the map's stages")
        if not (isinstance(h, int) and not isinstance(h, bool) and 1 <= h <= 100_000):
            raise ValueError(f"island {i}: steps_per_round must be 1 to 100000")
        if sched not in ("", *SCHEDULE_NAMES):
            raise ValueError(f"island {i}: schedule {str(sched)[:20]!r} is unknown")
        if isinstance(pred, bool) or not isinstance(pred, (int, float)) or not 0 <= pred < 1e9 or pred != pred:
            raise ValueError(f"island {i}: predicted_step_s must be a non-negative number")
        comp = _codecs_from(x.get("compression", []), n - 1, f"island {i} compression")
        out.append(Island(n, h, sched, comp, float(pred)))
    if out and sum(x.stages for x in out) != num_stages:
        raise ValueError("stage map islands must share out all of its stages")
    return tuple(out)


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
