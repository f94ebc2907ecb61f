"""Discrete-event simulation of one training step of a plan, peer by peer.

What it models, and nothing more:

- every peer runs its action list in order, from the runtime's own functions
  (``pipeline.assignment``: its stage's schedule filtered to the micro-batches the peer owns,
  with the stage's warm-up scaled to its replicas by their dealt micro-batch counts, as the peers
  do: ``tests/test_sim.py``): compute takes
  FLOPs / the peer's FLOP/s, a receive blocks until the message has arrived, a send does not block;
- a message goes over the directed link from the micro-batch's owner on one stage to its owner
  on the next: a link serializes its messages (FIFO at its bandwidth) and adds the one-way delay
  (RTT/2, plus a seeded jitter of up to the link's ``jitter_s`` either way);
- a stage's ring all-reduce (2(n-1) steps of ``param_bytes / n`` over its slowest edge) goes
  layer by layer: a layer's part leaves once every replica's last backward op has done that
  layer (at its share of the op's FLOPs, last layer first); the parts queue on the ring, and the
  last arrives the ring's one-way delays later (each edge with its own jitter);
- the step ends when the last all-reduce ends; a peer whose weights, gradients, optimizer state
  and most activations held at once exceed its memory makes the step infinite.

Events are processed peer by peer until each blocks (a receive whose message has not come):
since a link only ever carries one sender's messages, in that sender's order, this gives the
same times as a global event queue, at a fraction of its cost.
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ..pipeline.schedule import Op, peak_stashed
from ..pipeline.assignment import dealt_shares, peer_lists, stage_warmups
from ..plan.layout import LinkTable, build_layout, overlapped_tail
from ..plan.types import ModelProfile, Plan, Snapshot, wire_ratio


@dataclass(frozen=True)
class SimResult:
    step_s: float
    pipeline_s: float  # when the last peer finished its last compute
    stage_end_s: tuple[float, ...]  # per stage: last peer done (before its all-reduce)
    allreduce_s: tuple[float, ...]
    peer_busy_s: dict = field(default_factory=dict)
    bytes_on_wire: float = 0.0  # activations and their gradients plus all-reduce traffic, per step
    compute_utilization: float = 0.0  # FLOP done / (sum of used peers' FLOP/s * step)
    peak_memory_bytes: dict = field(default_factory=dict)  # per peer: state + most stash held
    out_of_memory: tuple[str, ...] = ()  # peers whose peak exceeds their memory: then step_s is inf

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "out_of_memory": list(self.out_of_memory), "pipeline_s": self.pipeline_s, "stage_end_s": list(self.stage_end_s),
                "allreduce_s": list(self.allreduce_s), "bytes_on_wire": self.bytes_on_wire,
                "compute_utilization": self.compute_utilization}


def _jitter(seed: int, *key: object) -> float:
    """A deterministic value in [-1, 1) from ``key`` (independent of the order events run in)."""
    h = hashlib.blake2b(repr((seed,) + key).encode(), digest_size=8).digest()
    return struct.unpack("<Q", h)[0] / 2.0**63 - 1.0


def simulate(plan: Plan, snapshot: Snapshot, profile: ModelProfile, links: Optional[LinkTable] = None,
             jitter: bool = True, seed: int = 0, op_overhead_s: float = 0.0,
             trace: Optional[list] = None) -> SimResult:
    """Simulated step time of ``plan`` on ``snapshot`` (links from ``links``, or the snapshot's).

    ``trace``: a list that receives ``(peer, action, start_s, end_s)`` for every compute action
    and ``(peer, "SEND_F3->peer", start_s, arrival_s)`` for every message.
    """
    links = links or LinkTable(snapshot)
    prep = build_layout(plan, snapshot, profile, links, op_overhead_s)
    p, sched = plan.num_stages, plan.schedule
    warm = stage_warmups(sched, [dealt_shares(list(st.share_of().values()), plan.num_micro_batches) for st in plan.stages],
                         plan.num_micro_batches)
    hop_bytes = [sw.act_bytes * wire_ratio(plan.compression[s], profile.wire_dtype_bytes) if s < p - 1 else 0.0
                 for s, sw in enumerate(prep.stages)]
    workers = []  # flat list of (stage, PeerWork)
    index: dict[tuple[int, int], int] = {}  # (stage, index in stage) -> worker
    for s, sw in enumerate(prep.stages):
        for i, pw in enumerate(sw.peers):
            index[(s, i)] = len(workers)
            workers.append((s, pw))
    nw = len(workers)
    acts: list[list] = [None] * nw  # type: ignore[list-item]
    m = plan.num_micro_batches
    peak_memory = {}
    for s, sw in enumerate(prep.stages):
        lists = peer_lists(sched, p, s, m, warm[s], sw.owner, len(sw.peers))
        for i, lst in enumerate(lists):
            acts[index[(s, i)]] = [(a.op, a.mb) for a in lst]
            pw = sw.peers[i]
            peak_memory[pw.id] = sw.state_bytes + peak_stashed(lst) * sw.stash_bytes + sw.stash_once
    pos = [0] * nw
    clock = [0.0] * nw
    busy = [0.0] * nw
    last_bw: list[Optional[tuple[float, float]]] = [None] * nw  # (start, duration) of its last W / BW
    arrived: dict[tuple[int, int, int], float] = {}  # (worker, kind 0=F 1=B, mb) -> arrival time
    link_free: dict[tuple[int, int], float] = {}
    wire = 0.0
    ready = deque(range(nw))
    queued = [True] * nw
    while ready:
        k = ready.popleft()
        queued[k] = False
        s, pw = workers[k]
        actions = acts[k]
        i = pos[k]
        t = clock[k]
        n_actions = len(actions)
        while i < n_actions:
            op, mb = actions[i]
            if op is Op.RECV_F or op is Op.RECV_B:
                key = (k, 0 if op is Op.RECV_F else 1, mb)
                got = arrived.pop(key, None)
                if got is None:
                    break
                if got > t:
                    t = got
            elif op is Op.SEND_F or op is Op.SEND_B:
                fwd = op is Op.SEND_F
                ds = s + 1 if fwd else s - 1
                dst = index[(ds, prep.stages[ds].owner[mb])]
                nbytes = hop_bytes[s if fwd else ds]
                src_id, dst_id = pw.id, workers[dst][1].id
                link = links.get(src_id, dst_id)
                start = max(t, link_free.get((k, dst), 0.0))
                done = start + nbytes / link.bandwidth
                link_free[(k, dst)] = done
                delay = link.rtt_s / 2
                if jitter and link.jitter_s > 0:
                    delay = max(0.0, delay + link.jitter_s * _jitter(seed, src_id, dst_id, fwd, mb))
                arrived[(dst, 0 if fwd else 1, mb)] = done + delay
                if trace is not None:
                    trace.append((src_id, f"{op.value}{mb}->{dst_id}", start, done + delay))
                wire += nbytes
                if not queued[dst]:
                    ready.append(dst)
                    queued[dst] = True
            else:
                d = pw.f if op is Op.F else pw.b if op is Op.B else pw.w if op is Op.W else pw.b + pw.w
                if op is Op.W or op is Op.BW:
                    last_bw[k] = (t, d)
                if trace is not None:
                    trace.append((pw.id, f"{op.value}{mb}", t, t + d))
                t += d
                busy[k] += d
            i += 1
        pos[k] = i
        clock[k] = t
    stuck = [workers[k][1].id for k in range(nw) if pos[k] < len(acts[k])]
    if stuck:
        raise RuntimeError(f"simulation deadlocked: peers {stuck[:5]} wait forever")
    stage_end, ar_times, ends = [], [], []
    for s, (st, sw) in enumerate(zip(plan.stages, prep.stages)):
        end = max(clock[index[(s, i)]] for i in range(len(st.peers)))
        stage_end.append(end)
        ar = 0.0
        ring = prep.allreduce_layers[s]
        n = len(st.peers)
        if ring is not None:
            # each layer's part goes out once every replica's last backward op has done it
            fused = sched != "zb-h1"
            done = ring.done_bw if fused else ring.done_w
            lasts = [last_bw[index[(s, i)]] for i in range(n)]
            ready = [max((t0 + d * f for t0, d in (x for x in lasts if x is not None)), default=end) for f in done]
            latency = _ring_latency(st.peers, links, seed, s) if jitter else ring.latency_s
            ar = overlapped_tail(done, ring.piece_s, latency, end, ready) + ring.gather_s
            if st.shard:  # the gradients' reduce-scatter, then the weights' all-gather
                wire += (n - 1) * sw.param_bytes * (profile.grad_wire_bytes_per_param_byte + 1)
            else:
                wire += 2 * (n - 1) * sw.param_bytes * profile.grad_wire_bytes_per_param_byte
        ar_times.append(ar)
        ends.append(end + ar + sw.step_tail_s)  # the optimizer's step (``layout``)
    step = max(ends)
    peers_info = snapshot.by_id()
    oom = tuple(pid for pid, need in peak_memory.items() if need > peers_info[pid].memory_bytes)
    if oom:
        step = math.inf
    flops_done = sum(x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in profile.layers) * plan.global_batch
    peers = snapshot.by_id()
    capacity = sum(peers[pid].flops for st in plan.stages for pid in st.peers)
    return SimResult(
        step_s=step, pipeline_s=max(stage_end), stage_end_s=tuple(stage_end), allreduce_s=tuple(ar_times),
        peer_busy_s={workers[k][1].id: busy[k] for k in range(nw)}, bytes_on_wire=wire,
        compute_utilization=flops_done / (capacity * step) if 0 < step < math.inf else 0.0,
        peak_memory_bytes=peak_memory, out_of_memory=oom,
    )


def _ring_latency(peers, links: LinkTable, seed: int, stage: int) -> float:
    """The ring's 2(n-1) one-way delays, each step as slow as its slowest edge (with jitter)."""
    n = len(peers)
    edges = [links.get(peers[i], peers[(i + 1) % n]) for i in range(n)]
    total = 0.0
    for step in range(2 * (n - 1)):
        total += max(max(0.0, e.rtt_s / 2 + e.jitter_s * _jitter(seed, "ar", stage, step, i))
                     for i, e in enumerate(edges))
    return total
