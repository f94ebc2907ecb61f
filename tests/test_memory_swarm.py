"""A model that fits in no peer's memory stops the swarm before training, saying why with figures."""
import pytest

from tests._helpers import run_swarm_exit

SCENARIO = """
name = "tiny-memory"
description = "2 peers that cannot hold the model"
compute_scale = 0.05

[link_classes.lan]
rtt_ms = 0.5
mbps = 1000

[device_classes.small]
tflops = 0.05
memory_gb = 0.0005

[regions.lan]
link = "lan"

[[peers]]
name = "a"
region = "lan"
device = "small"

[[peers]]
name = "b"
region = "lan"
device = "small"
"""


@pytest.mark.heavy
def test_a_model_that_fits_nowhere_fails_before_training_with_a_clear_message(tmp_path, capfd):
    path = tmp_path / "tiny-memory.toml"
    path.write_text(SCENARIO)
    code, _ = run_swarm_exit("--scenario", str(path), "--steps", "5", "--run-dir", str(tmp_path / "run"))
    err = capfd.readouterr().err
    assert code != 0
    assert "does not fit in the peers' memory" in err, err[-2000:]
    assert "0.5 MiB at most on one" in err and "MiB before any activations" in err
    assert "step    1/" not in err  # not a single step was trained
