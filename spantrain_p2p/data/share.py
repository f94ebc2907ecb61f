"""Data set shards between peers: a peer that lacks the job's data set fetches the shards its
batches need from peers that have them, content-addressed and hash-checked.

Every peer with a copy serves its data set's manifest (``datamanifest``) and shards (``datashard``)
on the data plane. A peer without one (``dataset.RunData.lacking``) fetches the manifest, checks
that it hashes to the job's data fingerprint, and before each step fetches the shards of that
step's micro-batches it does not hold yet (``ensure``); a shard that does not hash to the
manifest's entry is refused, and the next peer asked. Only the stages that read data (the first:
inputs, the last: targets) ever ask.
"""
from __future__ import annotations

import json
import logging
from typing import Iterable

from ..net.framing import FrameError, check_fields
from ..pipeline.executor import StepFailed

log = logging.getLogger("spantrain.train")

MANIFEST, SHARD = "datamanifest", "datashard"
MAX_MANIFEST_BYTES = 16 << 20


class DataShare:
    """Serves this peer's data set and fetches what it lacks. ``data``: the run's ``RunData``."""

    def __init__(self, peer):
        self.peer = peer
        self.data = None
        self.fetched: list[int] = []  # shard indices fetched from peers, in order

    def start(self, data) -> None:
        self.data = data

    # ---- serving ----------------------------------------------------------------------------------
    def _corpus_for(self, header: dict):
        check_fields(header, {"fingerprint": str})
        corpus = self.data.corpus if self.data is not None else None
        if corpus is None or self.data.lacking or header["fingerprint"] != corpus.fingerprint:
            raise FrameError("this peer holds no copy of that data set")
        return corpus

    async def on_manifest(self, header: dict, buffers):
        corpus = self._corpus_for(header)
        return {}, [json.dumps(corpus.manifest.to_dict(), sort_keys=True).encode()]

    async def on_shard(self, header: dict, buffers):
        corpus = self._corpus_for(header)
        check_fields(header, {"fingerprint": str, "shard": int})
        i = header["shard"]
        if not 0 <= i < corpus.num_shards or i in corpus.missing_shards():
            raise FrameError(f"this peer holds no shard {i} of that data set")
        return {}, [corpus.shard_bytes(i)]

    # ---- fetching ---------------------------------------------------------------------------------
    def _sources(self) -> list:
        return [r for r in self.peer.live_members() if r.peer_id != self.peer.peer_id and r.data_url]

    async def _ask(self, kind: str, header: dict, check):
        """The first answer from a live peer that ``check`` accepts (it raises on a bad one)."""
        errors = []
        for r in self._sources():
            try:
                reply = await self.peer.client.send(r.data_url, kind, header, timeout=60.0,
                                                    link=self.peer.link_to(r.peer_id))
                if reply is None or len(reply[1]) != 1:
                    raise ValueError("an empty answer")
                return check(bytes(reply[1][0])), r
            except Exception as e:  # that peer has no copy, or a bad one: ask the next
                errors.append(f"{self.peer.name_of(r.peer_id)}: {e}")
        raise StepFailed(f"no live peer gave {kind} {header}: {'; '.join(errors)[:400] or 'no peers'}")

    async def ensure(self, step: int, micro_batches: Iterable[int]) -> None:
        """The shards these micro-batches of ``step`` read are here (fetched if they were not)."""
        data = self.data
        if data is None or not data.lacking:
            return
        from .corpus import DataError, Manifest, open_manifest

        job = data.job
        if data.corpus is None:
            def manifest(raw: bytes):
                if len(raw) > MAX_MANIFEST_BYTES:
                    raise ValueError("manifest too large")
                m = Manifest.from_dict(json.loads(raw))
                if m.fingerprint != job.data_fingerprint:
                    raise DataError(f"manifest of data set {m.fingerprint[:12]}, the job's is {job.data_fingerprint[:12]}")
                return m

            m, src = await self._ask(MANIFEST, {"fingerprint": job.data_fingerprint}, manifest)
            data.corpus = open_manifest(m, data.cache_dir)
            log.info("data set %s: manifest from %s (%d shards, %d tokens); fetching the shards batches need",
                     m.fingerprint[:12], self.peer.name_of(src.peer_id), len(m.shards), m.tokens)
        corpus = data.corpus
        missing = set(corpus.missing_shards())
        need = sorted({i for mb in micro_batches for i in corpus.shards_for(job.seed, step, mb, job.micro_batch_size,
                                                                            job.seq_len)} & missing)
        for i in need:
            def shard(raw: bytes, i=i):
                corpus.add_shard(i, raw)  # raises unless it hashes to the manifest's entry
                return len(raw)

            size, src = await self._ask(SHARD, {"fingerprint": job.data_fingerprint, "shard": i}, shard)
            self.fetched.append(i)
            log.info("data shard %d (%d bytes) fetched from %s", i, size, self.peer.name_of(src.peer_id))
