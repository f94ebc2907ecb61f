"""Plain frozen data the planner works on: peers, links, a model's per-layer profile, plans.

Everything here is pure data with validation; no network and no torch (the reference
model's shape and FLOPs come from ``plan.model``).

Units: seconds, bytes, bytes/second, FLOP, FLOP/second. Scenario and measurement files
speak in ms, Mbit/s, TFLOP/s and GB; the ``from_*`` constructors convert.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping, Optional

from ..net.framing import strict_from_dict
from ..pipeline.assignment import assign_microbatches
from ..pipeline.schedule import SCHEDULE_NAMES
from .model import ModelConfig, block_params, embed_params, flops_per_layer, head_params, num_params

MAX_PEERS = 100_000
MAX_LINKS = 5_000_000
MAX_ID_LEN = 128
GIB = float(2**30)
# device <-> host copies, bytes/s, where a peer says nothing: PCIe 4.0 x16 in practice (~25 GB/s
# peak); a CPU's own memory copies ran at 14 GB/s on this box
HOST_BYTES_PER_S = 12e9


def _finite(name: str, v: Any, lo: float = 0.0, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or (positive and v <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}finite number, not {v!r}")
    return float(v)


def _peer_id(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_ID_LEN:
        raise ValueError(f"{name} must be a non-empty string of at most {MAX_ID_LEN} characters, not {v!r}")
    return v


# ----------------------------------------------------------------------------------- peers


@dataclass(frozen=True)
class PeerInfo:
    """One peer as the planner sees it: effective FLOP/s and usable memory in bytes."""

    id: str
    flops: float
    memory_bytes: float
    region_hint: str = ""
    host_bytes_per_s: float = HOST_BYTES_PER_S  # copies between its device and host memory (offloading)
    # after each step, seconds per byte of a stage's weights: its optimizer step, as it measured it
    # (``profile.step_tail``); 0: unknown
    step_s_per_param_byte: float = 0.0
    # the same on its host CPU, measured where the job offloads its optimizer; 0: unknown (the model
    # profile's ``host_step_s_per_param_byte`` is the price then)
    host_step_s_per_param_byte: float = 0.0

    def __post_init__(self) -> None:
        _peer_id("peer id", self.id)
        object.__setattr__(self, "flops", _finite(f"peer {self.id}: flops", self.flops))
        object.__setattr__(self, "memory_bytes", _finite(f"peer {self.id}: memory_bytes", self.memory_bytes))
        object.__setattr__(self, "host_bytes_per_s", _finite(f"peer {self.id}: host_bytes_per_s", self.host_bytes_per_s))
        for name in ("step_s_per_param_byte", "host_step_s_per_param_byte"):
            object.__setattr__(self, name, _finite(f"peer {self.id}: {name}", getattr(self, name), positive=False))
        if not isinstance(self.region_hint, str):
            raise ValueError(f"peer {self.id}: region_hint must be a string")


@dataclass(frozen=True)
class Link:
    """A directed link: round-trip time (s), bandwidth (bytes/s), delay jitter (s, +-)."""

    rtt_s: float
    bandwidth: float
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "rtt_s", _finite("rtt_s", self.rtt_s, positive=False))
        object.__setattr__(self, "bandwidth", _finite("bandwidth", self.bandwidth))
        object.__setattr__(self, "jitter_s", _finite("jitter_s", self.jitter_s, positive=False))

    def transfer_s(self, nbytes: float) -> float:
        """One message: half the RTT (one-way delay) plus the bytes at the link's bandwidth."""
        return self.rtt_s / 2 + nbytes / self.bandwidth


@dataclass(frozen=True)
class Network:
    """Pairwise links, directed. A pair may be absent or mapped to ``None``: unknown.

    ``link(a, b)`` falls back to the reverse direction when only that one is known, so a
    symmetric network needs each pair once.
    """

    links: Mapping[tuple[str, str], Optional[Link]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.links) > MAX_LINKS:
            raise ValueError(f"network has {len(self.links)} links, over the {MAX_LINKS} limit")
        for key, v in self.links.items():
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(x, str) for x in key)):
                raise ValueError(f"network link key must be a (src, dst) pair of peer ids, not {key!r}")
            if v is not None and not isinstance(v, Link):
                raise ValueError(f"network link {key} must be a Link or None, not {type(v).__name__}")

    def link(self, a: str, b: str) -> Optional[Link]:
        got = self.links.get((a, b))
        if got is None:
            got = self.links.get((b, a))
        return got

    def known(self) -> Iterable[tuple[str, str, Link]]:
        """Every known directed link as ``(src, dst, link)``."""
        for (a, b), v in self.links.items():
            if v is not None:
                yield a, b, v


# ----------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class LayerProfile:
    """One layer, per sample of the micro-batch (FLOP and bytes scale with its size).

    ``param_bytes`` does not scale: the layer's weights as stored (fp32: 4 bytes each).
    ``activation_bytes_out``: the tensor this layer hands to the next one, as sent over the
    wire uncompressed. ``stash_bytes``: what the layer keeps from its forward for its backward.
    ``stash_fixed_bytes``: what it keeps per micro-batch whatever the micro-batch's size (under
    autocast, the low-precision copy of its weights that each micro-batch's forward makes and keeps).
    ``input_bytes``: its input as a stage holds it, measured (what a checkpoint keeps under full
    recomputation; under autocast a block's input is the fp32 residual stream, not the bf16 the wire
    carries); 0: not measured, the previous layer's ``activation_bytes_out`` stands for it.
    """

    fwd_flops: float
    bwd_input_flops: float
    bwd_weight_flops: float
    param_bytes: float
    activation_bytes_out: float
    stash_bytes: float = 0.0
    stash_fixed_bytes: float = 0.0
    input_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fwd_flops", "bwd_input_flops", "bwd_weight_flops", "param_bytes",
                     "activation_bytes_out", "stash_bytes", "stash_fixed_bytes", "input_bytes"):
            object.__setattr__(self, name, _finite(name, getattr(self, name), positive=False))


@dataclass(frozen=True)
class ModelProfile:
    """A model as the planner sees it: its layers in order plus micro-batch independent bits.

    ``grad_bytes_per_param_byte``: gradient buffer per byte of weights (1.0: fp32 grads).
    ``optimizer_bytes_per_param_byte``: optimizer state per byte of weights (Adam: 2.0).
    ``grad_wire_bytes_per_param_byte``: bytes per weight byte in the gradient all-reduce.
    ``wire_dtype_bytes``: the activations' own width on the wire; a codec saves against it
    (``wire_ratio``: fp16 saves nothing on a bf16 activation, int8 half).
    ``host_copy_bytes_per_param_byte``, ``host_step_s_per_param_byte``: an optimizer offloaded to the
    host (``job.offload``) copies this many bytes per byte of weights between device and host each step
    (weights and gradients down, weights up: 3) and steps there in this many seconds per byte of weights.
    """

    layers: tuple[LayerProfile, ...]
    name: str = ""
    grad_bytes_per_param_byte: float = 1.0
    optimizer_bytes_per_param_byte: float = 2.0
    grad_wire_bytes_per_param_byte: float = 1.0
    wire_dtype_bytes: int = 4  # bytes per activation element on the wire, uncompressed (bf16: 2)
    host_copy_bytes_per_param_byte: float = 0.0
    host_step_s_per_param_byte: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.wire_dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"wire_dtype_bytes must be 1, 2, 4 or 8, not {self.wire_dtype_bytes!r}")
        if not self.layers:
            raise ValueError("a model profile needs at least one layer")
        if not all(isinstance(x, LayerProfile) for x in self.layers):
            raise ValueError("model profile layers must be LayerProfile")
        for name in ("grad_bytes_per_param_byte", "optimizer_bytes_per_param_byte", "grad_wire_bytes_per_param_byte",
                     "host_copy_bytes_per_param_byte", "host_step_s_per_param_byte"):
            _finite(name, getattr(self, name), positive=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "ModelProfile":
        """The profile ``to_dict`` gave, from untrusted data (a peer's ``/report``): every field
        required, else ValueError."""
        layers = d.get("layers") if isinstance(d, dict) else None
        if not isinstance(layers, list):
            raise ValueError("a model profile is a map of its fields with a list of layers")
        return strict_from_dict(cls, {**d, "layers": [strict_from_dict(LayerProfile, x, "model profile layer")
                                                       for x in layers]}, "model profile")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def state_bytes_per_param_byte(self) -> float:
        """Weights + gradients + optimizer state, per byte of weights."""
        return 1.0 + self.grad_bytes_per_param_byte + self.optimizer_bytes_per_param_byte

    def total_param_bytes(self) -> float:
        return sum(x.param_bytes for x in self.layers)

    def total_flops_per_sample(self) -> float:
        return sum(x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in self.layers)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, *, param_dtype_bytes: int = 4, wire_dtype_bytes: int = 4,
                          stash_dtype_bytes: int = 2, name: str = "") -> "ModelProfile":
        """The reference transformer (``plan.model.ModelConfig``) as a profile.

        FLOPs from ``flops_per_layer``. Backward of a matmul costs about its forward twice
        over, once for the input-grad (B) and once for the weight-grad (W), so B ~ W ~ F;
        attention's score products have no weights, so their backward all goes to B; the
        embedding has no input-grad. Stash per block follows Korthikanti et al. (2022) with
        fused attention: ``34 * T * D`` elements of ``stash_dtype_bytes / 2`` bytes.
        """
        f = flops_per_layer(cfg, 1)
        t, d, v = cfg.seq_len, cfg.dim, cfg.vocab
        attn = 4.0 * t * t * d  # QK^T and AV per sample (as flops_per_layer counts them)
        act = float(t * d * wire_dtype_bytes)
        layers = [LayerProfile(fwd_flops=f[0], bwd_input_flops=0.0, bwd_weight_flops=f[0],
                               param_bytes=float(embed_params(cfg) * param_dtype_bytes),
                               activation_bytes_out=act, stash_bytes=0.0)]
        for x in f[1:-1]:
            mm = x - attn
            layers.append(LayerProfile(fwd_flops=x, bwd_input_flops=mm + 2 * attn, bwd_weight_flops=mm,
                                       param_bytes=float(block_params(cfg) * param_dtype_bytes),
                                       activation_bytes_out=act,
                                       stash_bytes=17.0 * t * d * stash_dtype_bytes))
        layers.append(LayerProfile(fwd_flops=f[-1], bwd_input_flops=f[-1], bwd_weight_flops=f[-1],
                                   param_bytes=float(head_params(cfg) * param_dtype_bytes),
                                   activation_bytes_out=0.0,
                                   stash_bytes=float(t * d * stash_dtype_bytes + t * v * 4)))
        label = name or f"transformer d={d} L={cfg.depth} T={t} V={v} ({num_params(cfg) / 1e9:.2f}B params)"
        return cls(tuple(layers), name=label, wire_dtype_bytes=wire_dtype_bytes)


def default_planning_model(dim: int = 2048, depth: int = 24, seq_len: int = 1024, vocab: int = 32000,
                           heads: int = 16) -> ModelConfig:
    """A GPT-like model of ~1.3B parameters (d=2048, 24 blocks, T=1024): the planner's default.

    The swarm's live demo model is tiny (a CPU model); planning a scenario with it would make
    every plan latency-bound and the trade-off between compute and links meaningless.
    """
    return ModelConfig(vocab=vocab, dim=dim, depth=depth, heads=heads, seq_len=seq_len)


# -------------------------------------------------------------------------------- snapshot


def _mbps(v: float) -> float:
    return v * 1e6 / 8.0


@dataclass(frozen=True)
class Snapshot:
    """One view of the swarm: its peers and the links between them."""

    peers: tuple[PeerInfo, ...]
    network: Network = field(default_factory=Network)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", tuple(self.peers))
        if not self.peers:
            raise ValueError("a snapshot needs at least one peer")
        if len(self.peers) > MAX_PEERS:
            raise ValueError(f"snapshot has {len(self.peers)} peers, over the {MAX_PEERS} limit")
        ids = [p.id for p in self.peers]
        if len(set(ids)) != len(ids):
            raise ValueError("snapshot peer ids must be unique")

    def peer(self, pid: str) -> PeerInfo:
        for p in self.peers:
            if p.id == pid:
                return p
        raise KeyError(pid)

    def by_id(self) -> dict[str, PeerInfo]:
        return {p.id: p for p in self.peers}

    @classmethod
    def from_scenario(cls, sc: Any, emulated: bool = False) -> "Snapshot":
        """The scenario's configured numbers (``spantrain_p2p.scenario.Scenario``).

        FLOP/s = tflops * 1e12, the device's own speed in the scenario's units, as the profiler
        reports it (``spantrain swarm --measure-only``: "tflops" is the virtual device's speed
        divided by its scale); ``emulated=True`` gives the world an emulated swarm of it really
        runs in on this machine: speeds times ``compute_scale / time_dilation``, bandwidths over
        ``time_dilation``, delays times it. Mbit/s -> bytes/s (capped by the sender's
        ``uplink_mbps``); ms -> s; memory GB -> bytes (GiB, as the peers count it).
        """
        k = sc.time_dilation if emulated else 1.0
        scale = sc.compute_scale / k if emulated else 1.0
        peers = []
        for p in sc.peers:
            dev = sc.device_classes[p.device]
            peers.append(PeerInfo(p.name, dev.tflops * 1e12 * scale, dev.memory_gb * GIB, p.region))
        links: dict[tuple[str, str], Optional[Link]] = {}
        for a in sc.peers:
            for b in sc.peers:
                if a.name == b.name:
                    continue
                lc, _trace = sc.link_between(a.name, b.name)
                mbps = lc.mbps if a.uplink_mbps is None else min(lc.mbps, a.uplink_mbps)
                links[(a.name, b.name)] = Link(lc.rtt_ms / 1e3 * k, _mbps(mbps / k), lc.jitter_ms / 1e3 * k)
        return cls(tuple(peers), Network(links))

    @classmethod
    def from_measurements(cls, d: Any) -> "Snapshot":
        """The JSON of ``spantrain swarm --measure-only --json``.

        ``{"links": [{"src", "dst", "rtt_ms", "mbps"}...], "devices": [{"peer", "tflops",
        "memory_gb", "step_s_per_param_byte" (optional)}...]}`` (tflops in the scenario's units,
        memory in GiB; other keys are ignored). A link with a null ``rtt_ms``/``mbps`` or a status other than "ok" is unknown.
        Untrusted input: every field is checked, ValueError names the bad one.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"measurements must be a JSON object, not {type(d).__name__}")
        devices, links_in = d.get("devices"), d.get("links", [])
        if not isinstance(devices, list) or not devices:
            raise ValueError("measurements need a non-empty 'devices' list")
        if not isinstance(links_in, list):
            raise ValueError("measurements 'links' must be a list")
        if len(devices) > MAX_PEERS or len(links_in) > MAX_LINKS:
            raise ValueError("measurements are too large")
        peers = []
        for i, dev in enumerate(devices):
            if not isinstance(dev, Mapping):
                raise ValueError(f"devices[{i}] must be an object")
            pid = _peer_id(f"devices[{i}].peer", dev.get("peer"))
            tf = _finite(f"devices[{i}].tflops", dev.get("tflops"))
            mem = _finite(f"devices[{i}].memory_gb", dev.get("memory_gb"))
            region = dev.get("region", "")
            tail = _finite(f"devices[{i}].step_s_per_param_byte", dev.get("step_s_per_param_byte", 0.0), positive=False)
            host = _finite(f"devices[{i}].host_step_s_per_param_byte", dev.get("host_step_s_per_param_byte", 0.0),
                           positive=False)
            # 0 or absent: not measured (a job that does not offload), the default rate
            copies = _finite(f"devices[{i}].host_bytes_per_s", dev.get("host_bytes_per_s", 0.0), positive=False)
            peers.append(PeerInfo(pid, tf * 1e12, mem * GIB, region if isinstance(region, str) else "",
                                  host_bytes_per_s=copies or HOST_BYTES_PER_S,
                                  step_s_per_param_byte=tail, host_step_s_per_param_byte=host))
        known = {p.id for p in peers}
        links: dict[tuple[str, str], Optional[Link]] = {}
        for i, ln in enumerate(links_in):
            if not isinstance(ln, Mapping):
                raise ValueError(f"links[{i}] must be an object")
            src = _peer_id(f"links[{i}].src", ln.get("src"))
            dst = _peer_id(f"links[{i}].dst", ln.get("dst"))
            if src == dst or src not in known or dst not in known:
                continue  # a link to a peer without a device profile tells the planner nothing
            rtt, mbps = ln.get("rtt_ms"), ln.get("mbps")
            if rtt is None or mbps is None or ln.get("status", "ok") != "ok":
                links.setdefault((src, dst), None)
                continue
            jitter = ln.get("jitter_ms", 0.0) or 0.0
            links[(src, dst)] = Link(_finite(f"links[{i}].rtt_ms", rtt, positive=False) / 1e3,
                                     _mbps(_finite(f"links[{i}].mbps", mbps)),
                                     _finite(f"links[{i}].jitter_ms", jitter, positive=False) / 1e3)
        return cls(tuple(peers), Network(links))


# ------------------------------------------------------------------------------------ plans

# a stage's activation recomputation, as pipeline.memory.RECOMPUTE (which imports torch; the planner
# does not): tied by tests/test_memory_levers.py
RECOMPUTE = ("none", "full")
COMPRESSIONS = ("none", "fp16", "int8")  # least to most lossy; "topk:R" (0 < R < 1) also valid


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its peers (data-parallel replicas), layers ``[first, last)``, and
    each peer's weight in the micro-batches (``shares[i]`` belongs to ``peers[i]``; empty: equal).

    A plan's shares are fractions that sum to 1 (``Plan`` checks); a stage map's are whatever
    non-negative weights its planner sent (``share_of`` normalizes them).
    """

    peers: tuple[str, ...]
    layers: tuple[int, int]
    shares: tuple[float, ...] = ()
    # the stage's memory lever on its activations (``pipeline.memory``): none, or full recomputation
    # where its peers cannot hold the stash otherwise (the planner's choice, ``plan.levers``)
    recompute: str = "none"
    # the lever on its optimizer state (ZeRO-1, ``train.shard``): each replica keeps and steps the
    # state of its own share of the layers, and sends the others its updated weights
    shard: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"stage recompute must be one of {RECOMPUTE}, not {self.recompute!r}")
        if self.shard and len(self.peers) < 2:
            raise ValueError("a stage of one peer has no replicas to shard its optimizer state across")
        object.__setattr__(self, "peers", tuple(self.peers))
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "shares", tuple(float(x) for x in self.shares))
        if not self.peers or (self.shares and len(self.shares) != len(self.peers)):
            raise ValueError("a stage needs peers and one share per peer (or none)")
        if len(set(self.peers)) != len(self.peers):
            raise ValueError(f"stage peers repeat: {self.peers}")
        a, b = self.layers
        if not 0 <= a < b:
            raise ValueError(f"stage layers must be [first, last_exclusive) with first < last, got {self.layers}")
        if any(not math.isfinite(x) or x < 0 for x in self.shares):
            raise ValueError(f"stage shares must be finite and >= 0, got {self.shares}")

    @property
    def microbatch_share(self) -> dict[str, float]:
        return dict(zip(self.peers, self.shares))

    def share_of(self) -> dict[str, float]:
        """Each peer's fraction of the micro-batches (equal if the stage has no shares)."""
        shares = self.shares or tuple(1.0 for _ in self.peers)
        total = sum(shares)
        return {p: s / total for p, s in zip(self.peers, shares)}

    def assign(self, num_microbatches: int) -> list[str]:
        """The peer that runs each micro-batch of this stage (``pipeline.assignment.assign_microbatches``)."""
        return assign_microbatches(list(self.peers), list(self.share_of().values()), num_microbatches)

    def to_dict(self) -> dict:
        """The plan's JSON form (a stage map writes its own, with the raw shares)."""
        return {"peers": list(self.peers), "layers": list(self.layers),
                "microbatch_share": {p: round(s, 6) for p, s in zip(self.peers, self.shares)},
                "recompute": self.recompute, **({"shard": True} if self.shard else {})}


@dataclass(frozen=True)
class Plan:
    """A parallel strategy: ordered stages, schedule, micro-batching and per-hop compression.

    ``compression[i]`` applies to the hop between stage ``i`` and ``i + 1`` (both directions).
    ``step_s``, ``samples_per_s`` and ``bottleneck`` are the cost model's prediction (NaN /
    empty until estimated); ``simulated_step_s`` is the discrete-event simulator's.
    """

    stages: tuple[Stage, ...]
    schedule: str
    micro_batch_size: int
    num_micro_batches: int
    compression: tuple[str, ...] = ()
    step_s: float = math.nan
    samples_per_s: float = math.nan
    bottleneck: str = ""
    name: str = "planner"
    simulated_step_s: float = math.nan

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        p = len(self.stages)
        if p < 1:
            raise ValueError("a plan needs at least one stage")
        comp = tuple(self.compression) if self.compression else ("none",) * (p - 1)
        object.__setattr__(self, "compression", comp)
        if len(comp) != p - 1:
            raise ValueError(f"a plan of {p} stages needs {p - 1} compression entries, got {len(comp)}")
        for c in comp:
            compression_ratio(c)
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULE_NAMES)}")
        for n in ("micro_batch_size", "num_micro_batches"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{n} must be a positive int, got {v!r}")
        seen: set[str] = set()
        prev_end = 0
        for i, s in enumerate(self.stages):
            if len(s.shares) != len(s.peers) or abs(sum(s.shares) - 1.0) > 1e-6:
                raise ValueError(f"stage {i}: shares must be one per peer and sum to 1, got {s.shares}")
            if s.layers[0] != prev_end:
                raise ValueError(f"stage {i} starts at layer {s.layers[0]}, expected {prev_end}")
            prev_end = s.layers[1]
            if seen & set(s.peers):
                raise ValueError(f"stage {i}: peers {sorted(seen & set(s.peers))} are already in another stage")
            seen |= set(s.peers)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    def peers(self) -> list[str]:
        return [p for s in self.stages for p in s.peers]

    def with_estimate(self, step_s: float, bottleneck: str) -> "Plan":
        sps = self.global_batch / step_s if step_s > 0 and math.isfinite(step_s) else 0.0
        return replace(self, step_s=step_s, samples_per_s=sps, bottleneck=bottleneck)

    def to_dict(self) -> dict:
        """The issue-5 contract shape plus extras."""
        step = self.simulated_step_s if math.isfinite(self.simulated_step_s) else self.step_s
        sps = self.global_batch / step if step > 0 and math.isfinite(step) else 0.0
        return {
            "samples_per_s": _r(sps),
            "step_s": _r(step),
            "bottleneck": self.bottleneck,
            "stages": [s.to_dict() for s in self.stages],
            "predicted_step_s": _r(self.step_s),
            "predicted_samples_per_s": _r(self.samples_per_s),
            "simulated_step_s": _r(self.simulated_step_s),
            "schedule": self.schedule,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "compression": list(self.compression),
            "name": self.name,
        }


def _r(x: float) -> Optional[float]:
    if not math.isfinite(x):
        return None
    return float(f"{x:.6g}")


def compression_ratio(name: str) -> float:
    """Wire bytes per uncompressed (fp32) byte: none 1.0, fp16 0.5, int8 0.25 plus one fp32
    scale per 256 values, ``int:B`` (B of 2 to 7 bits) B/32 plus the same scales, ``topk:R``
    keeps a fraction R as fp16 value + int32 index (1.5 R)."""
    if name == "none":
        return 1.0
    if name == "fp16":
        return 0.5
    if name == "int8":
        return 0.25 + 1.0 / 256
    if isinstance(name, str) and name.startswith("int:") and name[4:] in ("2", "3", "4", "5", "6", "7"):
        return int(name[4:]) / 32 + 1.0 / 256
    if isinstance(name, str) and name.startswith("topk:"):
        try:
            r = float(name[5:])
        except ValueError:
            r = -1.0
        if 0.0 < r < 1.0:
            return min(1.0, 1.5 * r)
    raise ValueError(f"unknown compression {name!r}; known: none, fp16, int8, int:B (2<=B<=7), topk:R (0<R<1)")


def wire_ratio(name: str, wire_dtype_bytes: int = 4) -> float:
    """Wire bytes per uncompressed byte of an activation ``wire_dtype_bytes`` wide: a codec's bytes
    are what ``compression_ratio`` says of fp32, and never more than the tensor as it is."""
    return min(1.0, compression_ratio(name) * 4.0 / wire_dtype_bytes)


def compression_rank(name: str) -> float:
    """Lossiness order, for picking the least lossy compression a link allows."""
    if name in COMPRESSIONS:
        return float(COMPRESSIONS.index(name))
    return len(COMPRESSIONS) + (1.0 - compression_ratio(name))
