"""A stage's optimizer state sharded across its replicas (ZeRO-1), the planner's lever inside a fast group.

Each replica owns the optimizer state of a share of the stage's parameters (``plan.layout.shard_owners``:
the same owners on every replica, from the map and the parameters' sizes). In a step, a replica sends
each bucket of its gradients to the bucket's owner only (``GradientSum`` with ``owners``: the
reduce-scatter), the owner sums the parts in the same order an unsharded replica does and steps its
layers (its optimizer holds their state alone), then sends their new weights to the other replicas
(``gather``: the all-gather, bucket by bucket). Every replica ends the step with bit-identical
weights, as unsharded, and holds the optimizer state of its own parameters only.

Recovery stays by layer: a replica's snapshot of a layer is partial (``models.state``: the other
replicas' parameters marked ``x:``), copied to a buddy as a lone stage's are; a layer is whole at a
step where the parts held together lack nothing (``state.covered``), and a peer that takes it over
puts it together from them (``Recovery.load``).

Only with ``--aggregate sum``: the robust sum needs every replica to see every part (each judges
the others), where here one owner sums a layer's parts and the others take its weights on trust.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import torch

from ..pipeline.messages import DTYPES, WGAT, Expect
from ..plan.layout import shard_owners


class Sharding:
    """The owners of one epoch's sharded stage: of each parameter of ``layers`` (the stage's
    modules), then of each gradient bucket (``use``: ``gradsum.layer_buckets`` built with
    ``param_owner``, so that a bucket is one owner's)."""

    def __init__(self, me: str, replicas: tuple[str, ...], layers: list):
        self.me, self.replicas = me, tuple(replicas)
        self.others = [p for p in replicas if p != me]
        named = [(i, n, p) for i, layer in enumerate(layers) for n, p in layer.named_parameters() if p.requires_grad]
        self.param_owner = shard_owners([float(p.numel() * p.element_size()) for _, _, p in named], list(replicas))
        # per local layer: the parameters whose optimizer state another replica holds
        self.foreign = [frozenset(n for (j, n, _), o in zip(named, self.param_owner) if j == i and o != me)
                        for i in range(len(layers))]
        dtypes = {p.dtype for _, _, p in named}
        self.dtype = next(n for n, d in DTYPES.items() if d in dtypes and len(dtypes) == 1)  # the weights' own
        self.buckets: list = []
        self.bucket_owner: list[str] = []

    def use(self, buckets: list) -> None:
        self.buckets = buckets
        self.bucket_owner = [self.param_owner[b[0][0]] for _, b in buckets]

    def owned_params(self, params: list) -> list[torch.nn.Parameter]:
        """The parameters (of the stage's ``params``, in order) whose optimizer state this replica
        keeps and steps."""
        return [p for p, o in zip(params, self.param_owner) if o == self.me]

    def expect(self, job_id: str, epoch: int) -> Expect:
        """The weights this replica takes from the others: one message per bucket, from its owner."""
        return Expect(WGAT, job_id, epoch, frozenset(self.others), (), len(self.buckets), self.dtype,
                      shapes_by_mb=tuple((sum(n for _, n in b),) for _, b in self.buckets))

    async def gather(self, transport, step: int, params: list) -> None:
        """After this replica's optimizer step: its buckets' new weights to the other replicas, and
        theirs into its own parameters (the step fails, as a gradient sum's would, if one never comes)."""
        sends, epoch = [], transport.smap.epoch
        for k, (_, bucket) in enumerate(self.buckets):
            if self.bucket_owner[k] == self.me:
                flat = torch.cat([params[i].detach().reshape(-1) for i, _ in bucket]).to("cpu")
                sends += [asyncio.create_task(transport.send_to(dst, WGAT, step, k, flat, epoch=epoch))
                          for dst in self.others]
        try:
            for k, (_, bucket) in enumerate(self.buckets):
                owner = self.bucket_owner[k]
                if owner == self.me:
                    continue
                flat = await transport.receive((f"{WGAT}/{owner}", step, k), WGAT, owner)
                offset = 0
                with torch.no_grad():
                    for i, n in bucket:
                        p = params[i]
                        p.copy_(flat[offset:offset + n].view_as(p))
                        offset += n
            await asyncio.gather(*sends)
        finally:
            for t in sends:
                t.cancel()
            await asyncio.gather(*sends, return_exceptions=True)


def setup(smap, stage: int, me: str, layers: list) -> Optional[Sharding]:
    """The stage's ``Sharding`` where the map shards it, else None."""
    st = smap.stages[stage]
    if not st.shard or len(st.peers) < 2:
        return None
    return Sharding(me, st.peers, layers)
