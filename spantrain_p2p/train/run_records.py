"""The swarm's records of a run in the DHT: the job, the stage maps, and the news of a new map.

The peer that starts the swarm publishes the job; every peer keeps it alive. Stage maps are
signed and stored one subkey per epoch; the newest valid one (highest (term, epoch)) wins, so a
stale planner's publications lose to its successor's. After publishing a map the planner sends
every peer a "mapnews" message: only a hint to read the DHT (the only source of maps), so that
peers need not poll it often (every read costs every peer CPU)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from ..plan.stagemap import StageMap
from ..swarm.keys import JOB_SUBKEY, epoch_subkey, job_key, stagemap_key
from ..swarm.records import BadRecord, open_payload, sign_payload
from ..job.spec import JobRefused, JobSpec

log = logging.getLogger("spantrain.train")

RECORD_TTL_S = 600.0
MAX_MAP_BYTES = 256 << 10
# without news a peer reads the stage maps this often
MAP_POLL_S = 2.0
MAP_NEWS_MIN_GAP_S = 0.2  # news closer together than this wakes no one (a spamming peer included)


class RunRecords:
    """This peer's access to the run's records. ``log_bad(subkey, reason)`` reports (once) a
    record that does not validate."""

    def __init__(self, peer, log_bad: Callable[[object, str], None], poll_s: float = 0.5):
        self.peer, self.log_bad, self.poll_s = peer, log_bad, poll_s
        self.job: Optional[JobSpec] = None
        self.num_layers = 0
        self._news = asyncio.Event()
        self._news_at = 0.0

    def start(self, job: JobSpec, num_layers: int) -> None:
        self.job, self.num_layers = job, num_layers

    @property
    def swarm(self) -> str:
        return self.peer.config.swarm

    async def store(self, key: str, subkey: str, value: dict) -> None:
        from hivemind.utils import get_dht_time

        await self.peer.dht.store(key, value, get_dht_time() + RECORD_TTL_S, subkey=subkey)

    # ---- the job ----------------------------------------------------------------------------------
    async def publish_job(self, job: JobSpec) -> None:
        await self.store(job_key(self.swarm), JOB_SUBKEY, sign_payload(job.to_dict(), self.peer.identity))

    async def await_job(self) -> JobSpec:
        """The swarm's job, once it is in the DHT; an invalid record refuses the run."""
        waited = 0.0
        while True:
            found = await self.peer.dht.get(job_key(self.swarm), latest=True)
            entry = found.value.get(JOB_SUBKEY) if found is not None and isinstance(found.value, dict) else None
            if entry is not None:
                try:
                    _, payload = open_payload(entry.value)
                    return JobSpec.from_dict(payload)
                except (BadRecord, ValueError, TypeError) as e:
                    raise JobRefused(f"the swarm's job record is invalid: {e}") from None
            if waited == 0.0:
                log.info("waiting for the swarm's job to appear in the DHT")
            await asyncio.sleep(self.poll_s)
            waited += self.poll_s

    async def refresh_job(self) -> None:
        """Every peer keeps the job record alive, so it outlives the peer that published it."""
        from hivemind.utils import get_dht_time

        while True:
            await asyncio.sleep(RECORD_TTL_S / 4)
            found = await self.peer.dht.get(job_key(self.swarm), latest=True)
            if found is not None and isinstance(found.value, dict) and JOB_SUBKEY in found.value:
                await self.peer.dht.store(job_key(self.swarm), found.value[JOB_SUBKEY].value,
                                          get_dht_time() + RECORD_TTL_S, subkey=JOB_SUBKEY)

    # ---- stage maps -------------------------------------------------------------------------------
    async def newest_map(self) -> Optional[StageMap]:
        """The newest valid stage map of this job: highest (term, epoch)."""
        found = await self.peer.dht.get(stagemap_key(self.swarm), latest=True)
        if found is None or not isinstance(found.value, dict):
            return None
        best = None
        for sub, entry in found.value.items():
            try:
                signer, payload = open_payload(entry.value, MAX_MAP_BYTES)
                smap = StageMap.from_dict(payload, self.num_layers)
            except (BadRecord, ValueError) as e:
                self.log_bad(sub, f"stage map: {e}")
                continue
            if smap.job_id != self.job.job_id:
                continue
            if best is None or (smap.term, smap.epoch) > (best.term, best.epoch):
                best = smap
        return best

    async def await_map(self, after: int, waiting_for: Callable[[], str]) -> StageMap:
        """The first stage map newer than epoch ``after``; ``waiting_for`` says what it waits on."""
        announced = False
        while True:
            smap = await self.newest_map()
            if smap is not None and smap.epoch > after:
                self._log_map(smap)
                return smap
            if not announced:
                log.info("waiting for the planner's stage map (%s)", waiting_for())
                announced = True
            await self.news_or(MAP_POLL_S)

    def _log_map(self, smap: StageMap) -> None:
        pred = f", predicted step {smap.predicted_step_s:.3f}s ({smap.bottleneck})" if smap.predicted_step_s else ""
        log.info("stage map epoch %d (term %d, %s%s): %s", smap.epoch, smap.term, smap.schedule or self.job.schedule,
                 pred, " | ".join(f"{'+'.join(smap.name_of(p) for p in st.peers)} [{st.layers[0]},{st.layers[1]})"
                                  for st in smap.stages))

    async def publish_map(self, smap: StageMap) -> None:
        """Signs and stores ``smap`` under its epoch, then tells every live peer (best effort)."""
        await self.store(stagemap_key(self.swarm), epoch_subkey(smap.epoch),
                         sign_payload(smap.to_dict(), self.peer.identity, MAX_MAP_BYTES))
        self.peer.spawn(self._announce(smap.epoch), "map-news")

    # ---- news of a map ----------------------------------------------------------------------------
    async def on_news(self, header: dict, buffers) -> None:
        """A planner published a stage map: wake whoever waits for one (they read the DHT)."""
        if self.job is not None and header.get("job") != self.job.job_id:
            return None
        now = time.monotonic()
        if now - self._news_at >= MAP_NEWS_MIN_GAP_S:
            self._news_at = now
            self._news.set()
        return None

    async def news_or(self, timeout_s: float) -> None:
        """Until the next stage-map news, at most ``timeout_s``."""
        try:
            await asyncio.wait_for(self._news.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._news.clear()

    async def _announce(self, epoch: int) -> None:
        """Every other live peer gets the news at once (a lost one waits MAP_POLL_S)."""
        async def tell(r) -> None:
            try:
                await self.peer.client.send(r.data_url, "mapnews", {"job": self.job.job_id, "epoch": epoch},
                                            timeout=2.0, link=self.peer.link_to(r.peer_id))
            except Exception as e:
                log.debug("stage-map news to %s not delivered: %r", r.name or r.peer_id, e)

        self._news.set()  # this peer's own waiters
        await asyncio.gather(*(tell(r) for r in self.peer.live_members()
                               if r.peer_id != self.peer.peer_id and r.data_url))
