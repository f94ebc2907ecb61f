"""``spantrain tokenizer``: train a byte-level BPE on a local data set, then tokenize the data set with it.

Tokenizing afterwards gives the figures a user wants (tokens, bytes per token) and leaves the
data set's shards in the cache, so a job with ``--data PATH --tokenizer OUT`` starts without
tokenizing again.
"""
from __future__ import annotations

import argparse
import json


def add_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, metavar="PATH",
                   help="a text file, a folder of text files, a .jsonl with a 'text' field, a .parquet with a "
                   "'text' column, or 'stdlib' (the Python standard library's .py files)")
    p.add_argument("--vocab", required=True, type=int, metavar="N", help="vocabulary size, special token included")
    p.add_argument("--out", required=True, metavar="FILE", help="where the tokenizer.json goes")
    p.add_argument("--max-bytes", type=int, default=None, metavar="N", help="train on the first N bytes of text only")
    p.add_argument("--suffix", action="append", default=None, metavar=".EXT",
                   help="in a folder, read only files with this suffix (repeatable)")
    p.add_argument("--min-frequency", type=int, default=2, metavar="N", help="merge pairs seen at least N times")
    p.add_argument("--data-cache", default=None, metavar="DIR",
                   help="where the tokenized data set is kept (default: $SPANTRAIN_CACHE/data or ~/.cache/spantrain/data)")
    p.add_argument("--json", action="store_true", help="print one JSON summary on the last line of stdout")
    p.add_argument("-v", "--verbose", action="count", default=0)


def tokenizer_command(args: argparse.Namespace) -> int:
    from ..data.corpus import open_corpus
    from ..data.tokenizer import load_tokenizer, train_bpe

    trained = train_bpe(args.data, args.vocab, args.out, max_bytes=args.max_bytes, suffixes=args.suffix,
                        min_frequency=args.min_frequency)
    corpus = open_corpus(args.data, load_tokenizer(trained.path), cache_dir=args.data_cache,
                         max_bytes=args.max_bytes, suffixes=args.suffix)
    tokenize_s = float(corpus.stats.get("tokenize_s", 0.0))
    per_token = trained.text_bytes / corpus.tokens
    print(f"{trained.path}: vocab {trained.vocab_size}, trained on {trained.text_bytes / 2**20:.2f} MiB "
          f"({trained.documents} documents) in {trained.seconds:.2f} s; the data is {corpus.tokens} tokens "
          f"({per_token:.2f} bytes/token, tokenized in {tokenize_s:.2f} s), data set {corpus.fingerprint[:12]}",
          flush=True)
    if args.json:
        print(json.dumps({"out": trained.path, "vocab": trained.vocab_size, "tokenizer": trained.fingerprint,
                          "text_bytes": trained.text_bytes, "documents": trained.documents,
                          "train_s": round(trained.seconds, 3), "tokens": corpus.tokens,
                          "bytes_per_token": round(per_token, 3), "tokenize_s": tokenize_s,
                          "data": corpus.fingerprint, "shards": corpus.num_shards}), flush=True)
    return 0
