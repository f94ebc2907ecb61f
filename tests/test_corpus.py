"""A local data set: its formats, its content-addressed shards and cache, and its batches by (seed, step, mb)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from spantrain_p2p.data import corpus as corpus_lib
from spantrain_p2p.data.corpus import DataError, Manifest, open_corpus, open_manifest
from spantrain_p2p.data.text_sources import ReadStats, read_documents, read_pieces, stdlib_corpus_dir
from spantrain_p2p.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

TEXT = "".join(f"Line {i}: the quick brown fox {i * 7 % 13} jumps over the lazy dog.\n" for i in range(400))


def _stream(c) -> np.ndarray:
    return c.tokens_at(0, c.tokens)


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("bravo\n")
    (d / "a.md").write_text("alpha\n")
    (d / "sub" / "c.py").write_text("print('charlie')\n")
    (d / "image.bin").write_bytes(b"\x89PNG\0\0\x01binary")
    (d / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (d / ".hidden").write_text("never read\n")
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "x.txt").write_text("never read\n")
    return d


def test_a_text_file_is_its_utf8_bytes_with_byte_tokens(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    c = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "cache")
    assert _stream(c).tolist() == list(TEXT.encode()) + [ord("\n")]  # eos after the one document


def test_a_directory_reads_text_files_recursively_in_sorted_order_and_counts_skipped_binaries(text_dir, tmp_path):
    stats = ReadStats()
    docs = list(read_documents(text_dir, stats=stats))
    assert docs == ["alpha\n", "bravo\n", "print('charlie')\n"]
    assert stats.files == 3 and sorted(p.rsplit("/", 1)[1] for p in stats.skipped) == ["image.bin", "latin1.txt"]
    assert list(read_documents(text_dir, suffixes=[".py"])) == ["print('charlie')\n"]
    c = open_corpus(text_dir, ByteTokenizer(), cache_dir=tmp_path / "cache")
    assert c.stats["skipped_files"] == 2 and c.tokens == len("alpha\nbravo\nprint('charlie')\n") + 3


def test_a_lone_binary_file_is_refused_with_a_clear_error(text_dir):
    with pytest.raises(DataError, match="not UTF-8 text"):
        list(read_documents(text_dir / "latin1.txt"))
    with pytest.raises(DataError, match="no such file or directory"):
        list(read_documents(text_dir / "missing"))


def test_json_lines_read_the_text_field_and_count_rows_without_one(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"text": "one"}, {"id": 2}, {"text": "two", "x": 1}, {"text": None}]))
    stats = ReadStats()
    assert list(read_documents(f, stats=stats)) == ["one", "two"]
    assert stats.skipped_rows == 2 and stats.documents == 2
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not JSON"):
        list(read_documents(tmp_path / "bad.jsonl"))


def test_parquet_reads_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["first", None, "second"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    stats = ReadStats()
    assert list(read_documents(tmp_path / "d.parquet", stats=stats)) == ["first", "second"]
    assert stats.skipped_rows == 1
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no_text.parquet")
    with pytest.raises(DataError, match="no 'text' column"):
        list(read_documents(tmp_path / "no_text.parquet"))


def _save_to_disk(pa, folder, texts_per_file):
    """What ``datasets.Dataset.save_to_disk`` writes (datasets 2-4): Arrow IPC streams, the files in
    state.json's order, and dataset_info.json."""
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(texts_per_file):05d}.arrow" for i in range(len(texts_per_file))]
    for name, texts in zip(names, texts_per_file):
        table = pa.table({"text": texts, "id": list(range(len(texts)))})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table, max_chunksize=2)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "x", "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")


def test_a_datasets_dataset_saved_to_disk_reads_its_text_column_in_its_files_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    _save_to_disk(pa, tmp_path / "ds", [["one", "two", None], ["three"]])
    stats = ReadStats()
    assert list(read_documents(tmp_path / "ds", stats=stats)) == ["one", "two", "three"]
    assert stats.files == 2 and stats.skipped_rows == 1
    # a DatasetDict: its train split
    _save_to_disk(pa, tmp_path / "dd" / "train", [["t1", "t2"]])
    _save_to_disk(pa, tmp_path / "dd" / "test", [["x"]])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert list(read_documents(tmp_path / "dd")) == ["t1", "t2"]
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(DataError, match="without a 'train' split"):
        list(read_documents(tmp_path / "dd"))
    (tmp_path / "ds" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../x.arrow"}]}))
    with pytest.raises(DataError, match="not an Arrow file of this folder"):
        list(read_documents(tmp_path / "ds"))


def test_parquet_without_pyarrow_says_it_needs_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="Parquet needs pyarrow"):
        list(read_documents(tmp_path / "d.parquet"))


def test_max_bytes_keeps_the_first_bytes_of_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    assert "".join(read_documents(f, max_bytes=100)) == TEXT[:100]
    c = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "cache", max_bytes=100)
    assert c.tokens == 101


def test_large_documents_come_in_pieces_cut_after_a_newline(tmp_path, monkeypatch):
    monkeypatch.setattr("spantrain_p2p.data.text_sources.PIECE_CHARS", 1000)
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    pieces = list(read_pieces(f))
    assert len(pieces) > 10 and "".join(p.text for p in pieces) == TEXT
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(p.text.endswith("\n") for p in pieces)


def test_a_batch_is_the_same_on_two_fresh_loads_and_differs_with_seed_and_step(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    a = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c1", shard_tokens=1000)
    b = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c2", shard_tokens=1000)
    assert a.fingerprint == b.fingerprint and a.num_shards > 10
    x, y = a.batch(7, 3, 1, 4, 64)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    xb, yb = b.batch(7, 3, 1, 4, 64)
    assert torch.equal(x, xb) and torch.equal(y, yb)
    for other in (a.batch(8, 3, 1, 4, 64), a.batch(7, 4, 1, 4, 64), a.batch(7, 3, 2, 4, 64)):
        assert not torch.equal(x, other[0])
    gx, _ = a.global_batch(7, 3, 2, 4, 64)
    assert torch.equal(gx[4:], x)


def test_byte_corpus_batches_draw_windows_like_train_data(tmp_path):
    """Same offsets generator as data.generated.batch: windows start where data.batch's would."""
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    c = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([5, 2, 0])))
    starts = rng.integers(0, c.tokens - 16, size=3)
    x, _ = c.batch(5, 2, 0, 3, 16)
    stream = list(TEXT.encode()) + [10]
    assert x.tolist() == [stream[s:s + 16] for s in starts]


def test_shards_for_names_exactly_the_shards_a_batch_reads(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    full = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "full", shard_tokens=512)
    assert _stream(full).tolist() == list(TEXT.encode()) + [ord("\n")]  # shards cut the stream, nothing lost
    assert [full.manifest.shard_len(i) for i in range(full.num_shards)][:-1] == [512] * (full.num_shards - 1)
    need = full.shards_for(1, 9, 0, 3, 100)
    assert need and need < set(range(full.num_shards))
    partial = open_manifest(full.manifest.to_dict(), tmp_path / "partial")  # a peer with the manifest only
    assert partial.missing_shards() == list(range(full.num_shards))
    for i in need:
        partial.add_shard(i, full.shard_bytes(i))
    x, y = partial.batch(1, 9, 0, 3, 100)
    assert torch.equal(x, full.batch(1, 9, 0, 3, 100)[0])
    other = next(i for i in range(full.num_shards) if i not in need)
    with pytest.raises(DataError, match=f"shard {other} of data set .* is not in"):
        partial.shard(other)


def test_a_corrupted_shard_is_refused_with_a_clear_message(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    c = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c", shard_tokens=4096)
    p = c.shard_path(1)
    good = p.read_bytes()
    data = bytearray(good)
    data[10] ^= 1
    p.write_bytes(bytes(data))
    fresh = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c", shard_tokens=4096)
    assert fresh.stats.get("cached")
    with pytest.raises(DataError, match=r"shard 1 of data set .* this copy of the data differs .*delete it"):
        fresh.verify()
    with pytest.raises(DataError, match="this copy of the data differs"):
        fresh.add_shard(1, bytes(data))
    fresh.add_shard(1, good)  # the right bytes, from a peer that has them
    fresh.verify()


def test_the_cache_spares_tokenizing_again_and_sees_a_changed_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    first = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c")

    class Refusing(ByteTokenizer):
        def encode_batch(self, texts):
            raise AssertionError("tokenized again")

    again = open_corpus(f, Refusing(), cache_dir=tmp_path / "c")
    assert again.fingerprint == first.fingerprint and again.stats["cached"]
    f.write_text(TEXT + "one more line\n")
    changed = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    assert changed.fingerprint != first.fingerprint and changed.tokens == first.tokens + 14


def test_the_fingerprint_changes_with_the_data_and_with_the_tokenizer(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    g = tmp_path / "u.txt"
    g.write_text(TEXT.replace("fox", "cat"))
    tok = load_tokenizer(train_bpe(f, 300, tmp_path / "tok.json").path)
    fps = {open_corpus(p, t, cache_dir=tmp_path / "c").fingerprint for p in (f, g) for t in (ByteTokenizer(), tok)}
    assert len(fps) == 4
    assert open_corpus(f, tok, cache_dir=tmp_path / "c2").manifest.tokenizer == tok.fingerprint


def test_a_manifest_from_elsewhere_is_validated(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    m = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c").manifest.to_dict()
    assert Manifest.from_dict(dict(m)).fingerprint == Manifest.from_dict(json.loads(json.dumps(m))).fingerprint
    for bad in ({**m, "shards": m["shards"] + m["shards"]}, {**m, "dtype": "float32"}, {**m, "extra": 1},
                {**m, "shards": ["x" * 64]}, {**m, "tokens": -1}, "not a map"):
        with pytest.raises(DataError):
            Manifest.from_dict(bad)


def test_batches_too_long_for_the_data_are_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("tiny")
    c = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="does not fit"):
        c.batch(0, 0, 0, 1, 5)
    with pytest.raises(DataError, match="no text"):
        (tmp_path / "empty.txt").write_text("")
        open_corpus(tmp_path / "empty.txt", load_tokenizer(train_bpe(f, 260, tmp_path / "t.json").path),
                    cache_dir=tmp_path / "c")


def test_the_stdlib_demo_corpus_is_here_and_tokenizes(tmp_path):
    assert (stdlib_corpus_dir() / "os.py").is_file()
    c = open_corpus("stdlib", ByteTokenizer(), cache_dir=tmp_path / "c", max_bytes=64 << 10)
    assert c.tokens > 64 << 10 and c.stats["files"] >= 1
    assert corpus_lib.SHARD_BYTES // 2 == c.manifest.shard_tokens


def test_peers_opening_one_source_at_once_tokenize_it_once(tmp_path):
    import threading

    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    calls = []

    class Counting(ByteTokenizer):
        def encode_batch(self, texts):
            calls.append(len(texts))
            return super().encode_batch(texts)

    out = []
    threads = [threading.Thread(target=lambda: out.append(open_corpus(f, Counting(), cache_dir=tmp_path / "c")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({c.fingerprint for c in out}) == 1
    assert sum(bool(c.stats.get("cached")) for c in out) == 2


def test_a_cached_manifest_that_does_not_hash_to_its_name_is_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    c = open_corpus(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    p = tmp_path / "c" / "manifests" / f"{c.fingerprint}.json"
    p.write_text(json.dumps({**c.manifest.to_dict(), "tokens": c.tokens - 1}))
    with pytest.raises(DataError, match="not its name"):
        open_manifest(c.fingerprint, tmp_path / "c")
