"""One peer of a swarm in this process, from Python (``Session``): started with a job (``start``) or
joined (``join``); followed step by step (``steps``); its trained model gathered from the peers that
trained it (``layer_states``, ``state_dict``, ``export``); its outcome raised as the package's own
errors (``errors``). ``spantrain-peer`` runs its peer through a ``Session`` too."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from ..errors import JobRefused, NoFeasiblePlan, PeerCrashed, TrainingStopped
from ..net.addresses import default_binds
from ..peer import Peer, PeerConfig

POLL_S = 0.5  # how often ``steps`` reads the losses
SETTLE_S = 15.0  # after this peer is done, how long ``steps`` waits for the last steps' losses


@dataclass(frozen=True)
class StepResult:
    """One step of the run, once its loss is in: ``loss`` over all its micro-batches; ``epoch``, the
    stage map it ran under (a step redone after a re-plan comes again, with the newer epoch);
    ``tokens_per_s`` as the last stage measured it; ``events`` this peer saw since the step before
    (``{"kind": "abandoned" | "fetched" | ..., ...}``: re-plans, recoveries)."""

    step: int
    loss: float
    epoch: int
    tokens_per_s: Optional[float] = None
    events: tuple[dict, ...] = field(default_factory=tuple)


class Session:
    """One peer of a swarm, running in the caller's asyncio loop: its ``Peer`` (membership, data
    plane, p2p daemon) and, where it trains, its trainer. Use ``start`` or ``join``::

        async with start(Job("hf:gpt2-tiny", steps=30)) as founder:
            async for r in founder.steps():
                print(r.step, r.loss)
            await founder.export("trained")
    """

    def __init__(self, config: PeerConfig, options=None):
        from ..train.trainer import Trainer
        from ..view import metrics

        self.peer = Peer(config)
        self.trainer = Trainer(self.peer, options) if options is not None else None
        if self.trainer is not None:
            trainer = self.trainer
            self.peer.before_serving(lambda p: p.dataplane.add_get(
                "/metrics", lambda: (metrics.metrics_text(trainer), metrics.CONTENT_TYPE)))

    # ---- life --------------------------------------------------------------------------------------
    async def open(self) -> "Session":
        """Starts the peer (joins, if its config names addresses) and its trainer. ``PeerError``
        (``SwarmUnreachable`` where no address answered) if it cannot, with what the start had opened
        closed again (``Peer.start``)."""
        await self.peer.start()
        if self.trainer is not None:
            self.peer.spawn(self.trainer.run(), "trainer")
        return self

    async def close(self) -> None:
        """Leaves the swarm at once (a tombstone: the others drop this peer), stops the trainer, the
        data plane and the p2p daemon."""
        await self.peer.close()

    async def __aenter__(self) -> "Session":
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def address(self) -> str:
        """The multiaddr others join this swarm at."""
        return self.peer.address

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    @property
    def job(self):
        """The swarm's job (``job.spec.JobSpec``) once this peer has it, else None."""
        return self.trainer.job if self.trainer is not None else None

    async def members(self) -> list:
        """The swarm's live members (``PeerRecord``s), fresh from the DHT."""
        return await self.peer.members()

    # ---- the run -----------------------------------------------------------------------------------
    def raise_for_outcome(self) -> None:
        """Raises the run's failure as the package's error, with the message the command line prints:
        ``JobRefused``, ``NoFeasiblePlan``, ``TrainingStopped``, ``PeerCrashed``; nothing otherwise."""
        t = self.trainer
        if t is None:
            return
        if t.refused:
            raise JobRefused(f"refusing to join this run: {t.refused}")
        if t.crashed:
            raise PeerCrashed(t.error)
        if t.error:
            raise (NoFeasiblePlan if "no feasible plan" in t.error else TrainingStopped)(t.error)

    @property
    def done(self) -> bool:
        """Whether this peer's part of the run is over (the job done, or failed)."""
        return self.trainer is None or self.trainer.finished.is_set()

    async def steps(self) -> AsyncIterator[StepResult]:
        """The run's steps as their losses come in (from the last stage's peers), in order, until the
        job is done; then the run's failure, if any, is raised (``raise_for_outcome``)."""
        if self.trainer is None:
            raise ValueError("this peer does not train: it was started without a job and joins none")
        book = _LossBook()
        seen_events = 0
        settle_until: Optional[float] = None
        while True:
            job = self.trainer.job  # (a joiner's once it has adopted the swarm's)
            if job is not None:
                book.read(await self._loss_pages())
                n = len(self.trainer.events)
                for r in book.ready(job, tuple(self.trainer.events[seen_events:n])):
                    seen_events = n
                    yield r
            if self.done:
                if self.trainer.error or self.trainer.refused or job is None:
                    break
                settle_until = settle_until or time.monotonic() + SETTLE_S
                if book.complete(job) or time.monotonic() > settle_until:
                    for r in book.ready(job, (), final=True):
                        yield r
                    break
            await asyncio.sleep(POLL_S)
        self.raise_for_outcome()

    async def wait(self) -> list[float]:
        """Runs the job to its end: every step's loss (``steps`` without following)."""
        losses: dict[int, float] = {}
        async for r in self.steps():
            losses[r.step] = r.loss
        return [losses[s] for s in sorted(losses)]

    async def _loss_pages(self) -> list[dict]:
        """The ``train`` part of /status of this peer and of the peers of the last stage of the map in
        force (they report the steps' losses; every member until there is a map)."""
        t = self.trainer
        pages = [t.status()]
        smap = t.smap
        last = set(smap.stages[-1].peers) if smap is not None and smap.stages else None
        for r in self.peer.live_members():
            if r.peer_id == self.peer.peer_id or not r.data_url or (last is not None and r.peer_id not in last):
                continue
            try:
                page = await self.peer.client.status(r.data_url, timeout=3.0, path="/status")
            except Exception:  # a peer that does not answer now may next time; its buddy holds its losses
                continue
            if isinstance(page, dict) and isinstance(page.get("train"), dict):
                pages.append(page["train"])
        return pages

    # ---- the trained model --------------------------------------------------------------------------
    async def layer_states(self, step: Optional[int] = None) -> dict:
        """Every layer's state (weights and optimizer state, ``models.state``) after ``step`` steps
        (default: the job's last), from this peer and the peers that hold the others."""
        t = self.trainer
        if t is None or t.job is None:
            raise ValueError("this peer has no job")
        await self._peers_done()
        return await t.recovery.gather(t.job.steps if step is None else step)

    async def _peers_done(self, timeout: float = 60.0) -> None:
        """Waits (up to ``timeout``) until the peers of the map in force have finished: a stage that
        ends its last step after the loss is in (the first: its last backward, its optimizer step)
        keeps that step's snapshot only then."""
        from ..train.run_records import map_states

        smap = self.trainer.full_map or self.trainer.smap
        deadline = time.monotonic() + timeout
        while smap is not None and time.monotonic() < deadline:
            if all(v in ("done", "failed") for v in map_states(self.peer, smap).values()):
                return
            await asyncio.sleep(POLL_S)

    async def state_dict(self, step: Optional[int] = None) -> dict:
        """The trained weights: under transformers' names for an ``hf:`` model, else ``"<layer>.<name>"``."""
        from ..job.export import trained_layers
        from ..models.hf_model import hf_state_dict, is_hf

        layers = trained_layers(self.trainer.job, await self.layer_states(step))
        if is_hf(self.trainer.job.model):
            return hf_state_dict(layers)
        return {f"{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}

    async def export(self, out_dir: str, step: Optional[int] = None) -> str:
        """Writes the trained ``hf:`` model as a transformers directory (what
        ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads); returns ``out_dir``."""
        from ..job.export import write_transformers_dir

        states = await self.layer_states(step)
        await asyncio.to_thread(write_transformers_dir, self.trainer.job, states, out_dir)
        return out_dir


class _LossBook:
    """The steps' loss rows ([step, loss sum, micro-batches, epoch]) the pages gave (untrusted: a
    malformed row is skipped), the newest epoch's for each step, and the steps already given out."""

    def __init__(self):
        self.rows: dict[int, tuple[int, float, int]] = {}  # step -> (epoch, sum, count)
        self.tps: dict[int, float] = {}
        self.given: dict[int, int] = {}  # step -> epoch given out

    def read(self, pages: list[dict]) -> None:
        for page in pages:
            tps = page.get("tokens_per_s")
            for row in (page.get("recent_losses") or [])[:256]:
                if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], int) and isinstance(row[2], int)
                        and isinstance(row[3], int) and isinstance(row[1], (int, float)) and math.isfinite(row[1])
                        and row[2] > 0 and row[0] >= 0):
                    continue
                step, total, count, epoch = row
                if step not in self.rows or (epoch, count) > (self.rows[step][0], self.rows[step][2]):
                    self.rows[step] = (epoch, float(total), count)
                    if isinstance(tps, (int, float)) and math.isfinite(tps):
                        self.tps[step] = float(tps)

    def complete(self, job) -> bool:
        return all(self.rows.get(s, (0, 0, 0))[2] >= job.num_micro_batches for s in range(job.steps))

    def ready(self, job, events: tuple, final: bool = False) -> list[StepResult]:
        """The steps to give out now, in order: whole (every micro-batch's loss in) and not given out
        at this epoch; with ``final``, what there is."""
        out = []
        for step in sorted(self.rows):
            epoch, total, count = self.rows[step]
            if self.given.get(step) == epoch or (count < job.num_micro_batches and not final):
                continue
            self.given[step] = epoch
            out.append(StepResult(step, total / count, epoch, self.tps.get(step), events if not out else ()))
        return out


def peer_config(join: tuple[str, ...] = (), config: Optional[PeerConfig] = None, **fields: Any) -> PeerConfig:
    """A peer's config for the API: ``config``'s fields (default ``PeerConfig()``) with ``fields``
    changed, listening where ``spantrain-peer`` would for these join addresses (loopback for a local
    swarm, every interface to join a remote one)."""
    from dataclasses import replace

    base = config or PeerConfig()
    if config is None:
        listen, host = default_binds(None, None, join)
        fields = {"listen": listen, "host": host, **fields}
    return replace(base, join=tuple(join), **fields)


def start(job=None, *, name: str = "", swarm: str = "default", config: Optional[PeerConfig] = None) -> Session:
    """A new swarm, founded by this peer, training ``job`` (an ``api.job.Job``) once ``job``'s
    ``peers`` are ready; ``async with start(job) as s`` (or ``await start(job).open()``)."""
    return Session(peer_config((), config, name=name, swarm=swarm), job.train_options() if job is not None else None)


def join(address, *, accept=(), name: str = "", swarm: str = "default", config: Optional[PeerConfig] = None,
         train: bool = True, **options: Any) -> Session:
    """A peer joining the swarm at ``address`` (a multiaddr, or several), taking part in its job:
    ``accept`` names the user models or model directories it agrees to run; ``options``, its own
    (``data``, ``tokenizer``, ``device``, ``no_measure``, ...). ``train=False``: a member only."""
    from .job import joiner_options

    addrs = (address,) if isinstance(address, str) else tuple(address)
    opts = joiner_options(accept, **options) if train else None
    return Session(peer_config(addrs, config, name=name, swarm=swarm), opts)
