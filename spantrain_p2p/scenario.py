"""Scenario files (``peers/*.toml``): an emulated wide-area swarm on one machine.

The schema is documented in README.md ("Scenario files"). ``load`` parses and checks a file and
returns a frozen ``Scenario``; every mistake is reported as ``ScenarioError`` naming the field.
The runtime's profiler and prober never read this: only the launcher and the emulator do.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class LinkClass:
    name: str
    rtt_ms: float
    mbps: float
    jitter_ms: float = 0.0


@dataclass(frozen=True)
class DeviceClass:
    name: str
    tflops: float
    memory_gb: float
    gpus: int = 1
    gpu: str = ""  # the catalogue's GPU (``gpus.CATALOGUE``) that gave tflops and memory_gb, if any


@dataclass(frozen=True)
class RegionLink:
    a: str
    b: str
    link: str
    trace: tuple[tuple[float, float], ...] = ()  # (t seconds, bandwidth factor), t ascending


@dataclass(frozen=True)
class ScenarioPeer:
    name: str
    region: str
    device: str
    uplink_mbps: Optional[float] = None
    # peers that give the same host share one machine: their connections stay on it (not encrypted,
    # as two real peers of one machine connect: ``net.handshake``); "": a machine of its own
    host: str = ""


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    compute_scale: float
    link_classes: dict[str, LinkClass]
    device_classes: dict[str, DeviceClass]
    regions: dict[str, str]  # region -> link class used between its peers
    region_links: tuple[RegionLink, ...]
    peers: tuple[ScenarioPeer, ...]
    default_link: str = ""
    path: str = ""
    extra: dict = field(default_factory=dict)
    # K: the emulated world runs K times slower than the real one it stands for (device speed / K,
    # bandwidth / K, delays and trace times x K); K < 1 runs it faster. Reported figures are
    # converted back to real time (``launch.real_time``).
    time_dilation: float = 1.0

    @property
    def device_scale(self) -> float:
        """A virtual device's real speed over its configured one: ``compute_scale / time_dilation``."""
        return self.compute_scale / self.time_dilation

    def peer(self, name: str) -> ScenarioPeer:
        for p in self.peers:
            if p.name == name:
                return p
        raise ScenarioError(f"scenario {self.name!r} has no peer {name!r} (peers: {', '.join(p.name for p in self.peers)})")

    def link_between(self, src: str, dst: str) -> tuple[LinkClass, tuple[tuple[float, float], ...]]:
        """The link class (and bandwidth trace) from peer ``src`` to peer ``dst``."""
        ra, rb = self.peer(src).region, self.peer(dst).region
        if ra == rb:
            return self.link_classes[self.regions[ra]], ()
        for rl in self.region_links:
            if {rl.a, rl.b} == {ra, rb}:
                return self.link_classes[rl.link], rl.trace
        return self.link_classes[self.default_link], ()

    def device_of(self, peer: str) -> DeviceClass:
        return self.device_classes[self.peer(peer).device]


def _num(d: dict, key: str, where: str, lo: float = 0.0, default: Any = None, positive: bool = True) -> float:
    if key not in d:
        if default is not None:
            return default
        raise ScenarioError(f"{where}: missing {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or (positive and v <= 0):
        raise ScenarioError(f"{where}.{key} must be a {'positive ' if positive else ''}number, not {v!r}")
    return float(v)


def _device(k: str, v: Any, w: str) -> DeviceClass:
    """A device class: ``tflops`` and ``memory_gb`` as given, or from ``gpu = "NAME"`` (the
    catalogue, ``gpus``) times ``gpus``, at ``efficiency`` (default 1: the data sheet's peak)."""
    if not isinstance(v, dict):
        raise ScenarioError(f"{w} must be a table")
    gpus = _num(v, "gpus", w, default=1)
    if gpus != int(gpus):
        raise ScenarioError(f"{w}.gpus must be a whole number, not {gpus!r}")
    if "gpu" not in v:
        return DeviceClass(k, _num(v, "tflops", w), _num(v, "memory_gb", w), int(gpus))
    from .gpus import gpu

    name = v["gpu"]
    if not isinstance(name, str):
        raise ScenarioError(f"{w}.gpu must be a GPU name, not {name!r}")
    try:
        g = gpu(name)
    except KeyError as e:
        raise ScenarioError(f"{w}.gpu: {e.args[0]}") from None
    if "tflops" in v:
        raise ScenarioError(f"{w}: give gpu or tflops, not both (gpu sets tflops from the catalogue)")
    eff = _num(v, "efficiency", w, default=1.0)
    if eff > 1:
        raise ScenarioError(f"{w}.efficiency is the fraction of the peak reached, at most 1, not {eff!r}")
    return DeviceClass(k, g.tflops * gpus * eff, _num(v, "memory_gb", w, default=g.memory_gb * gpus), int(gpus), name)


EMULABLE_TFLOPS = 1.0  # fastest virtual device a CPU core can pad to (it must compute faster than it)
MIN_OP_S = 0.002  # shortest padded op a proxy (--workload) keeps up with among a swarm's peers here


def emulation_warning(s: Scenario, smallest_op_flops: Optional[float] = None) -> Optional[str]:
    """Why a live run of ``s`` on this machine's CPU would be unfaithful, or None. Without a
    workload: a virtual device faster than a CPU core computes (``tflops x device_scale`` over
    ``EMULABLE_TFLOPS``). With one (``smallest_op_flops``: its smallest padded op of a micro-batch):
    that op shorter than ``MIN_OP_S`` on the fastest device (the proxy's CPU time overruns it)."""
    fastest = max((d.tflops * s.device_scale, d.name) for d in s.device_classes.values())
    if smallest_op_flops is not None:
        op_s = smallest_op_flops / (fastest[0] * 1e12)
        if op_s >= MIN_OP_S:
            return None
        return (f"scenario {s.name!r}: the workload's smallest op takes {op_s * 1e3:.2g} ms on device class "
                f"{fastest[1]!r} in this emulation, under the {MIN_OP_S * 1e3:g} ms a proxy keeps up with here: "
                f"fidelity will suffer. Raise time_dilation to about {s.time_dilation * MIN_OP_S / op_s:.2g}")
    if fastest[0] <= EMULABLE_TFLOPS:
        return None
    return (f"scenario {s.name!r}: device class {fastest[1]!r} runs at {fastest[0]:g} TFLOP/s virtual, faster than "
            f"a CPU can compute ({EMULABLE_TFLOPS:g}): its peers cannot keep the virtual pace, so step times and "
            f"fidelity will be wrong. Emulate a workload on it (--workload, with a time_dilation its ops keep up "
            f"with), plan it offline (`spantrain plan --scenario ... --workload ...`), or raise time_dilation")


def _table(d: dict, key: str, where: str) -> dict:
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ScenarioError(f"{where}: {key!r} must be a table")
    return v


def parse(data: dict, path: str = "") -> Scenario:
    where = path or "scenario"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{where}: missing 'name'")
    links = {}
    for k, v in _table(data, "link_classes", where).items():
        w = f"link_classes.{k}"
        links[k] = LinkClass(k, _num(v, "rtt_ms", w), _num(v, "mbps", w), _num(v, "jitter_ms", w, default=0.0, positive=False))
    devices = {}
    for k, v in _table(data, "device_classes", where).items():
        w = f"device_classes.{k}"
        devices[k] = _device(k, v, w)
    if not links or not devices:
        raise ScenarioError(f"{where}: needs at least one [link_classes.X] and one [device_classes.X]")
    default_link = data.get("default_link", "")
    if default_link and default_link not in links:
        raise ScenarioError(f"{where}: default_link {default_link!r} is not a link class")
    regions = {}
    for k, v in _table(data, "regions", where).items():
        link = v.get("link") if isinstance(v, dict) else None
        if link not in links:
            raise ScenarioError(f"regions.{k}.link must name a link class, not {link!r}")
        regions[k] = link
    rlinks = []
    for i, v in enumerate(data.get("region_links", [])):
        w = f"region_links[{i}]"
        pair = v.get("regions")
        if not (isinstance(pair, list) and len(pair) == 2 and all(r in regions for r in pair) and pair[0] != pair[1]):
            raise ScenarioError(f"{w}.regions must name two different regions, not {pair!r}")
        if v.get("link") not in links:
            raise ScenarioError(f"{w}.link must name a link class, not {v.get('link')!r}")
        trace = []
        for j, pt in enumerate(v.get("trace", [])):
            if not (isinstance(pt, list) and len(pt) == 2):
                raise ScenarioError(f"{w}.trace[{j}] must be [t_seconds, factor]")
            t, f = _num({"t": pt[0]}, "t", f"{w}.trace[{j}]", positive=False), _num({"f": pt[1]}, "f", f"{w}.trace[{j}]")
            if trace and t <= trace[-1][0]:
                raise ScenarioError(f"{w}.trace times must increase")
            trace.append((t, f))
        rlinks.append(RegionLink(pair[0], pair[1], v["link"], tuple(trace)))
    peers = []
    for i, v in enumerate(data.get("peers", [])):
        w = f"peers[{i}]"
        pname, region, device = v.get("name"), v.get("region"), v.get("device")
        if not isinstance(pname, str) or not pname or len(pname) > 64:
            raise ScenarioError(f"{w}.name must be a short non-empty string")
        if region not in regions:
            raise ScenarioError(f"{w} ({pname}): region {region!r} is not defined")
        if device not in devices:
            raise ScenarioError(f"{w} ({pname}): device {device!r} is not defined")
        up = _num(v, "uplink_mbps", w, default=0.0, positive=False) or None
        host = v.get("host", "")
        if not isinstance(host, str) or len(host) > 64:
            raise ScenarioError(f"{w} ({pname}): host must be a short string")
        peers.append(ScenarioPeer(pname, region, device, up, host))
    if not peers:
        raise ScenarioError(f"{where}: no [[peers]]")
    names = [p.name for p in peers]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}: peer names must be unique")
    used = {p.region for p in peers}
    missing = [(a, b) for a in sorted(used) for b in sorted(used) if a < b and not any({r.a, r.b} == {a, b} for r in rlinks)]
    if missing and not default_link:
        raise ScenarioError(f"{where}: no link between regions {missing[0][0]} and {missing[0][1]} (add a [[region_links]] or default_link)")
    return Scenario(
        name=name, description=str(data.get("description", "")),
        compute_scale=_num(data, "compute_scale", where, default=1.0),
        time_dilation=_num(data, "time_dilation", where, default=1.0),
        link_classes=links, device_classes=devices, regions=regions, region_links=tuple(rlinks),
        peers=tuple(peers), default_link=default_link, path=path,
    )


def load(path: str) -> Scenario:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ScenarioError(f"scenario file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    return parse(data, path)


def write_dilated(path: str, time_dilation: float, out_path: str) -> str:
    """A copy of scenario ``path`` at ``out_path`` that runs at ``time_dilation`` (the launcher's
    ``--time-dilation``: the same world in real units, emulated K times slower; the peers read the
    copy). Its top-level ``time_dilation`` line is replaced; the copy is checked as a scenario."""
    if not (isinstance(time_dilation, (int, float)) and 0 < time_dilation <= 1e6):
        raise ScenarioError(f"--time-dilation must be a number in (0, 1e6], not {time_dilation!r}")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    top = next((i for i, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines))
    kept = [line for i, line in enumerate(lines)
            if i >= top or not line.replace(" ", "").startswith("time_dilation=")]
    text = f"time_dilation = {float(time_dilation)!r}  # --time-dilation, over {path}\n" + "\n".join(kept) + "\n"
    s = parse(tomllib.loads(text), out_path)
    if s.time_dilation != float(time_dilation):
        raise ScenarioError(f"{path}: could not set time_dilation in a copy")
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(text)
    return out_path
