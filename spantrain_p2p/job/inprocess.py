"""A whole pipeline in one process: every stage's replicas as ``StageExecutor``s joined by in-memory
inboxes, their gradients summed in peer order each step. What the executor does, without a
network: the tests' check against single-process training (``reference``), and the memory levers'
figures (``scripts/memory_figures.py``)."""
from __future__ import annotations

import asyncio

import torch

from ..data import generated as data
from ..pipeline.assignment import assign_microbatches, peer_actions
from ..pipeline.executor import StageExecutor
from ..pipeline.messages import ACT, Inbox
from ..plan.stagemap import even_split
from .optim import make_optimizer
from .spec import JobSpec, ModelHandle


async def run_pipeline(job: JobSpec, num_stages: int, steps: int, grads_at: int = 0, widths=None, shares=None,
                       compute_dtype=None, sent_dtypes=None, recompute="none", stash=None):
    """In-process pipeline: stage k has widths[k] replicas; replicas sum their gradients each step.
    ``sent_dtypes`` (a set) collects the dtypes of the tensors that cross between stages; ``stash``
    (a dict) gets each peer's most activation bytes held at once, and its compute seconds, over the steps."""
    handle = ModelHandle(job)
    ranges = even_split(handle.num_layers, num_stages)
    widths = widths or [1] * num_stages
    M = job.num_micro_batches
    assigns = [assign_microbatches([f"{k}.{i}" for i in range(w)], (shares or [1.0] * w)[:w] if shares else [1.0] * w, M)
               for k, w in enumerate(widths)]
    plan = peer_actions(assigns, job.schedule)
    inboxes = {key: Inbox(64) for key in plan}
    execs = {}
    for (k, peer) in plan:
        a, b = ranges[k]

        async def recv(kind, step, mb, key=(k, peer)):
            return await inboxes[key].get((kind, step, mb), 10)

        async def send(kind, step, mb, t, k=k):
            if sent_dtypes is not None:
                sent_dtypes.add(t.dtype)
            dst = k + 1 if kind == ACT else k - 1
            inboxes[(dst, assigns[dst][mb])].put((kind, step, mb), t.clone())

        execs[(k, peer)] = StageExecutor(handle.build(a, b), k == 0, k == num_stages - 1, M,
                                         lambda s, m: data.batch(job.seed, s, m, job.micro_batch_size, job.seq_len),
                                         recv, send, compute_dtype=compute_dtype, recompute=recompute,
                                         arrived=lambda kind, step, mb, key=(k, peer): inboxes[key].arrived((kind, step, mb)))
    opts = {key: make_optimizer(job, e.params) for key, e in execs.items()}
    losses, grads = [], {}
    for step in range(steps):
        keys = list(execs)
        results = await asyncio.gather(*[execs[key].run_step(step, plan[key]) for key in keys])
        last = [r.losses for key, r in zip(keys, results) if key[0] == num_stages - 1]
        if stash is not None:
            for key, r in zip(keys, results):
                peak, secs = stash.get(key, (0, 0.0))
                stash[key] = (max(peak, r.stash_peak_bytes), secs + r.compute_s)
        losses.append(sum(sum(l) for l in last) / M)
        for k in range(num_stages):  # the replicas' all-reduce, in peer order
            reps = sorted(key for key in execs if key[0] == k)
            for ps in zip(*[execs[key].params for key in reps]):
                total = sum((p.grad if p.grad is not None else torch.zeros_like(p)) for p in ps)
                for p in ps:
                    p.grad = total.clone()
        if step == grads_at:
            for (k, peer), e in execs.items():
                a = ranges[k][0]
                for i, layer in enumerate(e.layers):
                    for n, p in layer.named_parameters():
                        grads[f"{a + i}.{n}"] = p.grad.clone()
        for o in opts.values():
            o.step()
            o.zero_grad(set_to_none=True)
    for e in execs.values():
        e.close()
    return losses, grads
