"""Causal LMs from transformers (``--model hf:``) split into layers compute exactly what the whole
transformers model computes, load a local directory's weights, never download, and train across
4 peers (2 stages x 2 replicas) like single-process transformers training."""
import glob
import json
import os

import pytest
import torch

from spantrain_p2p.models.hf_model import HFModel, full_model, resolve
from spantrain_p2p.job.spec import JobRefused, JobSpec, ModelHandle, check_compatible
from spantrain_p2p.train.planning import model_profile
from spantrain_p2p.job.reference import transformers_reference_run
from tests._helpers import export_json, swarm_json

TINY = ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "mistral-tiny"]


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _ids(seed=0, shape=(2, 17)):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", TINY)
def test_the_layer_list_computes_the_whole_transformers_model_s_loss_and_gradients(preset):
    model = HFModel(f"hf:{preset}", {}, 0, 16)
    layers = model.build(0, model.num_layers)
    lm = full_model(model, layers)
    ids = _ids()
    x, y = ids[:, :-1], ids[:, 1:]
    h = x
    for layer in layers[:-1]:
        h = layer(h)
    ours = layers[-1](h, y)
    ours.backward()
    logits = lm(input_ids=x).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item()
    named = dict(lm.named_parameters())
    worst = max(rel(p.grad, named[layer.hf_name(n)].grad) for layer in layers for n, p in layer.named_parameters())
    assert worst <= 1e-5, worst


def test_layers_are_seeded_one_by_one_so_a_stage_builds_only_its_own():
    model = HFModel("hf:llama-tiny", {}, 3, 16)
    whole = model.build(0, model.num_layers)
    middle = model.build(2, 3)[0]
    for (n, a), (_, b) in zip(whole[2].named_parameters(), middle.named_parameters()):
        assert torch.equal(a, b), n
    other = HFModel("hf:llama-tiny", {"seed": 4}, 3, 16).build(2, 3)[0]
    assert not torch.equal(next(other.parameters()), next(middle.parameters()))
    # the untied head starts as the embedding (GPT-2 ties them): step 0 is the tied model
    g = HFModel("hf:gpt2-tiny", {}, 0, 16)
    assert g.tied and torch.equal(g.build(g.num_layers - 1, g.num_layers)[0].lm_head.weight,
                                  g.build(0, 1)[0].wte.weight)


def test_nothing_is_downloaded_a_hub_name_or_a_missing_directory_fails_at_once_saying_so():
    with pytest.raises(ValueError, match="nothing is downloaded"):
        resolve("hf:meta-llama/Llama-2-7b-hf")
    with pytest.raises(ValueError, match="no preset of that name"):
        resolve("hf:gpt3")
    with pytest.raises(ValueError, match="not a field of the gpt2 config"):
        HFModel("hf:gpt2-tiny", {"hidden_sizes": 3}, 0, 16)
    with pytest.raises(ValueError, match="over the model's 256 positions"):
        HFModel("hf:gpt2-tiny", {}, 0, 512)
    assert HFModel("hf:gpt2-tiny", {"n_layer": 5}, 0, 16).num_layers == 7  # --model-arg overrides the config


def test_a_local_directory_s_pretrained_weights_are_what_the_layers_start_from(tmp_path):
    from transformers import AutoModelForCausalLM

    src = HFModel("hf:llama-tiny", {"seed": 9}, 0, 16)
    pretrained = full_model(src, src.build(0, src.num_layers))
    pretrained.config.tie_word_embeddings = False
    pretrained.save_pretrained(str(tmp_path / "llama"))  # config.json + model.safetensors
    assert os.path.isfile(tmp_path / "llama" / "model.safetensors")
    job = JobSpec(model=f"hf:{tmp_path / 'llama'}", seq_len=16).finalized()
    handle = check_compatible(job, allowed_models=(job.model,))
    layers = handle.build(0, handle.num_layers)
    ids = _ids(1)
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        h = x
        for layer in layers[:-1]:
            h = layer(h)
        ours = float(layers[-1](h, y))
        lm = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"))
        logits = lm(input_ids=x).logits
        theirs = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    assert abs(ours - theirs) <= 1e-5 * theirs
    # a directory is read only if the peer named it; its weights are part of the fingerprint
    with pytest.raises(JobRefused, match="model directory"):
        check_compatible(job)
    with torch.no_grad():
        pretrained.model.norm.weight.add_(1e-3)
    pretrained.save_pretrained(str(tmp_path / "llama"))
    with pytest.raises(JobRefused, match="differs from the swarm's"):
        check_compatible(job, allowed_models=(job.model,))


def test_presets_are_planned_from_their_real_shapes():
    prof = model_profile(JobSpec(model="hf:llama-7b", seq_len=1024))
    assert abs(sum(x.param_bytes for x in prof.layers) / 4 - 6.74e9) < 0.01e9
    assert len(prof.layers) == 34 and "llama" in prof.name
    block = prof.layers[1]  # 2 FLOPs x 202M weights x 1024 tokens + attention's 4 x T^2 x d
    assert abs(block.fwd_flops - (2 * 202_375_168 * 1024 + 4 * 1024 * 1024 * 4096)) < 1e6


TEXT = ("The planner places the stages where the links are fast. Activations cross the slow links, "
        "compressed as much as each link needs. Replicas sum their gradients inside a region. ")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A local corpus and a BPE tokenizer trained on it here (300 tokens)."""
    from spantrain_p2p.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("hfcorpus")
    for i in range(6):
        (d / f"doc{i}.txt").write_text("".join(f"{TEXT} Paragraph {i}.{j}: {TEXT[j:]}\n" for j in range(40)))
    tok = d.parent / "hf-tokenizer.json"
    train_bpe(str(d), 300, str(tok))
    return str(d), str(tok)


def _pretrained_llama_dir(path, vocab):
    """A tiny Llama saved by transformers (config.json + model.safetensors): the model to fine-tune."""
    src = HFModel("hf:llama-tiny", {"seed": 9, "vocab_size": vocab}, 0, 16)
    lm = full_model(src, src.build(0, src.num_layers))
    lm.save_pretrained(str(path))
    return f"hf:{path}"


@pytest.mark.heavy
@pytest.mark.parametrize("which", ["gpt2-tiny", "llama-dir"])
def test_four_peers_train_a_transformers_model_like_single_process_transformers(which, corpus, tmp_path):
    """2 stages x 2 replicas on lan-4, a local corpus and a tokenizer trained on it: gradients after
    step 0 and 30 losses match the whole transformers model trained in one process from the same
    weights on the same batches. The Llama comes from a directory of pretrained weights (fine-tuning)
    and its last checkpoint is exported: transformers loads it and computes the swarm's loss."""
    from spantrain_p2p.models import state as layer_state
    from spantrain_p2p.models.checkpoint import CheckpointDir
    from spantrain_p2p.job.dataset import open_data, with_data
    from spantrain_p2p.data.tokenizer import load_tokenizer

    data, tok = corpus
    model = "hf:gpt2-tiny" if which == "gpt2-tiny" else _pretrained_llama_dir(tmp_path / "llama",
                                                                              load_tokenizer(tok).vocab_size)
    steps, grads_dir, ckpt = 30, str(tmp_path / "grads"), str(tmp_path / "ckpt")
    summary = swarm_json(tmp_path, "--model", model, "--data", data, "--tokenizer", tok, "--seq-len", "16",
                         "--steps", str(steps), "--stages", "2", "--dump-grads", grads_dir,
                         "--checkpoint-every", str(steps), "--checkpoint-dir", ckpt)
    assert [len(s["peers"]) for s in summary["plan"]["stages"]] == [2, 2]
    job = with_data(JobSpec(model=model, seq_len=16, steps=steps), data, tok)
    ref_losses, ref_grads = transformers_reference_run(job, steps, grads_at=0)
    worst_loss = max(abs(a - b) / b for a, b in zip(summary["losses"], ref_losses))
    files = glob.glob(os.path.join(grads_dir, "grads-step0-*.pt"))
    assert len(files) == 4
    worst_grad = 0.0
    for f in files:  # every replica holds its stage's whole summed gradient
        for k, g in torch.load(f).items():
            worst_grad = max(worst_grad, rel(g, ref_grads[k]))
    print(f"\n{model} (vocab {job.model_args.get('vocab_size', 'of the directory')}) on 2 stages x 2 replicas: "
          f"worst gradient rel. error {worst_grad:.2e}, worst loss rel. error {worst_loss:.2e} over {steps} steps; "
          f"loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}")
    assert len(summary["losses"]) == steps and worst_loss <= 1e-4 and worst_grad <= 1e-5
    assert summary["losses"][-1] < summary["losses"][0]
    if which == "gpt2-tiny":
        return

    out = tmp_path / "exported"
    assert export_json(ckpt, "--out", str(out))["step"] == steps
    handle = ModelHandle(job)  # the swarm's weights: the layers loaded from the checkpoint
    layers = handle.build(0, handle.num_layers)
    files = CheckpointDir(ckpt, json.load(open(os.path.join(ckpt, "job.json")))["fingerprint"], job.optimizer)
    for i, layer in enumerate(layers):
        layer_state.apply(layer, None, files.load(i, steps, layer_state.expected_shapes(layer)))
    x, y = open_data(job).batch(steps + 5, 0)  # a batch the swarm never trained on
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        h = x
        for layer in layers[:-1]:
            h = layer(h)
        ours = float(layers[-1](h, y))
        logits = AutoModelForCausalLM.from_pretrained(str(out))(input_ids=x).logits
        theirs = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    print(f"exported step {steps}: loss {theirs:.6f} in transformers, {ours:.6f} on the swarm's layers")
    assert abs(ours - theirs) <= 1e-4 * ours
    assert (out / "tokenizer.json").is_file()


def test_a_tokenizer_larger_than_a_pretrained_model_s_vocabulary_is_refused_saying_so(corpus, tmp_path):
    from spantrain_p2p.job.dataset import with_data

    data, tok = corpus
    model = _pretrained_llama_dir(tmp_path / "llama", 256)  # a directory's vocabulary is its weights'
    with pytest.raises(ValueError, match="has 300 tokens, the model's vocabulary only 256"):
        with_data(JobSpec(model=model, seq_len=16), data, tok)
    assert with_data(JobSpec(model="hf:llama-tiny", seq_len=16), data, tok).model_args["vocab_size"] == 300
