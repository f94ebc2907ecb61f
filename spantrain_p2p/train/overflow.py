"""fp16: every peer of the stage map takes the same "skip this step?" decision (``pipeline.loss_scale``).

Each peer sends its flag (did its gradients, or a tensor it sent, overflow?) to the collector, the
first peer of stage 0; the collector answers every peer with the OR of all flags. One tiny message
each way per peer and step, over the transport's usual deadlines and liveness checks: a collector
or peer that dies fails the step as any lost message does, and the swarm re-plans and redoes it.
"""
from __future__ import annotations

import asyncio

import torch

from ..pipeline.messages import AMP, Expect
from ..plan.stagemap import StageMap


def collector_of(smap: StageMap) -> str:
    return smap.stages[0].peers[0]


def expect(job_id: str, smap: StageMap, me: str) -> Expect:
    """What ``me`` takes: every member's flag (the collector), or the collector's verdict."""
    collector = collector_of(smap)
    src = frozenset(smap.members()) - {me} if me == collector else frozenset({collector})
    return Expect(AMP, job_id, smap.epoch, src, (1,), 1)


async def agree(transport, smap: StageMap, me: str, step: int, found: bool) -> bool:
    """The swarm's verdict on ``step``: True if any member's flag is set."""
    collector = collector_of(smap)
    if me != collector:
        await transport.send_to(collector, AMP, step, 0, torch.tensor([float(found)]))
        verdict = await transport.receive((f"{AMP}/{collector}", step, 0), AMP, collector)
        return float(verdict[0]) != 0.0
    others = [p for p in smap.members() if p != me]
    flags = await asyncio.gather(*[transport.receive((f"{AMP}/{p}", step, 0), AMP, p) for p in others])
    verdict = found or any(float(f[0]) != 0.0 for f in flags)
    await asyncio.gather(*[transport.send_to(p, AMP, step, 0, torch.tensor([float(verdict)])) for p in others])
    return verdict
