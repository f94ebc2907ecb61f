"""Data: text, tokens and batches addressed by (seed, step, micro-batch); nothing is downloaded.

- ``generated``: the default corpus, English-like text from a seeded grammar;
- ``text_sources``: reading a local data set (file, directory, JSON Lines, Parquet, ``stdlib``);
- ``tokenizer``: the tokenizers a job can name, with fingerprints, and a local BPE trainer;
- ``corpus``: a data set as content-addressed token shards, and its batches;
- ``share``: shards fetched from peers that have them, hash-checked.
"""
