"""Issue 14's precision figures: the swarm (lan-4, 2 stages x 2 replicas) in bf16 or fp16 against
one process computing the same (fp16 through ``torch.amp.GradScaler``) and against fp32.

Usage: .venv/bin/python scripts/precision_figures.py [--precision fp16] [--steps 100] [--loss-scale S]
Prints one JSON object: the swarm's and the process's skipped steps (fp16), the worst loss
relative error between them, each one's last-10 mean loss against fp32's, and wire bytes per step.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.job.reference import reference_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp16", choices=("bf16", "fp16"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--loss-scale", type=float, default=65536.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        r = subprocess.run([sys.executable, "-m", "spantrain_p2p", "swarm", "--scenario", "peers/lan-4.toml",
                            "--plan", "even", "--no-measure", "--json", "--run-dir", run_dir, "--steps", str(a.steps),
                            "--stages", "2", "--precision", a.precision, "--loss-scale", str(a.loss_scale)],
                           capture_output=True, text=True, check=True)
    swarm = json.loads(r.stdout.strip().splitlines()[-1])
    skipped: list[int] = []
    ref, _ = reference_run(JobSpec(steps=a.steps, precision=a.precision, loss_scale=a.loss_scale), a.steps,
                           skipped=skipped)
    fp32, _ = reference_run(JobSpec(steps=a.steps), a.steps)
    tail = lambda xs: sum(xs[-10:]) / len(xs[-10:])  # noqa: E731
    print(json.dumps({
        "precision": a.precision, "steps": a.steps, "loss_scale_init": a.loss_scale,
        "swarm_skipped_steps": swarm.get("skipped_steps"), "process_skipped_steps": skipped,
        "swarm_vs_process_worst_rel": max(abs(x - y) / y for x, y in zip(swarm["losses"], ref)),
        "swarm_loss": [swarm["losses"][0], swarm["losses"][-1]],
        "swarm_last10_vs_fp32": tail(swarm["losses"]) / tail(fp32) - 1,
        "process_last10_vs_fp32": tail(ref) / tail(fp32) - 1,
        "wire_bytes_per_step": swarm["wire_bytes_per_step"], "samples_per_s": swarm["samples_per_s"]}, indent=1))


if __name__ == "__main__":
    main()
