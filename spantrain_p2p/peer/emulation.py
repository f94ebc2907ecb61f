"""A peer that behaves as a scenario peer: its virtual device, its shaped outgoing links, and the
handler through which the local launcher changes those links (``spantrain swarm --chaos
degrade/restore``)."""
from __future__ import annotations

import logging
from typing import Callable, Optional

log = logging.getLogger("spantrain.peer")

CHAOS_KIND = "chaos"  # the data-plane message kind of a link-factor change


def start_emulation(spec: str, t0: Optional[float]):
    """(LinkEmulator, VirtualDevice) of the scenario peer ``spec`` = "SCENARIO:PEER"; its traces count
    from ``t0`` (CLOCK_MONOTONIC; None: now)."""
    from .. import scenario as sc
    from ..net.emulator import LinkEmulator
    from ..profile.virtual import VirtualDevice

    path, _, name = spec.rpartition(":")
    s = sc.load(path)
    dev = s.device_of(name)
    emulator = LinkEmulator(s, name, t0=t0)
    device = VirtualDevice(dev.tflops, s.device_scale, memory_bytes=int(dev.memory_gb * 2**30))
    log.info("emulating %s of %s: %s, links shaped from this peer", name, s.name, device)
    return emulator, device


def machine_of(peer) -> Callable[[], str]:
    """The machine ``peer`` says it is on in its handshakes (``handshake.Authenticator.host``): this
    one, unless it emulates a scenario peer: then its scenario host, or a machine of its own (a
    scenario's peers share this machine to stand for machines whose connections are encrypted)."""
    def machine() -> str:
        em = peer.emulator
        if em is None:
            return "this machine"
        return f"scenario host {em.me.host}" if em.me.host else f"scenario peer {em.self_name}"
    return machine


def emulated_link(emulator, name: str):
    """The emulated link to the scenario peer ``name`` (None when not emulating, or for a peer outside
    the scenario)."""
    if emulator is None:
        return None
    try:
        return emulator.link_for(name)
    except Exception:
        return None


def chaos_handler(get_emulator: Callable[[], object], operator: str = ""):
    """The data-plane handler of ``CHAOS_KIND``: fault injection by the local launcher, which changes the
    emulated links between two regions (``{'regions': [A, B], 'factor': F}``, F x bandwidth). Taken
    from ``operator`` only (the launcher's peer id, ``--operator``): a member cannot cut links."""

    async def on_chaos(header: dict, buffers) -> tuple[dict, list]:
        from ..net.framing import FrameError

        if not operator or header.get("src") != operator:
            raise FrameError("chaos is taken from this peer's operator only (--operator)")

        regions, factor = header.get("regions"), header.get("factor")
        if not (isinstance(regions, list) and len(regions) == 2 and all(isinstance(r, str) for r in regions)
                and isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 <= factor <= 1e3):
            raise FrameError("chaos wants {'regions': [A, B], 'factor': F}")
        changed = get_emulator().set_factor((regions[0], regions[1]), float(factor))
        if changed:
            log.info("links to %s now at %g x bandwidth", ", ".join(changed), factor)
        return {"changed": changed}, []

    return on_chaos
