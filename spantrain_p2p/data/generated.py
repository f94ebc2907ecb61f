"""A deterministic language-modelling corpus and its batches; nothing is downloaded.

The corpus is English-like text from a small seeded grammar over a fixed vocabulary of a few
hundred words, with Zipf-like word frequencies, so a tiny byte-level model learns it quickly.
It uses only ``random.Random(seed).random()`` (via ``choices``), whose stream is stable across
Python versions and platforms, so every peer builds the same bytes.

A batch is a pure function of ``(corpus_seed, step, micro_batch)``: whichever peer computes
micro-batch ``m`` of step ``s`` gets the same windows.
"""
from __future__ import annotations

import functools
import random

import numpy as np
import torch

DEFAULT_CORPUS_BYTES = 256 << 10

_DETERMINERS = "the a this that every some one each no my your our their his her its any another".split()
_ADJECTIVES = (
    "old new small large quiet loud bright dark warm cold quick slow green red blue white black "
    "happy sad busy lazy clever simple strange gentle heavy light early late tall short young "
    "ancient empty full soft hard rich poor brave calm wild tired hungry careful golden silver"
).split()
_NOUNS = (
    "cat dog bird fish horse farmer teacher child doctor king queen river mountain city village "
    "garden house door window table chair book letter road bridge forest tree flower stone boat ship "
    "train car market school church castle island lake field hill storm wind rain sun moon star "
    "friend stranger soldier sailor baker painter writer singer student merchant traveler neighbor "
    "machine engine clock lamp candle key box basket bottle cup bread apple cheese song story dream "
    "morning evening night winter summer spring autumn day week year question answer idea plan"
).split()
_VERBS = (
    "sees finds takes gives makes builds carries follows watches helps calls keeps holds brings "
    "leaves opens closes paints writes reads loves likes wants needs meets remembers forgets "
    "visits crosses chases catches drops lifts pushes pulls cleans fixes sells buys shares hides "
    "answers asks teaches learns"
).split()
_INTRANSITIVE = (
    "sleeps runs walks waits sings laughs smiles cries falls rises shines rests works dances "
    "listens speaks wanders returns arrives stays grows"
).split()
_ADVERBS = (
    "slowly quickly quietly loudly happily sadly carefully softly suddenly often rarely always "
    "never again together alone early late today yesterday"
).split()
_PREPOSITIONS = "in on under over near behind beside across through into from with without after before".split()
_CONJUNCTIONS = "and but because while although so when until".split()
_NAMES = "Anna Ben Clara David Elena Felix Grace Henry Iris Jonas Karen Leo Maria Nora Oscar Paul".split()


def _zipf(n: int) -> list[float]:
    """Cumulative Zipf weights (1/rank) for ``n`` items, for ``random.choices(cum_weights=...)``."""
    total, out = 0.0, []
    for r in range(1, n + 1):
        total += 1.0 / r
        out.append(total)
    return out


class _Grammar:
    """Seeded sentence generator: word order per class is shuffled by the seed, frequencies are Zipf."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.words: dict[str, tuple[list[str], list[float]]] = {}
        for name, words in (
            ("det", _DETERMINERS), ("adj", _ADJECTIVES), ("noun", _NOUNS), ("verb", _VERBS),
            ("intr", _INTRANSITIVE), ("adv", _ADVERBS), ("prep", _PREPOSITIONS),
            ("conj", _CONJUNCTIONS), ("name", _NAMES),
        ):
            ordered = sorted(words, key=lambda _: self.rng.random())  # seed picks which words are common
            self.words[name] = (ordered, _zipf(len(ordered)))

    def word(self, cls: str) -> str:
        words, cum = self.words[cls]
        return self.rng.choices(words, cum_weights=cum)[0]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def noun_phrase(self) -> list[str]:
        if self.chance(0.15):
            return [self.word("name")]
        out = [self.word("det")]
        if self.chance(0.45):
            out.append(self.word("adj"))
        out.append(self.word("noun"))
        return out

    def clause(self) -> list[str]:
        out = self.noun_phrase()
        if self.chance(0.65):
            out += [self.word("verb"), *self.noun_phrase()]
        else:
            out.append(self.word("intr"))
        if self.chance(0.3):
            out.append(self.word("adv"))
        if self.chance(0.35):
            out += [self.word("prep"), *self.noun_phrase()]
        return out

    def sentence(self) -> str:
        words = self.clause()
        if self.chance(0.3):
            words += [self.word("conj"), *self.clause()]
        text = " ".join(words)
        return text[0].upper() + text[1:] + ("?" if self.chance(0.08) else ".")


@functools.lru_cache(maxsize=8)
def corpus(corpus_seed: int, size: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """``size`` bytes of seeded English-like text as a read-only uint8 array (cached per seed and size)."""
    if isinstance(corpus_seed, bool) or not isinstance(corpus_seed, int) or corpus_seed < 0:
        raise ValueError(f"corpus_seed must be a non-negative int, got {corpus_seed!r}")
    if isinstance(size, bool) or not isinstance(size, int) or not 1024 <= size <= 64 << 20:
        raise ValueError(f"corpus size must be an int in [1 KiB, 64 MiB], got {size!r}")
    g = _Grammar(corpus_seed)
    parts: list[str] = []
    n = 0
    while n < size:
        para = " ".join(g.sentence() for _ in range(1 + int(g.rng.random() * 5))) + "\n"
        parts.append(para)
        n += len(para)  # ASCII only, so characters are bytes
    arr = np.frombuffer("".join(parts).encode("ascii")[:size], dtype=np.uint8)
    arr.flags.writeable = False
    return arr


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def batch(
    corpus_seed: int,
    step: int,
    micro_batch: int,
    micro_batch_size: int,
    seq_len: int,
    corpus_bytes: int = DEFAULT_CORPUS_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro_batch`` of step ``step``: ``(inputs, targets)``, both LongTensor ``[B, T]``.

    Targets are the inputs shifted by one byte. Window offsets are drawn from a generator seeded by
    ``(corpus_seed, step, micro_batch)`` only.
    """
    _check_int("step", step, 0)
    _check_int("micro_batch", micro_batch, 0)
    _check_int("micro_batch_size", micro_batch_size, 1)
    _check_int("seq_len", seq_len, 1)
    data = corpus(corpus_seed, corpus_bytes)
    if seq_len + 1 > len(data):
        raise ValueError(f"seq_len={seq_len} does not fit a corpus of {len(data)} bytes")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([corpus_seed, step, micro_batch])))
    starts = rng.integers(0, len(data) - seq_len, size=micro_batch_size)
    windows = torch.from_numpy(data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def global_batch(
    corpus_seed: int,
    step: int,
    num_micro_batches: int,
    micro_batch_size: int,
    seq_len: int,
    corpus_bytes: int = DEFAULT_CORPUS_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batches ``0..num_micro_batches-1`` of ``step`` concatenated in order (single-process reference)."""
    _check_int("num_micro_batches", num_micro_batches, 1)
    parts = [
        batch(corpus_seed, step, m, micro_batch_size, seq_len, corpus_bytes) for m in range(num_micro_batches)
    ]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
