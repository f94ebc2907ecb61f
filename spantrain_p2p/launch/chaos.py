"""Fault injection for ``spantrain swarm --chaos``: what to do to the swarm, and when (``parse``), and
the message that changes the peers' emulated links (``set_link_factor``); ``follow.RunFollower``
fires them.

    kill:PEER@step=K          SIGKILL a scenario peer once the swarm has completed K steps
    kill:planner@step=K       the same for whichever peer holds the planner lease then
    kill:worker@step=K        the same for a peer of the stage map that is not the planner
    join:PEER@step=K          hold a scenario peer back from the launch; start it at step K
    degrade:A-B:F@WHEN        links between regions A and B carry F x bandwidth (F = 0: cut; what is under
                              way waits until they are restored)
    restore:A-B@WHEN          back to the scenario's bandwidth
    byzantine:PEER:ATTACK     the peer sends forged contributions from its start (``robust.attacks``:
                              signflip, signflip1000, random1000, alie, ipm, stale, zero)

A link change happens at ``@step=K`` (the swarm completed K steps), ``@t=S`` (S seconds after every
peer of the first stage map completed its first step: training's start, however slowly the swarm
formed) or ``@after=S`` (S seconds after the event listed before it fired: a cut of a set length).
Every trigger is a step or an event of the run, never a time from the launch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# the data-plane kind of a link-factor change: peer.emulation.CHAOS_KIND (tests/test_chaos.py ties them;
# importing the peer package here would cost the launcher ~2.7 s of torch and hivemind imports)
CHAOS_KIND = "chaos"

_RE = re.compile(r"^(kill|join|degrade|restore):([A-Za-z0-9_.\-]+?)(?::([0-9.]+))?@(step|t|after)=([0-9.]+)$")


@dataclass(frozen=True)
class Chaos:
    action: str  # kill | join | degrade | restore
    target: str  # peer name, "planner", or "A-B" (regions)
    at_step: Optional[int] = None
    at_t: Optional[float] = None  # seconds after training's start
    factor: float = 1.0
    after_s: Optional[float] = None  # seconds after the event listed before this one fired
    attack: str = ""  # byzantine: what the peer forges

    @property
    def regions(self) -> tuple[str, str]:
        a, _, b = self.target.partition("-")
        return a, b

    def describe(self) -> str:
        when = (f"step {self.at_step}" if self.at_step is not None else f"t={self.at_t:g}s" if self.at_t is not None
                else f"{self.after_s:g}s after the event before")
        extra = f" x{self.factor:g}" if self.action == "degrade" else f" ({self.attack})" if self.attack else ""
        return f"{self.action} {self.target}{extra} at {when}"


_BYZANTINE = re.compile(r"^byzantine:([A-Za-z0-9_.\-]+):([a-z0-9]+)$")


def parse(spec: str, peers: list[str], regions: list[str]) -> Chaos:
    """One --chaos spec, checked against the scenario's peer and region names."""
    b = _BYZANTINE.match(spec.strip())
    if b:
        from ..robust.attacks import ATTACKS

        if b.group(1) not in peers:
            raise ValueError(f"--chaos {spec!r}: no peer {b.group(1)!r} in the scenario")
        if b.group(2) not in ATTACKS:
            raise ValueError(f"--chaos {spec!r}: attack {b.group(2)!r} is not one of {', '.join(ATTACKS)}")
        return Chaos("byzantine", b.group(1), at_step=0, attack=b.group(2))
    m = _RE.match(spec.strip())
    if not m:
        raise ValueError(f"--chaos {spec!r}: want kill:PEER@step=K, kill:planner@step=K, join:PEER@step=K, "
                         "degrade:A-B:F@WHEN or restore:A-B@WHEN (WHEN: step=K, t=S or after=S)")
    action, target, factor, unit, value = m.groups()
    if action in ("kill", "join"):
        if unit != "step":
            raise ValueError(f"--chaos {spec!r}: {action} happens at a step (@step=K)")
        if target not in peers and not (action == "kill" and target in ("planner", "worker")):
            raise ValueError(f"--chaos {spec!r}: no peer {target!r} in the scenario")
        if factor is not None:
            raise ValueError(f"--chaos {spec!r}: {action} takes no factor")
        return Chaos(action, target, at_step=int(float(value)))
    when = {"step": {"at_step": int(float(value))}, "t": {"at_t": float(value)}, "after": {"after_s": float(value)}}[unit]
    a, sep, b = target.partition("-")
    if not sep or a not in regions or b not in regions or a == b:
        raise ValueError(f"--chaos {spec!r}: {target!r} must be REGION-REGION (regions: {', '.join(regions)})")
    if action == "degrade":
        if factor is None or not 0 <= float(factor) <= 1e6:
            raise ValueError(f"--chaos {spec!r}: degrade needs a factor (degrade:A-B:0.1@t=20; 0 cuts the links)")
        return Chaos(action, target, factor=float(factor), **when)
    if factor is not None:
        raise ValueError(f"--chaos {spec!r}: restore takes no factor")
    return Chaos(action, target, factor=1.0, **when)


def check_order(chaos: list[Chaos]) -> None:
    """An ``@after`` event needs an event before it on the command line."""
    if chaos and chaos[0].after_s is not None:
        raise ValueError(f"--chaos {chaos[0].action}:{chaos[0].target}@after=...: 'after' counts from the --chaos "
                         "listed before it, and this is the first")


def set_link_factor(urls: list[str], regions: tuple[str, str], factor: float,
                    operator_path: str = "") -> list[Optional[Exception]]:
    """Tells every peer to run its emulated links between two regions at ``factor`` x bandwidth;
    the error of each peer that did not take it (None where it did). ``operator_path``: the
    launcher's identity file (its peer id went to the peers as ``--operator``)."""
    import asyncio

    from ..net.client import DataPlaneClient
    from ..net.handshake import Authenticator
    from ..swarm.identity import Identity

    async def send_all():
        # peers take messages on authenticated connections only: the launcher has an identity of its own
        me = Identity.load(operator_path) if operator_path else Identity.generate()
        client = DataPlaneClient(auth=Authenticator(me))
        try:
            header = {"regions": list(regions), "factor": factor}
            return await asyncio.gather(*(client.send(u, CHAOS_KIND, header, timeout=5) for u in urls),
                                        return_exceptions=True)
        finally:
            await client.close()

    return [r if isinstance(r, Exception) else None for r in asyncio.run(send_all())]
