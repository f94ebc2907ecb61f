"""A model that fits in no peer's memory stops the swarm before training, saying why with figures."""
import subprocess
import sys

import pytest

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
def test_a_model_that_fits_nowhere_fails_before_training_with_a_clear_message(tmp_path):
    path = tmp_path / "tiny-memory.toml"
    path.write_text(SCENARIO)
    r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "swarm", "--scenario", str(path), "--steps", "5",
                        "--json", "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "does not fit in the peers' memory" in r.stderr, r.stderr[-2000:]
    assert "0.5 MiB at most on one" in r.stderr and "MiB before any activations" in r.stderr
    assert "step    1/" not in r.stderr  # not a single step was trained
