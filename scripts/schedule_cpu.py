"""What the schedule costs the event loop: one stage's ``StageExecutor.run_step`` on tiny layers, its
tensors always there and its sends answered at once, so that what is left is the executor's own work
on the loop (handing each op to the compute thread and taking its result back, receives, sends,
traces), in ms of the loop thread's CPU a step and µs an action (issue 31). On an idle box:

    .venv/bin/python scripts/schedule_cpu.py                     # 1F1B, stage 1 of 4, 8 micro-batches
    .venv/bin/python scripts/schedule_cpu.py --schedule zb-h1 --stage 0

Inside a training step on a busy host the same work costs two to three times as much (cold caches on
cores the compute shares): compare changes here, back to back, before reading them in a swarm.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import uvloop  # noqa: E402
from torch import nn  # noqa: E402

from spantrain_p2p.pipeline import schedule as sched  # noqa: E402
from spantrain_p2p.pipeline.executor import StageExecutor  # noqa: E402


async def measure(schedule: str, stages: int, micro_batches: int, stage: int, steps: int) -> tuple[int, float, float]:
    """(actions a step, loop CPU seconds a step, wall seconds a step) over ``steps`` after 20 warm-up steps."""
    actions = sched.schedule(schedule, stages, micro_batches, stage)
    x = torch.randn(2, 8)
    first, last = stage == 0, stage == stages - 1

    async def recv(kind, step, mb):
        return x.clone()

    async def send(kind, step, mb, t):
        return None

    def batch(step, mb):
        return x, torch.zeros(2, 8)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h, targets):
            return ((self.lin(h) - targets) ** 2).mean()

    layers = [nn.Linear(8, 8), Loss() if last else nn.Linear(8, 8)]
    ex = StageExecutor(layers, first, last, micro_batches, batch, recv, send, arrived=lambda kind, step, mb: True)
    try:
        for step in range(20):
            await ex.run_step(step, actions)
            ex.zero_grad()
        c0, w0 = time.thread_time(), time.perf_counter()
        for step in range(20, 20 + steps):
            await ex.run_step(step, actions)
            ex.zero_grad()
        return len(actions), (time.thread_time() - c0) / steps, (time.perf_counter() - w0) / steps
    finally:
        ex.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b", help="1f1b, zb-h1 or gpipe (default 1f1b)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--stage", type=int, default=1, help="which stage (default 1: a middle one, receiving and sending)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3, help="runs, each printed (default 3)")
    a = p.parse_args()
    if not 0 <= a.stage < a.stages or a.steps < 1 or a.repeat < 1:
        p.error("want 0 <= --stage < --stages, --steps >= 1 and --repeat >= 1")
    torch.set_num_threads(1)  # as in a peer process
    for _ in range(a.repeat):
        n, cpu, wall = uvloop.run(measure(a.schedule, a.stages, a.micro_batches, a.stage, a.steps))
        print(f"{a.schedule} stage {a.stage} of {a.stages}, {a.micro_batches} micro-batches: {n} actions a step, "
              f"the loop's CPU {cpu * 1e3:.3f} ms a step ({cpu / n * 1e6:.1f} µs an action), wall {wall * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
