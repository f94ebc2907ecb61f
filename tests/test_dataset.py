"""A swarm trains on a local data set with a locally trained tokenizer exactly like one process;
a peer with another copy of the data or another tokenizer refuses, saying why; bf16 trains like
fp32 with 2-byte activations on the wire."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from spantrain_p2p.train.dataset import open_data, with_data
from spantrain_p2p.train.job import JobRefused, JobSpec
from spantrain_p2p.train.reference import reference_run
from spantrain_p2p.train.tokenizer import train_bpe

TEXT = ("The planner places the stages where the links are fast. Activations cross the slow links, "
        "compressed as much as each link needs. Replicas sum their gradients inside a region. ")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (d / f"doc{i}.txt").write_text("".join(f"{TEXT} Paragraph {i}.{j}: {TEXT[j:] }\n" for j in range(40)))
    tok = d.parent / "tokenizer.json"
    train_bpe(str(d), 400, str(tok))
    return str(d), str(tok)


def test_the_job_carries_the_fingerprints_and_a_vocabulary_the_size_of_the_tokenizer_s(corpus):
    data, tok = corpus
    job = with_data(JobSpec(), data, tok)
    assert len(job.data_fingerprint) == 64 and len(job.tokenizer_fingerprint) == 64
    assert 256 < job.model_args["vocab"] <= 400
    x, y = open_data(job)(3, 1)
    assert x.shape == (job.micro_batch_size, job.seq_len) and int(x.max()) < job.model_args["vocab"]
    assert (x[:, 1:] == y[:, :-1]).all()


def test_a_peer_with_another_copy_of_the_data_or_another_tokenizer_refuses(corpus, tmp_path):
    data, tok = corpus
    job = with_data(JobSpec(), data, tok)
    other = tmp_path / "other"
    other.mkdir()
    (other / "doc.txt").write_text(TEXT * 50)
    with pytest.raises(JobRefused, match="data set .* differs from the swarm's"):
        open_data(job, data=str(other))
    with pytest.raises(JobRefused, match="tokenizer 'bytes' here differs"):
        open_data(job, tokenizer="bytes")
    with pytest.raises(JobRefused, match="no usable copy"):
        open_data(job, data=str(tmp_path / "missing"))


def _swarm(tmp_path, *args):
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "swarm", "--scenario", "peers/lan-4.toml",
                        "--plan", "even", "--no-measure", "--json", "--run-dir", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_four_peers_train_on_a_local_corpus_like_one_process(corpus, tmp_path):
    data, tok = corpus
    steps = 15
    summary = _swarm(tmp_path, "--steps", str(steps), "--stages", "2", "--data", data, "--tokenizer", tok)
    assert [len(s["peers"]) for s in summary["plan"]["stages"]] == [2, 2]
    ref, _ = reference_run(with_data(JobSpec(steps=steps), data, tok), steps)
    worst = max(abs(a - b) / b for a, b in zip(summary["losses"], ref))
    print(f"\nlocal corpus, BPE tokenizer, 2 stages x 2 replicas: worst loss rel. error {worst:.2e} over {steps} steps")
    assert len(summary["losses"]) == steps and worst <= 1e-4


def test_bf16_trains_within_two_percent_of_fp32_with_two_byte_activations(tmp_path):
    steps, job = 100, JobSpec(steps=100)
    summary = _swarm(tmp_path, "--steps", str(steps), "--stages", "4", "--precision", "bf16")
    fp32, _ = reference_run(job, steps)
    bf16_ref, _ = reference_run(replace(job, precision="bf16"), steps)
    last = sum(summary["losses"][-10:]) / 10
    gap = abs(last / (sum(fp32[-10:]) / 10) - 1)
    # 3 boundaries x 4 micro-batches x (activation + its gradient) of 4 x 32 x 64 values, each + ~256 header bytes
    fp32_wire = 3 * 4 * 2 * (4 * 32 * 64 * 4 + 256)
    print(f"\nbf16 swarm, 100 steps: loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}, last 10 "
          f"{gap:.2%} from fp32; {summary['wire_bytes_per_step']} wire bytes/step (fp32 would be {fp32_wire})")
    assert gap < 0.02
    assert max(abs(a - b) / b for a, b in zip(summary["losses"], bf16_ref)) < 1e-2  # the same bf16 arithmetic
    assert summary["wire_bytes_per_step"] < 0.55 * fp32_wire
