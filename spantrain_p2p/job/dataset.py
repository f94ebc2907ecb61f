"""The run's data: the generated corpus (``data.generated``, the default) or a local data set with its
tokenizer (``corpus``, ``tokenizer``), behind one ``batch(step, micro_batch)``.

The peer that starts the swarm names the data set (``--data``) and tokenizer (``--tokenizer``);
``with_data`` puts their fingerprints in the job (and sizes the model's vocabulary to the
tokenizer's where the job did not say). Every peer then opens its own copy (``open_data``: its own
``--data``, else the path the job names if it exists here) and refuses the job, saying why, when
its copy or tokenizer hashes to anything else; a peer with no copy fetches the shards its batches
need from peers that have one (``data.share``). Batches stay addressed by (seed, step,
micro-batch), identical on every peer.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

import torch

from ..data import generated
from .spec import BUILTIN, JobRefused, JobSpec, ModelHandle, is_hf_preset

def _vocab_arg(job: JobSpec) -> Optional[str]:
    """The model argument that sizes the vocabulary, for models whose vocabulary a job may set."""
    if job.model == BUILTIN:
        return "vocab"
    if is_hf_preset(job.model):
        return "vocab_size"  # a preset's config; a directory's pretrained weights fix theirs
    return None


def with_data(job: JobSpec, data: str, tokenizer: str, cache_dir: Optional[str] = None) -> JobSpec:
    """``job`` with the data set and tokenizer named, their fingerprints filled in, and the model's
    vocabulary the tokenizer's (unless the job set it). Reads and tokenizes the data (cached)."""
    from ..data.corpus import open_corpus
    from ..data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    corpus = open_corpus(data, tok, cache_dir=cache_dir)
    args = dict(job.model_args)
    key = _vocab_arg(job)
    if key is not None and key not in args and tok.vocab_size != 256:
        args[key] = tok.vocab_size
    job = replace(job, data=data, tokenizer=tokenizer, data_fingerprint=corpus.fingerprint,
                  tokenizer_fingerprint=tok.fingerprint, model_args=args)
    vocab = _model_vocab(job)
    if vocab is not None and tok.vocab_size > vocab:
        raise ValueError(f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens, the model's vocabulary only {vocab}: "
                         f"train a tokenizer of at most {vocab} tokens (spantrain tokenizer --vocab {vocab})")
    return job


def _model_vocab(job: JobSpec) -> Optional[int]:
    """How many token ids the job's model embeds (None: a user model, unknown)."""
    handle = ModelHandle(job)
    if job.model == BUILTIN:
        return handle._config().vocab
    return handle.hf.config.vocab_size if handle.hf is not None else None


class RunData:
    """The job's batches on this peer: ``batch(step, micro_batch) -> (inputs, targets)``. With a
    data set, ``corpus`` is this peer's copy; ``lacking``: it has none and fetches the shards it
    needs from other peers (``data.share``) before it cuts their batches."""

    def __init__(self, job: JobSpec, corpus=None, lacking: bool = False, cache_dir: Optional[str] = None):
        self.job, self.corpus, self.lacking, self.cache_dir = job, corpus, lacking, cache_dir

    def batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        job = self.job
        if not job.data:
            return generated.batch(job.seed, step, mb, job.micro_batch_size, job.seq_len)
        if self.corpus is None:
            raise RuntimeError("the data set's manifest has not been fetched yet (data.share.ensure)")
        return self.corpus.batch(job.seed, step, mb, job.micro_batch_size, job.seq_len)


def _exists(data: str) -> bool:
    return data == "stdlib" or os.path.exists(data)


def open_data(job: JobSpec, data: Optional[str] = None, tokenizer: Optional[str] = None,
              cache_dir: Optional[str] = None) -> RunData:
    """The job's data on this peer. ``data`` and ``tokenizer``: this peer's copies (default: the
    paths the job names); ``cache_dir``: where its tokenized shards are kept. JobRefused if this peer's copy or tokenizer differs from the swarm's; a
    peer with no copy at all gets a ``lacking`` one (it fetches shards from others)."""
    if not job.data:
        return RunData(job)
    from ..data.corpus import open_corpus
    from ..data.tokenizer import load_tokenizer

    data, tokenizer = data or job.data, tokenizer or job.tokenizer
    if not _exists(data):
        return RunData(job, lacking=True, cache_dir=cache_dir)
    try:
        tok = load_tokenizer(tokenizer)
    except ValueError as e:
        raise JobRefused(f"the job's tokenizer: {e}") from None
    if tok.fingerprint != job.tokenizer_fingerprint:
        raise JobRefused(f"tokenizer {tokenizer!r} here differs from the swarm's (fingerprint {tok.fingerprint[:12]} "
                         f"vs {job.tokenizer_fingerprint[:12]})")
    try:
        corpus = open_corpus(data, tok, cache_dir=cache_dir)
    except ValueError as e:
        raise JobRefused(f"this peer cannot read its copy of the job's data set {data!r}: {e}") from None
    if corpus.fingerprint != job.data_fingerprint:
        raise JobRefused(f"data set {data!r} here differs from the swarm's (fingerprint {corpus.fingerprint[:12]} "
                         f"vs {job.data_fingerprint[:12]}): a different copy or version of the files")
    return RunData(job, corpus, cache_dir=cache_dir)
