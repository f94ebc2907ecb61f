"""`spantrain export`: a checkpoint of a transformers model becomes a directory that
AutoModelForCausalLM.from_pretrained loads, computing the same loss as the layers it came from."""
import subprocess
import sys

import pytest
import torch

from spantrain_p2p.models import state as layer_state
from spantrain_p2p.models.checkpoint import write_layers
from spantrain_p2p.job.spec import JobSpec
from tests._helpers import export_json


@pytest.mark.heavy
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_an_exported_checkpoint_loads_in_transformers_with_the_same_loss(preset, tmp_path):
    from transformers import AutoModelForCausalLM

    from spantrain_p2p.models.hf_model import HFModel

    job = JobSpec(model=f"hf:{preset}", seq_len=16, fingerprint="f" * 32)
    model = HFModel(job.model, job.model_args, job.seed, job.seq_len)
    layers = model.build(0, model.num_layers)
    with torch.no_grad():  # "trained": every weight moved, the head no longer the embedding's copy
        for layer in layers:
            for p in layer.parameters():
                p.add_(0.01 * torch.randn_like(p))
    ckpt = str(tmp_path / "ckpt")
    half = model.num_layers // 2  # two peers' files, as two stages would write them
    write_layers(ckpt, job.fingerprint, job.optimizer, 7, [(i, layer_state.capture(layers[i], None)) for i in range(half)],
                 job.to_dict())
    write_layers(ckpt, job.fingerprint, job.optimizer, 7,
                 [(i, layer_state.capture(layers[i], None)) for i in range(half, model.num_layers)], job.to_dict())
    out = tmp_path / "hf"
    done = export_json(ckpt, "--out", str(out))
    assert done["step"] == 7 and done["layers"] == model.num_layers

    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        h = x
        for layer in layers[:-1]:
            h = layer(h)
        ours = float(layers[-1](h, y))
        lm = AutoModelForCausalLM.from_pretrained(str(out))
        logits = lm(input_ids=x).logits
        theirs = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    print(f"\n{preset}: loss of the layers {ours:.6f}, of the exported model in transformers {theirs:.6f}")
    assert abs(ours - theirs) <= 1e-4 * abs(ours)


def test_a_checkpoint_of_the_built_in_model_says_it_cannot_be_exported(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_layers(str(ckpt), "f" * 32, "adam", 1, [], JobSpec(fingerprint="f" * 32).to_dict())
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "export", str(ckpt), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "only transformers models" in r.stderr
