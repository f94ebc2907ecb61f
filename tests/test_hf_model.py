"""Causal LMs from transformers (``--model hf:``) split into layers compute exactly what the whole
transformers model computes, load a local directory's weights, never download, and train across
4 peers (2 stages x 2 replicas) like single-process transformers training."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from spantrain_p2p.train.hf_model import HFModel, full_model, resolve
from spantrain_p2p.train.job import JobRefused, JobSpec, ModelHandle, check_compatible
from spantrain_p2p.train.planning import model_profile
from spantrain_p2p.train.reference import reference_run, transformers_reference_run

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


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_four_peers_train_a_transformers_model_like_single_process_transformers(preset, tmp_path):
    """2 stages x 2 replicas on lan-4: gradients after step 0 and every loss match the whole
    transformers model trained in one process from the same weights on the same batches."""
    steps, grads_dir = 12, str(tmp_path / "grads")
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "swarm", "--scenario", "peers/lan-4.toml",
                        "--model", f"hf:{preset}", "--seq-len", "16", "--steps", str(steps), "--stages", "2",
                        "--plan", "even", "--dump-grads", grads_dir, "--json", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert [len(s["peers"]) for s in summary["plan"]["stages"]] == [2, 2]
    job = JobSpec(model=f"hf:{preset}", seq_len=16, steps=steps)
    ref_losses, ref_grads = transformers_reference_run(job, steps, grads_at=0)
    worst_loss = max(abs(a - b) / b for a, b in zip(summary["losses"], ref_losses))
    files = glob.glob(os.path.join(grads_dir, "grads-step0-*.pt"))
    assert len(files) == 4
    worst_grad = 0.0
    for f in files:  # every replica holds its stage's whole summed gradient
        for k, g in torch.load(f).items():
            worst_grad = max(worst_grad, rel(g, ref_grads[k]))
    print(f"\n{preset} on 2 stages x 2 replicas: worst gradient rel. error {worst_grad:.2e}, worst loss rel. error "
          f"{worst_loss:.2e} over {steps} steps; loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}")
    assert len(summary["losses"]) == steps and worst_loss <= 1e-4 and worst_grad <= 1e-5
    assert summary["losses"][-1] < summary["losses"][0]
    same, _ = reference_run(job, 2)  # the layer list in one process: the same curve
    assert abs(same[1] - ref_losses[1]) <= 1e-5 * ref_losses[1]
