"""A local data set as content-addressed token shards, and its batches by (seed, step, micro-batch).

``open_corpus(PATH, tokenizer)`` reads the data set (``text_sources``: a file, a directory,
JSON Lines, Parquet), tokenizes it into one stream of tokens (the tokenizer's ``eos_id`` between
documents) and cuts it into shards of ``SHARD_BYTES`` (1 MiB: 512 Ki tokens as uint16 when the
vocabulary fits 16 bits, else 256 Ki as uint32). A shard is named by the sha256 of its bytes; the
``Manifest`` lists them with the token count and the tokenizer's fingerprint, and its own sha256
is the data set's fingerprint: two peers with the same fingerprint hold the same tokens.

The cache (``default_cache_dir()``, or ``cache_dir``) keeps a peer from re-tokenizing at every
start::

    CACHE/shards/<sha256>.tokens      shard bytes, shared by every data set that has them
    CACHE/manifests/<fingerprint>.json
    CACHE/sources/<key>.json          which fingerprint a source tokenized to; the key covers the
                                      tokenizer, the options and each file's path, size and mtime

Every file is written to a temporary name and renamed, so a killed peer leaves no half shard.
Shards are checked against the manifest when first used, then memory-mapped: memory stays
bounded by what the batches touch. ``Corpus.add_shard(i, data)`` takes shard bytes from
elsewhere (a peer, later) and keeps them only if they hash to the manifest's entry.

``Corpus.batch(seed, step, mb, B, T)`` has ``data.generated.batch``'s contract: ``B`` windows of
``T + 1`` tokens at offsets drawn from a generator seeded by ``(seed, step, mb)`` only; inputs are
the first ``T``, targets the last ``T``. ``Corpus.shards_for`` says which shards those windows
touch, so a peer can fetch just those.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..files import atomic_write_bytes
from .text_sources import DataError, Piece, ReadStats, list_files, read_pieces, resolve_data
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT = 1
SHARD_BYTES = 1 << 20
_ENCODE_CHARS = 8 << 20  # text handed to the tokenizer per encode_batch call
_MAPPED_SHARDS = 256  # memory maps kept open at once
_HEX = frozenset("0123456789abcdef")

__all__ = ["Corpus", "DataError", "Manifest", "open_corpus", "open_manifest", "default_cache_dir",
           "atomic_write_bytes", "shard_from_bytes"]


def default_cache_dir() -> Path:
    """``$SPANTRAIN_CACHE/data``, else ``$XDG_CACHE_HOME/spantrain/data``, else ``~/.cache/spantrain/data``."""
    if os.environ.get("SPANTRAIN_CACHE"):
        return Path(os.environ["SPANTRAIN_CACHE"]).expanduser() / "data"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spantrain" / "data"


def _canonical(d: Any) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Manifest:
    """What a data set is: its shards' hashes, its token count, and the tokenizer that made it.

    ``from_dict`` treats its input as untrusted (a manifest may come from another peer).
    """

    tokenizer: str  # the tokenizer's fingerprint
    vocab_size: int
    dtype: str  # "uint16" | "uint32"
    shard_tokens: int  # tokens in every shard but the last
    tokens: int
    shards: tuple[str, ...]  # sha256 of each shard's bytes
    version: int = FORMAT

    def __post_init__(self) -> None:
        if self.version != FORMAT:
            raise DataError(f"data manifest format {self.version!r}, this peer reads {FORMAT}")
        if self.dtype not in ("uint16", "uint32"):
            raise DataError(f"data manifest dtype must be uint16 or uint32, not {self.dtype!r}")
        for name, hi in (("vocab_size", 1 << 32), ("shard_tokens", 1 << 30), ("tokens", 1 << 50)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise DataError(f"data manifest field {name!r} must be an int in [1, {hi}], not {v!r}")
        if self.vocab_size > (1 << 16) and self.dtype == "uint16":
            raise DataError(f"a vocabulary of {self.vocab_size} does not fit uint16 tokens")
        shards = tuple(self.shards) if isinstance(self.shards, (list, tuple)) else None
        if shards is None or len(shards) != -(-self.tokens // self.shard_tokens):
            raise DataError("data manifest: the shard list does not match tokens / shard_tokens")
        for h in (self.tokenizer, *shards):
            if not isinstance(h, str) or len(h) != 64 or not set(h) <= _HEX:
                raise DataError(f"data manifest: {h!r} is not a sha256 hex digest")
        object.__setattr__(self, "shards", shards)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def shard_len(self, i: int) -> int:
        return min(self.shard_tokens, self.tokens - i * self.shard_tokens)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shards"] = list(self.shards)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        if not isinstance(d, dict) or set(d) != set(cls.__dataclass_fields__):
            raise DataError(f"a data manifest must be a map with exactly the fields {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    @property
    def fingerprint(self) -> str:
        """The data set's fingerprint: sha256 of this manifest in canonical JSON."""
        return hashlib.sha256(_canonical(self.to_dict())).hexdigest()


def shard_from_bytes(manifest: Manifest, i: int, data: bytes) -> np.ndarray:
    """Shard ``i`` as tokens, if ``data`` is what the manifest names; else a DataError saying so."""
    if not 0 <= i < len(manifest.shards):
        raise DataError(f"shard {i} is not in a data set of {len(manifest.shards)} shards")
    got = hashlib.sha256(data).hexdigest()
    if got != manifest.shards[i]:
        raise DataError(f"shard {i} of data set {manifest.fingerprint[:12]} hashes to {got[:12]}, its manifest says "
                        f"{manifest.shards[i][:12]}: this copy of the data differs")
    if len(data) != manifest.shard_len(i) * manifest.itemsize:
        raise DataError(f"shard {i}: {len(data)} bytes, the manifest implies {manifest.shard_len(i) * manifest.itemsize}")
    return np.frombuffer(data, dtype=manifest.dtype)


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


class Corpus:
    """A data set's tokens as its manifest names them, read from the shard folder lazily."""

    def __init__(self, manifest: Manifest, cache_dir: Path, stats: Optional[dict] = None) -> None:
        self.manifest = manifest
        self.cache_dir = Path(cache_dir)
        self.stats = dict(stats or {})  # what reading the source found (files, skipped, ...), if built here
        self._mapped: OrderedDict[int, np.ndarray] = OrderedDict()
        self._verified: set[int] = set()
        self._lock = threading.Lock()  # batches may be cut on worker threads

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def tokens(self) -> int:
        return self.manifest.tokens

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def shard_path(self, i: int) -> Path:
        return self.cache_dir / "shards" / f"{self.manifest.shards[i]}.tokens"

    def missing_shards(self) -> list[int]:
        """Shards this peer has no file for (to fetch from peers); present ones are checked when used."""
        return [i for i in range(self.num_shards) if not self.shard_path(i).is_file()]

    def shard_bytes(self, i: int) -> bytes:
        """Shard ``i``'s bytes as the manifest names them (what a peer would serve to another)."""
        data = self._read(i)
        shard_from_bytes(self.manifest, i, data)
        return data

    def add_shard(self, i: int, data: bytes) -> None:
        """Keep shard ``i`` from elsewhere, if its bytes are the manifest's (else DataError)."""
        shard_from_bytes(self.manifest, i, data)
        atomic_write_bytes(self.shard_path(i), data)

    def verify(self) -> None:
        """Check every shard against the manifest now; DataError names the first missing or differing one."""
        for i in range(self.num_shards):
            self.shard(i)

    def _read(self, i: int) -> bytes:
        try:
            return self.shard_path(i).read_bytes()
        except FileNotFoundError:
            raise DataError(f"shard {i} of data set {self.fingerprint[:12]} is not in {self.cache_dir / 'shards'} "
                            "(fetch it from a peer that has the data)") from None

    def shard(self, i: int) -> np.ndarray:
        """Shard ``i``'s tokens (read-only, memory-mapped), checked against the manifest on first use."""
        with self._lock:
            return self._shard(i)

    def _shard(self, i: int) -> np.ndarray:
        arr = self._mapped.get(i)
        if arr is not None:
            self._mapped.move_to_end(i)
            return arr
        if not 0 <= i < self.num_shards:
            raise DataError(f"shard {i} is not in a data set of {self.num_shards} shards")
        if i not in self._verified:
            try:
                shard_from_bytes(self.manifest, i, self._read(i))
            except DataError as e:
                raise DataError(f"{e} (local file {self.shard_path(i)}; delete it to fetch it again)") from None
            self._verified.add(i)
        arr = np.memmap(self.shard_path(i), dtype=self.manifest.dtype, mode="r")
        self._mapped[i] = arr
        if len(self._mapped) > _MAPPED_SHARDS:
            self._mapped.popitem(last=False)
        return arr

    def tokens_at(self, start: int, n: int) -> np.ndarray:
        """Tokens ``start .. start+n-1`` of the stream as int64, across shard boundaries."""
        if start < 0 or n < 0 or start + n > self.tokens:
            raise DataError(f"tokens {start}..{start + n} are outside a data set of {self.tokens} tokens")
        st = self.manifest.shard_tokens
        out = np.empty(n, dtype=np.int64)
        pos = 0
        while pos < n:
            i, off = divmod(start + pos, st)
            take = min(n - pos, st - off)
            out[pos:pos + take] = self.shard(i)[off:off + take]
            pos += take
        return out

    def window_starts(self, seed: int, step: int, micro_batch: int, micro_batch_size: int, seq_len: int) -> np.ndarray:
        """Where the windows of micro-batch ``micro_batch`` of ``step`` start: a function of these arguments only."""
        _check_int("seed", seed, 0)
        _check_int("step", step, 0)
        _check_int("micro_batch", micro_batch, 0)
        _check_int("micro_batch_size", micro_batch_size, 1)
        _check_int("seq_len", seq_len, 1)
        if seq_len + 1 > self.tokens:
            raise ValueError(f"seq_len={seq_len} does not fit a data set of {self.tokens} tokens")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, micro_batch])))
        return rng.integers(0, self.tokens - seq_len, size=micro_batch_size)

    def shards_for(self, seed: int, step: int, micro_batch: int, micro_batch_size: int, seq_len: int) -> set[int]:
        """The shards ``batch`` with these arguments reads (computed without reading any)."""
        starts = self.window_starts(seed, step, micro_batch, micro_batch_size, seq_len)
        st = self.manifest.shard_tokens
        return {int(i) for s in starts for i in range(int(s) // st, (int(s) + seq_len) // st + 1)}

    def batch(self, seed: int, step: int, micro_batch: int, micro_batch_size: int,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro_batch`` of ``step``: ``(inputs, targets)``, LongTensor ``[B, T]``, targets shifted by one."""
        starts = self.window_starts(seed, step, micro_batch, micro_batch_size, seq_len)
        windows = torch.from_numpy(np.stack([self.tokens_at(int(s), seq_len + 1) for s in starts]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def global_batch(self, seed: int, step: int, num_micro_batches: int, micro_batch_size: int,
                     seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batches ``0..num_micro_batches-1`` of ``step`` concatenated in order (single-process reference)."""
        _check_int("num_micro_batches", num_micro_batches, 1)
        parts = [self.batch(seed, step, m, micro_batch_size, seq_len) for m in range(num_micro_batches)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    def describe(self) -> dict:
        return {"fingerprint": self.fingerprint, "tokenizer": self.manifest.tokenizer, "tokens": self.tokens,
                "shards": self.num_shards, "dtype": self.manifest.dtype, **self.stats}

    def __repr__(self) -> str:
        return f"Corpus({self.fingerprint[:12]}, {self.tokens} tokens, {self.num_shards} shards)"


def open_manifest(manifest: Union[Manifest, dict, str], cache_dir: Optional[Union[str, Path]] = None) -> Corpus:
    """A corpus from its manifest (or its fingerprint, if the manifest is cached here); shards may be missing."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if isinstance(manifest, str):
        p = cache / "manifests" / f"{manifest}.json"
        if not p.is_file():
            raise DataError(f"data set {manifest[:12]} is not in the cache {cache}")
        m = Manifest.from_dict(json.loads(p.read_bytes()))
        if m.fingerprint != manifest:
            raise DataError(f"cached manifest {p} hashes to {m.fingerprint[:12]}, not its name: delete it")
    else:
        m = manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest)
    p = cache / "manifests" / f"{m.fingerprint}.json"
    if not p.is_file():
        atomic_write_bytes(p, _canonical(m.to_dict()))
    return Corpus(m, cache)


def _source_key(path: Path, files: Sequence[Path], tokenizer: Tokenizer, shard_tokens: int,
                max_bytes: Optional[int], suffixes: Optional[Sequence[str]]) -> str:
    h = hashlib.sha256(_canonical({"format": FORMAT, "path": str(path.resolve()), "tokenizer": tokenizer.fingerprint,
                                   "shard_tokens": shard_tokens, "max_bytes": max_bytes,
                                   "suffixes": list(suffixes) if suffixes else None}))
    for f in files:
        s = f.stat()
        h.update(_canonical([str(f), s.st_size, s.st_mtime_ns]))
    return h.hexdigest()


def _encoded(pieces: Iterator[Piece], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """Token arrays for the pieces, in order, the tokenizer's eos_id after each document that has tokens."""
    eos = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id], dtype=np.int64)
    group: list[Piece] = []
    chars = doc_tokens = 0

    def flush() -> Iterator[np.ndarray]:
        nonlocal doc_tokens
        for piece, ids in zip(group, tokenizer.encode_batch([p.text for p in group])):
            yield ids
            doc_tokens += len(ids)
            if piece.last:
                if eos is not None and doc_tokens:
                    yield eos
                doc_tokens = 0

    for piece in pieces:
        group.append(piece)
        chars += len(piece.text)
        if chars >= _ENCODE_CHARS:
            yield from flush()
            group, chars = [], 0
    yield from flush()


def _build(path: Path, tokenizer: Tokenizer, cache: Path, shard_tokens: int, max_bytes: Optional[int],
           suffixes: Optional[Sequence[str]]) -> tuple[Manifest, ReadStats]:
    dtype = np.uint16 if tokenizer.vocab_size <= (1 << 16) else np.uint32
    stats = ReadStats()
    hashes: list[str] = []
    buf: list[np.ndarray] = []
    buffered = total = 0

    def cut(final: bool) -> None:
        """Write the whole shards in the buffer (and the rest, if ``final``); keep the rest buffered."""
        nonlocal buf, buffered
        flat = np.concatenate(buf)
        end = len(flat) if final else len(flat) // shard_tokens * shard_tokens
        for a in range(0, end, shard_tokens):
            data = flat[a:min(a + shard_tokens, end)].tobytes()
            digest = hashlib.sha256(data).hexdigest()
            target = cache / "shards" / f"{digest}.tokens"
            if not target.is_file():
                atomic_write_bytes(target, data)
            hashes.append(digest)
        buf, buffered = [flat[end:]], len(flat) - end

    report_at = _ENCODE_CHARS
    for ids in _encoded(read_pieces(path, max_bytes=max_bytes, suffixes=suffixes, stats=stats), tokenizer):
        if stats.text_bytes >= report_at:  # a line per ~8 MiB read, for data sets that take a while
            log.info("data %s: %.0f MiB read, %d tokens so far", path, stats.text_bytes / 2**20, total)
            report_at = stats.text_bytes + _ENCODE_CHARS
        if len(ids) and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
            raise DataError(f"{tokenizer!r} produced token ids outside [0, {tokenizer.vocab_size})")
        buf.append(ids.astype(dtype))
        buffered += len(ids)
        total += len(ids)
        if buffered >= shard_tokens:
            cut(final=False)
    if buffered:
        cut(final=True)
    if total == 0:
        raise DataError(f"data {str(path)!r}: no text to tokenize ({stats.files} files read, "
                        f"{len(stats.skipped)} skipped as not UTF-8 text)")
    m = Manifest(tokenizer=tokenizer.fingerprint, vocab_size=tokenizer.vocab_size, dtype=np.dtype(dtype).name,
                 shard_tokens=shard_tokens, tokens=total, shards=tuple(hashes))
    return m, stats


def open_corpus(
    data: Union[str, Path],
    tokenizer: Tokenizer,
    *,
    cache_dir: Optional[Union[str, Path]] = None,
    shard_tokens: Optional[int] = None,
    max_bytes: Optional[int] = None,
    suffixes: Optional[Sequence[str]] = None,
) -> Corpus:
    """The data set at ``data`` tokenized by ``tokenizer``: from the cache when this source was seen, else built.

    ``shard_tokens`` defaults to ``SHARD_BYTES`` of tokens; ``max_bytes`` and ``suffixes`` as in
    ``text_sources.read_pieces``. The result's fingerprint is what a job carries.
    """
    path, suffixes = resolve_data(data, suffixes)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    itemsize = 2 if tokenizer.vocab_size <= (1 << 16) else 4
    st = _check_int("shard_tokens", shard_tokens, 1) if shard_tokens is not None else SHARD_BYTES // itemsize
    files = list_files(path, suffixes)
    key = _source_key(path, files, tokenizer, st, max_bytes, suffixes)
    src = cache / "sources" / f"{key}.json"
    src.parent.mkdir(parents=True, exist_ok=True)
    with open(cache / "sources" / f"{key}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # peers on one machine: one tokenizes, the others then read its cache
        corpus = _from_cache(src, cache)
        if corpus is not None:
            log.info("data %s: %s from the cache", path, corpus)
            return corpus
        t0 = time.perf_counter()
        manifest, stats = _build(path, tokenizer, cache, st, max_bytes, suffixes)
        seconds = time.perf_counter() - t0
        summary = {**stats.as_dict(), "tokenize_s": round(seconds, 3)}
        atomic_write_bytes(cache / "manifests" / f"{manifest.fingerprint}.json", _canonical(manifest.to_dict()))
        atomic_write_bytes(src, _canonical({"fingerprint": manifest.fingerprint, "stats": summary}))
    if stats.skipped:
        log.warning("data %s: %d files skipped as not UTF-8 text (first: %s)", path, len(stats.skipped), stats.skipped[0])
    log.info("data %s: %.1f MiB of text in %d files -> %d tokens, %d shards, in %.2f s (%s)", path,
             stats.text_bytes / 2**20, stats.files, manifest.tokens, len(manifest.shards), seconds,
             manifest.fingerprint[:12])
    return Corpus(manifest, cache, summary)


def _from_cache(src: Path, cache: Path) -> Optional[Corpus]:
    """The corpus a source entry names, if its manifest and every shard file are here."""
    if not src.is_file():
        return None
    try:
        seen = json.loads(src.read_bytes())
        corpus = open_manifest(seen["fingerprint"], cache)
    except (DataError, ValueError, KeyError, TypeError) as e:
        log.warning("data cache entry %s unusable (%s); tokenizing again", src, e)
        return None
    if corpus.missing_shards():
        return None
    corpus.stats = dict(seen.get("stats", {}), cached=True)
    return corpus
