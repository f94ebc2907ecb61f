"""Verified computation, the pure parts: what a peer keeps for the checks, what it attests, and
how a check decides.

Every peer keeps the pipeline messages it sent and received in the last few steps (``Ledger``: the
header and the bytes, as they crossed the wire, and their digests). A replica picks, with
probability p a step, one micro-batch of another replica (``choose``), fetches its inputs and
outputs from the neighbours that sent and received them and recomputes it with the same weights
(the replicas' weights are equal until the step's optimizer step); the peer then signs the digests
of what it received and sent for it (``attestation``). Outputs further than the tolerance from the
recomputation (``relative_error``), on inputs the peer attests, convict it. A neighbour shown the
attestation checks it against its own digests (``disagreements``): a peer that signs other than
what it sent is caught by the one it sent it to.
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Mapping, Optional, Sequence

import torch

# a check's tolerance on ||theirs - mine|| / ||mine||, by precision: above the float noise of one
# machine's threads and kernels (fp32 about 1e-6, bf16 about 1e-2: scripts/attack_figures.py
# --clean-steps reports the largest seen) and far below any forgery that matters
TOLERANCE = {"fp32": 1e-3, "bf16": 0.1, "fp16": 0.1}
P_DEFAULT = 0.05  # a replica checks one micro-batch of another this often (per step)
KEEP_STEPS = 3  # steps of messages a peer keeps for its neighbours' replicas' checks
SLOTS = ("recv/act", "send/act", "recv/grad", "send/grad")  # per micro-batch, what an attestation names
_DIGEST_FIELDS = ("kind", "job", "epoch", "step", "mb", "src", "dtype", "shape", "comp")


def digest(header: Mapping, buffers: Sequence) -> str:
    """The digest of one message as it crossed the wire: its identifying fields and its bytes."""
    h = hashlib.sha256()  # (SHA-NI: 1.9 GB/s here, blake2b 1.2)
    h.update(repr([header.get(k) for k in _DIGEST_FIELDS]).encode())
    for b in buffers:
        h.update(b)
    return h.hexdigest()[:32]


class Ledger:
    """The pipeline messages of the last ``KEEP_STEPS`` steps: (step, mb, slot, peer) -> (header,
    bytes); ``mine(step)``: per micro-batch, slot -> digest (what this peer attests)."""

    def __init__(self, keep_steps: int = KEEP_STEPS):
        self.keep = keep_steps
        self._msgs: "OrderedDict[tuple, tuple[dict, list[memoryview], str]]" = OrderedDict()
        self._mine: dict[int, dict[int, dict[str, str]]] = {}

    def put(self, slot: str, peer: str, header: Mapping, buffers: Sequence) -> str:
        step, mb = int(header["step"]), int(header["mb"])
        newest = max(self._mine, default=step)
        if step < newest - self.keep:
            return ""
        d = digest(header, buffers)
        # the buffers as they are (not copied): a received frame's memory is its own, a sent
        # tensor's is never written again
        self._msgs[(step, mb, slot, peer)] = (dict(header), [memoryview(b) for b in buffers], d)
        self._mine.setdefault(step, {}).setdefault(mb, {})[slot] = d
        for old in [s for s in self._mine if s < step - self.keep]:
            del self._mine[old]
            for key in [k for k in self._msgs if k[0] == old]:
                del self._msgs[key]
        return d

    def get(self, step: int, mb: int, slot: str, peer: str) -> Optional[tuple[dict, list[memoryview], str]]:
        return self._msgs.get((step, mb, slot, peer))

    def exchanged(self, step: int, peer: str) -> dict[int, list[str]]:
        """micro-batch -> this peer's slots of the messages it exchanged with ``peer`` in ``step``."""
        out: dict[int, list[str]] = {}
        for (s, mb, slot, p) in self._msgs:
            if s == step and p == peer:
                out.setdefault(mb, []).append(slot)
        return out

    def mine(self, step: int) -> dict[int, dict[str, str]]:
        return self._mine.get(step, {})

    def clear(self) -> None:
        self._msgs.clear()
        self._mine.clear()


def attestation(job: str, epoch: int, step: int, mb: int, slots: Mapping[str, str]) -> dict:
    """What a peer signs when a replica checks one of its micro-batches (``records.sign_payload``):
    the digests of what it received and sent for it."""
    return {"job": job, "epoch": epoch, "step": step, "mb": mb, "slots": dict(slots)}


def parse_attestation(d: Mapping) -> tuple[str, int, int, int, dict[str, str]]:
    """(job, epoch, step, mb, slot -> digest) of an untrusted attestation; ValueError saying why not."""
    job, epoch, step, mb, slots = d.get("job"), d.get("epoch"), d.get("step"), d.get("mb"), d.get("slots")
    if not isinstance(job, str) or not all(isinstance(x, int) and not isinstance(x, bool) for x in (epoch, step, mb)) \
            or not isinstance(slots, dict) or not set(slots) <= set(SLOTS) \
            or not all(isinstance(x, str) and len(x) == 32 for x in slots.values()):
        raise ValueError("an attestation is {job, epoch, step, mb, slots: {slot: digest}}")
    return job, epoch, step, mb, dict(slots)


# what a slot of the sender's attestation is, seen from the peer at the other end of the message
OTHER_END = {"send/act": "recv/act", "recv/act": "send/act", "send/grad": "recv/grad", "recv/grad": "send/grad"}


def disagreements(theirs: Mapping[int, Mapping[str, str]], mine: Mapping[int, Mapping[str, str]],
                  exchanged: Mapping[int, Sequence[str]]) -> list[str]:
    """Where a neighbour's signed digests contradict this peer's own record of the messages they
    exchanged (``exchanged``: micro-batch -> this peer's slots of messages with that neighbour)."""
    out = []
    for m, slots in exchanged.items():
        for slot in slots:
            have = mine.get(m, {}).get(slot)
            said = theirs.get(m, {}).get(OTHER_END[slot])
            if have is not None and said is not None and said != have:  # (left out: not yet there, or withheld)
                out.append(f"micro-batch {m} {OTHER_END[slot]}: signed {str(said)[:8]}, was {have[:8]}")
    return out


def choose(rng: random.Random, p: float, mbs_of: Mapping[str, Sequence[int]], suspects: Sequence[str] = ()) -> list[tuple[str, int]]:
    """The checks of one step: a random micro-batch of every suspect, and with probability ``p`` one
    random micro-batch of one random other replica (``mbs_of``: replica -> its micro-batches)."""
    out = [(s, rng.choice(list(mbs_of[s]))) for s in sorted(suspects) if mbs_of.get(s)]
    if rng.random() < p:
        peers = sorted(x for x, mbs in mbs_of.items() if mbs and x not in suspects)
        if peers:
            x = rng.choice(peers)
            out.append((x, rng.choice(list(mbs_of[x]))))
    return out


def relative_error(theirs: torch.Tensor, mine: torch.Tensor) -> float:
    """||theirs - mine|| / ||mine|| in float32 (1.0 against a zero ``mine`` that ``theirs`` is not), on
    ``mine``'s device (a received tensor is on the host, a recomputation where the stage runs: on a GPU
    the two devices had made every spot check fail, "no check of ...")."""
    a, b = theirs.detach().to(mine.device).float().reshape(-1), mine.detach().float().reshape(-1)
    if a.shape != b.shape:
        return float("inf")
    n = float(torch.linalg.vector_norm(b))
    d = float(torch.linalg.vector_norm(a - b))
    return d / n if n > 0 else (0.0 if d == 0 else 1.0)
