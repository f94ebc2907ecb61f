"""What a Byzantine peer sends instead of its honest contribution: the attack harness behind
``spantrain swarm --chaos byzantine:PEER:ATTACK`` (a peer started with ``--byzantine ATTACK``).

Each attack turns the honest part ``mine`` (a sum over ``weight`` samples) into the one sent.
``others`` are the other contributors' parts where the attack reads them first (an omniscient
attacker: it waits for the honest parts, which honest peers send as soon as they have them):

- ``signflip``: -mine;  ``signflip1000``: -1000 x mine;
- ``random1000``: a random direction at 1000 x mine's norm;
- ``alie`` (a little is enough, Baruch et al. 2019): the honest mean minus z = 1 honest standard
  deviations, coordinate-wise: inside the honest spread, built to pass robust rules;
- ``ipm`` (inner-product manipulation, Xie et al. 2020): -0.5 x the honest mean;
- ``stale``: the part it sent at the previous step (its gradient of old weights);
- ``zero``: zeros (a free rider).

And on the pipeline (what the peer sends its neighbours: activations forward, their gradients
back; its gradient-sum parts stay honest): ``zeroact``: zeros; ``scaleact``: x ``ACT_SCALE``;
``noiseact``: its tensor plus noise of the same norm (the norm then rises only sqrt(2) x).
Every attack keeps the wire format (shape, dtype, finite values): only the numbers lie.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

BOUNDARY = ("zeroact", "scaleact", "noiseact")
ATTACKS = ("signflip", "signflip1000", "random1000", "alie", "ipm", "stale", "zero") + BOUNDARY
OMNISCIENT = ("alie", "ipm")
ALIE_Z = 1.0
IPM_EPS = 0.5
ACT_SCALE = 100.0


def check(attack: str) -> str:
    if attack not in ATTACKS:
        raise ValueError(f"unknown Byzantine attack {attack!r} (one of {', '.join(ATTACKS)})")
    return attack


def forge(attack: str, mine: torch.Tensor, weight: float, others: Mapping[str, tuple[torch.Tensor, float]] = {},
          previous: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The part a Byzantine peer sends in place of ``mine`` (``others``: peer -> (part, weight))."""
    if attack == "signflip":
        return -mine
    if attack == "signflip1000":
        return mine * -1000.0
    if attack == "random1000":
        d = torch.randn(mine.shape, generator=generator, dtype=torch.float32).to(mine.dtype)
        return d * (1000.0 * float(torch.linalg.vector_norm(mine)) / max(float(torch.linalg.vector_norm(d)), 1e-30))
    if attack == "zero":
        return torch.zeros_like(mine)
    if attack == "stale":
        return previous.clone() if previous is not None else mine
    if attack in OMNISCIENT:
        means = [mine / max(weight, 1e-9)] + [p / max(w, 1e-9) for p, w in others.values() if w > 0]
        stacked = torch.stack(means)
        mu = stacked.mean(0)
        if attack == "ipm":
            return mu * (-IPM_EPS * weight)
        sigma = stacked.std(0, unbiased=False) if len(means) > 1 else torch.zeros_like(mu)
        return (mu - ALIE_Z * sigma) * weight
    raise ValueError(f"unknown Byzantine attack {attack!r}")


def forge_boundary(attack: str, t: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """What a Byzantine stage sends its neighbour in place of ``t`` (an activation or its gradient)."""
    if attack == "zeroact":
        return torch.zeros_like(t)
    if attack == "scaleact":
        return t * ACT_SCALE
    if attack == "noiseact":
        d = torch.randn(t.shape, generator=generator, dtype=torch.float32)
        scale = float(torch.linalg.vector_norm(t.float())) / max(float(torch.linalg.vector_norm(d)), 1e-30)
        return (t.float() + d * scale).to(t.dtype)
    return t
