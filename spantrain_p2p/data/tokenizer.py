"""Tokenizers a job can name, each with a fingerprint, and a local byte-level BPE trainer.

``load_tokenizer(spec)`` takes:

- ``bytes``: the byte tokens of ``data.generated`` (vocab 256, the UTF-8 bytes of the text);
- a ``tokenizers`` ``tokenizer.json`` file;
- a transformers tokenizer directory, loaded with ``AutoTokenizer`` from that directory only
  (``local_files_only=True``): nothing is downloaded, a name with no local copy fails at once.

Every tokenizer has a ``fingerprint``: the sha256 of what defines it (the JSON file's bytes, or
the tokenizer files of a directory, by name), prefixed by its kind, so two peers that encode the
same text differently never agree on a data set. ``eos_id`` is the token put between documents
when a corpus is cut into one stream (``None``: documents are simply concatenated).

``train_bpe`` trains a GPT-2-style byte-level BPE with ``tokenizers`` on a local data set. The
trainer is deterministic for the same input: trained twice, in two processes (each with its own
hash seed), the saved file is byte-identical; ``tests/test_tokenizer.py`` pins that.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

BYTES = "bytes"
EOS_TOKEN = "<|endoftext|>"
# Special tokens looked up (in this order) to separate documents in a tokenizer.json we did not train.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
# Files that define a transformers tokenizer: what the fingerprint of a directory covers
# (a model directory also holds weights, which must not change the tokenizer's fingerprint).
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
)


class TokenizerError(ValueError):
    """A tokenizer could not be loaded or trained; the message says why."""


def _sha256(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


class Tokenizer:
    """What a corpus needs of a tokenizer: a name, a vocabulary size, a fingerprint, encoding."""

    kind: str = ""
    name: str = ""
    vocab_size: int = 0
    fingerprint: str = ""
    eos_id: Optional[int] = None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as int64 arrays."""
        raise NotImplementedError

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def describe(self) -> dict:
        return {"kind": self.kind, "name": self.name, "vocab_size": self.vocab_size,
                "fingerprint": self.fingerprint, "eos_id": self.eos_id}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab={self.vocab_size}, fp={self.fingerprint[:12]})"


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text, as ``data.generated`` feeds the built-in model; documents joined by ``\\n``."""

    kind = BYTES
    name = BYTES
    vocab_size = 256
    fingerprint = _sha256(b"spantrain-tokenizer", b"bytes", b"v1")
    eos_id = ord("\n")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]


class JsonTokenizer(Tokenizer):
    """A ``tokenizers`` ``tokenizer.json``."""

    kind = "tokenizers"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        raw = path.read_bytes()
        try:
            self._tok = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception types
            raise TokenizerError(f"{path}: not a tokenizers tokenizer.json ({e})") from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = _sha256(b"spantrain-tokenizer", b"tokenizers", raw)
        self.eos_id = next((i for t in _EOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]


class TransformersTokenizer(Tokenizer):
    """A transformers tokenizer directory, loaded with ``AutoTokenizer`` from that directory only."""

    kind = "transformers"

    def __init__(self, path: Path) -> None:
        files = [(n, (path / n).read_bytes()) for n in _TOKENIZER_FILES if (path / n).is_file()]
        if not files:
            raise TokenizerError(f"{path}: no tokenizer files in this directory (looked for {', '.join(_TOKENIZER_FILES)})")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, ... depending on what is missing
            raise TokenizerError(f"{path}: AutoTokenizer could not load it from the local files ({e})") from None
        self.name = str(path)
        self.vocab_size = len(self._tok)
        self.fingerprint = _sha256(b"spantrain-tokenizer", b"transformers", *(p for n, b in files for p in (n.encode(), b)))
        self.eos_id = self._tok.eos_token_id

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # verbose=False: a corpus piece is far longer than model_max_length, which is no error here
        ids = self._tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]


def load_tokenizer(spec: Union[str, Path]) -> Tokenizer:
    """``bytes``, a tokenizer.json file, or a transformers tokenizer directory; local files only."""
    if str(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        return TransformersTokenizer(path)
    if path.is_file():
        return JsonTokenizer(path)
    raise TokenizerError(
        f"tokenizer {str(spec)!r}: no such file or directory (give 'bytes', a tokenizer.json, or a local "
        "transformers tokenizer directory; nothing is downloaded)")


@dataclass(frozen=True)
class TrainedTokenizer:
    path: str
    vocab_size: int
    fingerprint: str
    text_bytes: int  # UTF-8 bytes of text trained on
    documents: int
    seconds: float


def train_bpe(
    texts: Union[str, Path, Iterable[str]],
    vocab_size: int,
    out_path: Union[str, Path],
    *,
    max_bytes: Optional[int] = None,
    suffixes: Optional[Sequence[str]] = None,
    min_frequency: int = 2,
) -> TrainedTokenizer:
    """Train a byte-level BPE (GPT-2 style, ``<|endoftext|>`` as token 0) and save it to ``out_path``.

    ``texts`` is a data set (a path or ``stdlib``) as ``text_sources.read_pieces`` reads it, with
    ``max_bytes`` and ``suffixes`` as there; or an iterable of documents. The output is written
    atomically and is the same file for the same input and arguments. The vocabulary may come out
    smaller than ``vocab_size`` when the text has too few pairs seen ``min_frequency`` times.
    """
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from ..files import atomic_write_bytes
    from .text_sources import ReadStats, read_pieces

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not len(alphabet) + 1 <= vocab_size <= 1 << 20:
        raise TokenizerError(f"vocab size must be an int in [{len(alphabet) + 1}, {1 << 20}], not {vocab_size!r}")
    stats = ReadStats()
    if isinstance(texts, (str, Path)):
        docs: Iterable[str] = (p.text for p in read_pieces(texts, max_bytes=max_bytes, suffixes=suffixes, stats=stats))
    else:
        docs = texts
    counted = {"bytes": 0, "docs": 0}

    def counting() -> Iterable[str]:
        for d in docs:
            counted["bytes"] += len(d.encode("utf-8"))
            counted["docs"] += 1
            yield d

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    t0 = time.perf_counter()
    tok.train_from_iterator(counting(), trainer)
    seconds = time.perf_counter() - t0
    if counted["bytes"] == 0:
        raise TokenizerError("no text to train a tokenizer on")
    documents = stats.documents if isinstance(texts, (str, Path)) else counted["docs"]
    raw = tok.to_str(pretty=True).encode("utf-8")
    out = Path(out_path)
    atomic_write_bytes(out, raw)
    return TrainedTokenizer(path=str(out), vocab_size=tok.get_vocab_size(with_added_tokens=True),
                            fingerprint=JsonTokenizer(out).fingerprint, text_bytes=counted["bytes"],
                            documents=documents, seconds=seconds)
