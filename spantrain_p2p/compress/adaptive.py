"""Per-link choice of compression, after FusionLLM's AdaTopK: compress a link only as much as it needs.

``choose`` is a pure function: among the candidate codecs whose fidelity meets the floor, take the
lightest (closest to ``none``) whose transfer time, RTT/2 + wire bytes / bandwidth, hides behind the
stage's compute time; if none hides, the one that transfers fastest. Fidelity (1 − relative L2
error) comes from ``fidelities`` when the caller measured it on real tensors (``measure_fidelities``)
or else from a model of gaussian data (``nominal_fidelity``). Activations default to a floor of 0.95,
which rules out top-k on gaussian-like activations; gradients default to no floor, because error
feedback (``codecs.ErrorFeedback``) re-sends what top-k drops.

``AdaptivePolicy`` keeps a smoothed bandwidth per link from observed transfers and re-decides per
(link, kind) with hysteresis, so ±10 % noise in measured bandwidth does not flip the codec back and forth.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Hashable, Mapping, Optional, Sequence, Union

import torch

from .codecs import fidelity, parse_spec, spec, wire_bytes

log = logging.getLogger(__name__)

KINDS = ("act", "grad")
DEFAULT_FLOORS = {"act": 0.95, "grad": 0.0}
DEFAULT_CANDIDATES = ("none", "fp16", "int8", "int:6", "int:4", "topk:0.25", "topk:0.1", "topk:0.05", "topk:0.01")
EULER_GAMMA = 0.5772156649015329
FP16_FIDELITY = 0.99976  # 1 − relative L2 error of fp16 rounding (11-bit significand), measured on gaussians

Candidate = Union[str, tuple[str, Mapping[str, Any]]]


@dataclass(frozen=True)
class Option:
    """One candidate codec evaluated on one link for one tensor size."""

    spec: str
    name: str
    params: tuple[tuple[str, Any], ...]
    wire_bytes: int
    transfer_s: float  # rtt/2 + wire_bytes / bandwidth
    fidelity: float

    def as_pair(self) -> tuple[str, dict]:
        return self.name, dict(self.params)


def _canonical(c: Candidate) -> tuple[str, str, dict]:
    if isinstance(c, str):
        name, params = parse_spec(c)
    else:
        name, raw = c
        name, params = parse_spec(spec(name, raw))
    return spec(name, params), name, params


def nominal_fidelity(name: str, **params: Any) -> float:
    """Expected fidelity of a codec on i.i.d. gaussian data (deterministic; no tensors involved).

    int8 / int: quantization step absmax/L (L = 127, or 2^(bits−1) − 1), error step/√12, with the block's expected absmax ≈ the t where
    P(|x| > t) = e^−γ / block (Gumbel limit of the maximum of ``block`` half-normals)
    topk: keeping |x| > t with t the 1 − ratio/2 quantile retains 2(t·φ(t) + 1 − Φ(t)) of the energy.
    Real gradients are heavier-tailed than gaussians, so top-k does better on them than this says."""
    name, p = parse_spec(spec(name, params))
    nd = NormalDist()
    if name == "none":
        return 1.0
    if name == "fp16":
        return FP16_FIDELITY
    if name in ("int8", "int"):
        levels = 127 if name == "int8" else (1 << (p["bits"] - 1)) - 1
        absmax = nd.inv_cdf(1.0 - math.exp(-EULER_GAMMA) / 2.0 / p["block"])
        return 1.0 - absmax / levels / math.sqrt(12.0)
    t = nd.inv_cdf(1.0 - p["ratio"] / 2.0)
    kept = 2.0 * (t * nd.pdf(t) + 1.0 - nd.cdf(t))
    return 1.0 - math.sqrt(max(0.0, 1.0 - kept))


def measure_fidelities(tensor: torch.Tensor, candidates: Sequence[Candidate] = DEFAULT_CANDIDATES) -> dict[str, float]:
    """{spec: fidelity} of each candidate on a real tensor, to pass as ``fidelities``."""
    out = {}
    for c in candidates:
        s, name, params = _canonical(c)
        out[s] = fidelity(name, tensor, **params)
    return out


def _check_link(bytes_per_s: float, rtt_s: float, raw_bytes: int) -> None:
    if not (isinstance(bytes_per_s, (int, float)) and math.isfinite(bytes_per_s) and bytes_per_s > 0):
        raise ValueError(f"link bandwidth must be a positive number of bytes/s, not {bytes_per_s!r}")
    if not (isinstance(rtt_s, (int, float)) and math.isfinite(rtt_s) and rtt_s >= 0):
        raise ValueError(f"link RTT must be a non-negative number of seconds, not {rtt_s!r}")
    if not (isinstance(raw_bytes, int) and raw_bytes >= 0):
        raise ValueError(f"raw_bytes must be a non-negative int, not {raw_bytes!r}")


def evaluate(link_bytes_per_s: float, link_rtt_s: float, raw_bytes: int,
             candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
             fidelities: Optional[Mapping[str, float]] = None) -> list[Option]:
    """Every candidate's wire bytes, transfer time and fidelity for a float32 tensor of ``raw_bytes``,
    lightest first (highest fidelity, then most bytes)."""
    _check_link(link_bytes_per_s, link_rtt_s, raw_bytes)
    if not candidates:
        raise ValueError("no candidate codecs to choose from")
    numel = -(-raw_bytes // 4)
    out: dict[str, Option] = {}
    for c in candidates:
        s, name, params = _canonical(c)
        fid = fidelities[s] if fidelities is not None and s in fidelities else nominal_fidelity(name, **params)
        wb = wire_bytes(name, (numel,), **params)
        out[s] = Option(s, name, tuple(sorted(params.items())), wb, link_rtt_s / 2 + wb / link_bytes_per_s, float(fid))
    return sorted(out.values(), key=lambda o: (-o.fidelity, -o.wire_bytes, o.spec))


def _floor(kind: str, fidelity_floor: Optional[float]) -> float:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return DEFAULT_FLOORS[kind] if fidelity_floor is None else float(fidelity_floor)


def _pick(options: list[Option], floor: float, budget_s: float) -> Option:
    ok = [o for o in options if o.fidelity >= floor]
    if not ok:  # nothing meets the floor: the most faithful one there is
        return options[0]
    hides = next((o for o in ok if o.transfer_s <= budget_s), None)
    return hides or min(ok, key=lambda o: (o.transfer_s, -o.fidelity))


def choose(link_bytes_per_s: float, link_rtt_s: float, raw_bytes: int, compute_s_budget: float, kind: str,
           fidelity_floor: Optional[float] = None, candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
           fidelities: Optional[Mapping[str, float]] = None) -> tuple[str, dict]:
    """(codec name, params) for sending a float32 tensor of ``raw_bytes`` over a link: the lightest
    candidate meeting the fidelity floor (default 0.95 for ``act``, none for ``grad``) whose transfer
    time hides behind ``compute_s_budget``; else the fastest to transfer that meets the floor; if no
    candidate meets the floor, the most faithful one."""
    floor = _floor(kind, fidelity_floor)
    if not (math.isfinite(compute_s_budget) and compute_s_budget >= 0):
        raise ValueError(f"compute budget must be a non-negative number of seconds, not {compute_s_budget!r}")
    return _pick(evaluate(link_bytes_per_s, link_rtt_s, raw_bytes, candidates, fidelities), floor, compute_s_budget).as_pair()


def plannable(floor: float = DEFAULT_FLOORS["act"], candidates: Sequence[Candidate] = DEFAULT_CANDIDATES) -> tuple[str, ...]:
    """The candidates (specs, least lossy first) whose nominal fidelity meets ``floor``: the codecs a
    live policy with that floor may send, so the ones a planner prices links at."""
    options = evaluate(1.0, 0.0, 1 << 20, candidates)
    return tuple(o.spec for o in options if o.fidelity >= floor)


class AdaptivePolicy:
    """Per-link compression that follows the measured bandwidth, with hysteresis.

    ``observe(link, nbytes, seconds)`` feeds one finished transfer (transfers under
    ``min_sample_bytes`` are latency-bound and ignored); the bandwidth estimate is an exponential
    moving average with weight ``smoothing`` on the newest sample. ``decide`` keeps the current codec
    of a (link, kind) unless a lighter one would hide with ``hysteresis`` to spare (transfer ≤
    budget·(1 − h)) or the current one overruns by more than that (transfer > budget·(1 + h)).
    Pure bookkeeping: no clock, no I/O; the same calls give the same answers.
    """

    def __init__(self, candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
                 fidelity_floors: Optional[Mapping[str, float]] = None,
                 fidelities: Optional[Mapping[str, float]] = None,
                 smoothing: float = 0.3, hysteresis: float = 0.2, min_sample_bytes: int = 64 << 10):
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must lie in (0, 1]")
        if not 0 <= hysteresis < 1:
            raise ValueError("hysteresis must lie in [0, 1)")
        self.candidates = tuple(candidates)
        self.floors = {**DEFAULT_FLOORS, **(fidelity_floors or {})}
        self.fidelities = dict(fidelities or {})
        self.smoothing, self.hysteresis, self.min_sample_bytes = smoothing, hysteresis, min_sample_bytes
        self._bw: dict[Hashable, float] = {}
        self._rtt: dict[Hashable, float] = {}
        self._current: dict[tuple[Hashable, str], str] = {}

    def set_link(self, link: Hashable, bytes_per_s: Optional[float] = None, rtt_s: Optional[float] = None) -> None:
        """A prior for a link (from the prober or the scenario); replaces the smoothed bandwidth."""
        if bytes_per_s is not None:
            _check_link(bytes_per_s, 0.0, 0)
            self._bw[link] = float(bytes_per_s)
        if rtt_s is not None:
            _check_link(1.0, rtt_s, 0)
            self._rtt[link] = float(rtt_s)

    def observe(self, link: Hashable, nbytes: int, seconds: float) -> Optional[float]:
        """Feeds one transfer of ``nbytes`` that took ``seconds`` (send start to delivery); returns
        the link's bandwidth estimate in bytes/s (None while there is none)."""
        if nbytes < 0 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a transfer of {nbytes} bytes in {seconds} s is not possible")
        busy = seconds - self._rtt.get(link, 0.0) / 2
        if nbytes >= self.min_sample_bytes and busy > 0:
            sample = nbytes / busy
            old = self._bw.get(link)
            self._bw[link] = sample if old is None else (1 - self.smoothing) * old + self.smoothing * sample
        return self._bw.get(link)

    def bandwidth(self, link: Hashable) -> Optional[float]:
        return self._bw.get(link)

    def current(self, link: Hashable, kind: str) -> Optional[str]:
        """The spec last decided for (link, kind), e.g. ``"int8"``."""
        return self._current.get((link, kind))

    def decide(self, link: Hashable, raw_bytes: int, compute_s_budget: float, kind: str,
               cap: Optional[str] = None) -> tuple[str, dict]:
        """(codec name, params) for the next ``kind`` tensor of ``raw_bytes`` on ``link``; with
        ``cap`` (a codec spec: the one the plan priced this link at), nothing lossier than it."""
        floor = _floor(kind, self.floors.get(kind))
        bw = self._bw.get(link)
        if bw is None:
            raise ValueError(f"no bandwidth known for link {link!r}: call set_link or observe first")
        options = evaluate(bw, self._rtt.get(link, 0.0), raw_bytes, self.candidates, self.fidelities)
        if cap is not None:
            _, name, params = _canonical(cap)
            cap_fidelity = self.fidelities.get(spec(name, params), nominal_fidelity(name, **params))
            options = [o for o in options if o.fidelity >= cap_fidelity] or options[:1]
        best = _pick(options, floor, compute_s_budget)
        key = (link, kind)
        cur = next((o for o in options if o.spec == self._current.get(key)), None)
        if cur is not None and cur.spec != best.spec and cur.fidelity >= floor:
            h = self.hysteresis
            lighter = options.index(best) < options.index(cur)
            if (lighter and best.transfer_s > compute_s_budget * (1 - h)) or \
               (not lighter and cur.transfer_s <= compute_s_budget * (1 + h)):
                return cur.as_pair()
        if cur is None or cur.spec != best.spec:
            log.info("compression of %s on %s: %s -> %s (%.1f Mbit/s, transfer %.1f ms vs compute %.1f ms, fidelity %.3f)",
                     kind, link, cur.spec if cur else "-", best.spec, bw * 8e-6, best.transfer_s * 1e3,
                     compute_s_budget * 1e3, best.fidelity)
            self._current[key] = best.spec
        return best.as_pair()

