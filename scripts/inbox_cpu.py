"""What a waited tensor costs the event loop at the inbox: a taker awaits ``Inbox.get`` before the
tensor is filed with ``Inbox.put`` (a stage waiting for its activation or gradient), over many
tensors; µs of the loop thread's CPU a tensor, and the loop's turns from the filing to the taker
holding it (issue 31). On an idle box:

    .venv/bin/python scripts/inbox_cpu.py                # 20,000 tensors
    .venv/bin/python scripts/inbox_cpu.py --tensors 5000 --repeat 5
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from spantrain_p2p.pipeline.messages import ACT, Inbox  # noqa: E402


async def one(n: int) -> tuple[float, float]:
    """(µs of the loop's CPU a tensor, turns from its filing to the taker having it)."""
    inbox, t = Inbox(64), torch.ones(1)
    taken = 0

    async def taker() -> None:
        nonlocal taken
        for i in range(n):
            await inbox.get((ACT, i, 0), 5.0)
            taken = i + 1

    task = asyncio.create_task(taker())
    await asyncio.sleep(0)  # the taker waits on the first
    c0, turns = time.thread_time(), 0
    for i in range(n):
        inbox.put((ACT, i, 0), t)
        while taken <= i:  # one turn of the loop a round: the filer's own
            await asyncio.sleep(0)
            turns += 1
    await task
    return (time.thread_time() - c0) / n * 1e6, turns / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=20000, help="tensors a round (default 20,000)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    a = p.parse_args()
    if a.tensors < 1 or a.repeat < 1:
        p.error("want --tensors >= 1 and --repeat >= 1")
    for _ in range(a.repeat):
        us, turns = asyncio.run(one(a.tensors))
        print(f"{us:.1f} µs of the loop's CPU a waited tensor, {turns:.2f} turns from its filing to its taker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
