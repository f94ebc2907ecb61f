"""A swarm trains on a local data set with a locally trained tokenizer exactly like one process;
a peer with another copy of the data or another tokenizer refuses, saying why; bf16 trains like
fp32 with 2-byte activations on the wire."""
import os
from dataclasses import replace

import pytest

from spantrain_p2p.job.dataset import open_data, with_data
from spantrain_p2p.job.spec import JobRefused, JobSpec
from spantrain_p2p.job.reference import reference_run
from spantrain_p2p.data.tokenizer import train_bpe
from tests._helpers import swarm_json
from tests._reference_cache import default_losses
from tests.test_train_swarm import wait_done

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
    x, y = open_data(job).batch(3, 1)
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
    assert open_data(job, data=str(tmp_path / "missing")).lacking  # no copy at all: it fetches shards


@pytest.mark.heavy
def test_four_peers_train_on_a_local_corpus_like_one_process(corpus, tmp_path):
    data, tok = corpus
    steps = 15
    summary = swarm_json(tmp_path, "--steps", str(steps), "--stages", "2", "--data", data, "--tokenizer", tok)
    assert [len(s["peers"]) for s in summary["plan"]["stages"]] == [2, 2]
    # each peer's control plane over the run (issue 33): member reads and heartbeats at least
    for row in summary["peers"]:
        assert row["control"]["calls_out_per_s"] > 0 and row["control"]["bytes_per_s"] > 0, row
        assert row["control"]["largest_value"]["members"] > 300
        # its way to its first plan (issue 33): joined, ready (a fixed plan measures nothing), a stage
        # map, training, done, in that order, in seconds from its start
        m = row["milestones"]
        assert "measuring" not in m and 0 < m["idle"] <= m["ready"] <= m["map"] <= m["training"] <= m["done"], m
    ref, _ = reference_run(with_data(JobSpec(steps=steps), data, tok), steps)
    worst = max(abs(a - b) / b for a, b in zip(summary["losses"], ref))
    print(f"\nlocal corpus, BPE tokenizer, 2 stages x 2 replicas: worst loss rel. error {worst:.2e} over {steps} steps")
    assert len(summary["losses"]) == steps and worst <= 1e-4


@pytest.mark.heavy
def test_bf16_trains_within_two_percent_of_fp32_with_two_byte_activations(tmp_path):
    """The swarm in bf16 computes what one process computes in bf16 (20 steps, 4 stages, 2-byte values
    on the wire); that arithmetic, run 100 steps in one process, ends within 2 % of fp32."""
    steps, job = 20, JobSpec(steps=100)
    summary = swarm_json(tmp_path, "--steps", str(steps), "--stages", "4", "--precision", "bf16")
    fp32 = default_losses(100)  # the default job in fp32
    bf16_ref, _ = reference_run(replace(job, precision="bf16"), 100)
    gap = abs(sum(bf16_ref[-10:]) / sum(fp32[-10:]) - 1)
    # 3 boundaries x 4 micro-batches x (activation + its gradient) of 4 x 32 x 64 values, each + ~256 header bytes
    fp32_wire = 3 * 4 * 2 * (4 * 32 * 64 * 4 + 256)
    same = max(abs(a - b) / b for a, b in zip(summary["losses"], bf16_ref))
    print(f"\nbf16 swarm, {steps} steps: loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}, within "
          f"{same:.1e} of one bf16 process; that process after 100 steps: {bf16_ref[-1]:.4f}, last 10 {gap:.2%} from "
          f"fp32; {summary['wire_bytes_per_step']} wire bytes/step (fp32 would be {fp32_wire})")
    assert gap < 0.02
    assert same < 1e-2  # the same bf16 arithmetic
    assert summary["wire_bytes_per_step"] < 0.55 * fp32_wire


def test_a_peer_without_the_data_fetches_only_the_shards_its_batches_read(peers, tmp_path):
    """4 peers by hand as 2 stages x 2 replicas; one has no copy of a 22-shard data set (and a cache
    of its own): it fetches the shards of its own micro-batches, hash-checked, and the run's losses
    are those of one process."""
    from spantrain_p2p.pipeline.assignment import assign_microbatches
    from spantrain_p2p.data.corpus import open_corpus
    from spantrain_p2p.data.tokenizer import load_tokenizer

    data = tmp_path / "big"
    data.mkdir()
    words = TEXT.split()
    for i in range(10):  # ~11 MB of bytes: 22 shards of 512 Ki byte tokens
        (data / f"part{i}.txt").write_text(" ".join(words[(i * 7 + j) % len(words)] for j in range(190_000)))
    shared, own = str(tmp_path / "cache-shared"), str(tmp_path / "cache-own")
    steps, swarm = 2, f"fetch-{os.getpid()}"
    common = ["--swarm", swarm, "--no-measure", "--tokenizer", "bytes"]
    origin = peers("p0", *common, "--data", str(data), "--data-cache", shared, "--steps", str(steps), "--peers", "4",
                   "--plan", "even", "--stages", "2", "--micro-batches", "2")
    origin.wait_ready(60)
    have = [peers(f"p{i}", *common, "--join", origin.info["address"], "--data-cache", shared) for i in (1, 2)]
    lacking = peers("p3", *common, "--join", origin.info["address"], "--data", str(tmp_path / "nowhere"),
                    "--data-cache", own)
    everyone = [origin, *have, lacking]
    for p in everyone:
        p.wait_ready(60)
    wait_done(everyone, 120)

    corpus = open_corpus(str(data), load_tokenizer("bytes"), cache_dir=shared)
    assert corpus.num_shards >= 20
    report = lacking.status(path="/report")
    job = JobSpec(**{k: v for k, v in report["job"].items()})
    stage, me = report["plan"]["stages"][report["stage"]], report["peer_id"][:12]  # peers unnamed: id prefixes
    mine = [mb for mb, p in enumerate(assign_microbatches(stage["peers"], list(stage["microbatch_share"].values()), 2))
            if p == me]
    needed = {i for step in range(steps) for mb in mine for i in corpus.shards_for(job.seed, step, mb, job.micro_batch_size,
                                                                                  job.seq_len)}
    fetched = report["data_fetched"]
    print(f"\nthe peer without the data fetched shards {sorted(fetched)} of {corpus.num_shards} (its micro-batches "
          f"{mine} read {sorted(needed)})")
    assert sorted(fetched) == sorted(needed) and len(fetched) < corpus.num_shards / 2
    ref, _ = reference_run(job, steps)
    last = max((p.status(path="/report") for p in everyone), key=lambda r: r["stage"])
    assert max(abs(l - r) / r for (_, l), r in zip(last["losses"], ref)) <= 1e-4
