"""Tokenizers a job can name (bytes, tokenizer.json, a transformers folder), their fingerprints, local BPE training."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spantrain_p2p.data import generated as data
from spantrain_p2p.data.tokenizer import EOS_TOKEN, ByteTokenizer, TokenizerError, load_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[1]
TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + len('the quick brown fox')\n\n" for i in range(300))


@pytest.fixture
def corpus_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.py").write_text(TEXT)
    (d / "b.txt").write_text(data.corpus(3, 32 << 10).tobytes().decode())  # seeded English-like text
    return d


def _sha(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def test_bytes_are_the_utf8_bytes_with_a_vocabulary_of_256():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    assert tok.encode("hé\n").tolist() == list("hé\n".encode())
    assert tok.fingerprint == load_tokenizer("bytes").fingerprint


def test_a_trained_bpe_loads_encodes_and_decodes(corpus_dir, tmp_path):
    trained = train_bpe(corpus_dir, 400, tmp_path / "tok.json")
    assert trained.vocab_size == 400 and trained.documents == 2 and trained.text_bytes > 10_000
    tok = load_tokenizer(trained.path)
    assert tok.kind == "tokenizers" and tok.vocab_size == 400 and tok.fingerprint == trained.fingerprint
    assert tok.eos_id == 0  # <|endoftext|>, the one special token
    ids = tok.encode("def function_7(x):")
    assert len(ids) < len("def function_7(x):") and ids.max() < 400
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(trained.path).decode(ids.tolist()) == "def function_7(x):"


def test_bpe_training_is_deterministic_across_processes(corpus_dir, tmp_path):
    """Two processes (each with its own hash seed) write byte-identical tokenizer files."""
    train_bpe(corpus_dir, 500, tmp_path / "here.json")
    code = ("import sys; from spantrain_p2p.data.tokenizer import train_bpe; "
            "train_bpe(sys.argv[1], 500, sys.argv[2])")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, str(corpus_dir), str(tmp_path / "there.json")], cwd=ROOT, env=env,
                   check=True, timeout=60)
    assert _sha(tmp_path / "here.json") == _sha(tmp_path / "there.json")
    train_bpe(corpus_dir, 450, tmp_path / "smaller.json")
    assert _sha(tmp_path / "smaller.json") != _sha(tmp_path / "here.json")


def test_a_transformers_tokenizer_folder_loads_from_local_files_only(corpus_dir, tmp_path):
    from transformers import PreTrainedTokenizerFast

    trained = train_bpe(corpus_dir, 400, tmp_path / "tok.json")
    folder = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_file=trained.path, eos_token=EOS_TOKEN).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"weights do not change the tokenizer's fingerprint")
    tok = load_tokenizer(folder)
    assert tok.kind == "transformers" and tok.vocab_size == 400 and tok.eos_id == 0
    assert tok.encode(TEXT[:200]).tolist() == load_tokenizer(trained.path).encode(TEXT[:200]).tolist()
    fp = tok.fingerprint
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert load_tokenizer(folder).fingerprint == fp
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 77}))
    assert load_tokenizer(folder).fingerprint != fp


def test_a_missing_or_wrong_tokenizer_fails_at_once_with_a_clear_message(tmp_path):
    with pytest.raises(TokenizerError, match="no such file or directory.*nothing is downloaded"):
        load_tokenizer("gpt2")  # a hub name with no local copy
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a tokenizers tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(TokenizerError, match="vocab size"):
        train_bpe(tmp_path, 10, tmp_path / "x.json")


def test_spantrain_tokenizer_trains_on_a_folder_and_prints_a_summary(corpus_dir, tmp_path):
    out = tmp_path / "tok.json"
    env = {**os.environ, "SPANTRAIN_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "tokenizer", "--data", str(corpus_dir), "--vocab", "400",
                        "--out", str(out), "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line, js = r.stdout.strip().splitlines()[-2:]
    assert "vocab 400" in line and "tokens" in line and " s" in line
    summary = json.loads(js)
    assert summary["vocab"] == 400 and summary["tokens"] > 0 and summary["tokenizer"] == load_tokenizer(out).fingerprint
    assert summary["bytes_per_token"] > 1.5
    assert (tmp_path / "cache" / "data" / "manifests" / f"{summary['data']}.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "spantrain_p2p", "tokenizer", "--data", str(tmp_path / "nope"),
                          "--vocab", "400", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and "no such file or directory" in bad.stderr
