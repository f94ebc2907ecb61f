"""The run's data: the generated corpus (``train.data``, the default) or a local data set with its
tokenizer (``corpus``, ``tokenizer``), behind one ``batch(step, micro_batch)``.

The peer that starts the swarm names the data set (``--data``) and tokenizer (``--tokenizer``);
``with_data`` puts their fingerprints in the job (and sizes the model's vocabulary to the
tokenizer's where the job did not say). Every peer then opens its own copy (``open_data``: its own
``--data``, else the path the job names if it exists here) and refuses the job, saying why, when
its copy or tokenizer hashes to anything else. Batches stay addressed by (seed, step, micro-batch),
identical on every peer.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable, Optional

import torch

from . import data as generated
from .job import BUILTIN, JobRefused, JobSpec

Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def _vocab_arg(job: JobSpec) -> Optional[str]:
    """The model argument that sizes the vocabulary, for models whose vocabulary a job may set."""
    if job.model == BUILTIN:
        return "vocab"
    if job.model.startswith("hf:") and not os.path.isdir(job.model[3:]):
        return "vocab_size"  # a preset's config; a directory's pretrained weights fix theirs
    return None


def with_data(job: JobSpec, data: str, tokenizer: str) -> JobSpec:
    """``job`` with the data set and tokenizer named, their fingerprints filled in, and the model's
    vocabulary the tokenizer's (unless the job set it). Reads and tokenizes the data (cached)."""
    from .corpus import open_corpus
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    corpus = open_corpus(data, tok)
    args = dict(job.model_args)
    key = _vocab_arg(job)
    if key is not None and key not in args and tok.vocab_size != 256:
        args[key] = tok.vocab_size
    return replace(job, data=data, tokenizer=tokenizer, data_fingerprint=corpus.fingerprint,
                   tokenizer_fingerprint=tok.fingerprint, model_args=args)


def open_data(job: JobSpec, data: Optional[str] = None, tokenizer: Optional[str] = None) -> Batch:
    """The job's batches on this peer: ``(step, micro_batch) -> (inputs, targets)``. ``data`` and
    ``tokenizer``: this peer's copies (default: the paths the job names). JobRefused if this
    peer's copy differs from the swarm's, or it has none."""
    B, T, seed = job.micro_batch_size, job.seq_len, job.seed
    if not job.data:
        return lambda step, mb: generated.batch(seed, step, mb, B, T)
    from .corpus import open_corpus
    from .tokenizer import load_tokenizer

    data, tokenizer = data or job.data, tokenizer or job.tokenizer
    try:
        tok = load_tokenizer(tokenizer)
    except ValueError as e:
        raise JobRefused(f"the job's tokenizer: {e}") from None
    if tok.fingerprint != job.tokenizer_fingerprint:
        raise JobRefused(f"tokenizer {tokenizer!r} here differs from the swarm's (fingerprint {tok.fingerprint[:12]} "
                         f"vs {job.tokenizer_fingerprint[:12]})")
    try:
        corpus = open_corpus(data, tok)
    except ValueError as e:
        raise JobRefused(f"this peer has no usable copy of the job's data set {data!r} ({e}); pass --data PATH") \
            from None
    if corpus.fingerprint != job.data_fingerprint:
        raise JobRefused(f"data set {data!r} here differs from the swarm's (fingerprint {corpus.fingerprint[:12]} "
                         f"vs {job.data_fingerprint[:12]}): a different copy or version of the files")
    return lambda step, mb: corpus.batch(seed, step, mb, B, T)
