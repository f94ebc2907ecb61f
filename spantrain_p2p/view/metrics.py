"""``GET /metrics``: a peer's figures for Prometheus (``prometheus_client``'s text format).

Nothing is counted twice and nothing is kept for the scrape's sake: a collector reads the
trainer's own records (losses, step times, the stage map, probes, the passive estimator, wire
bytes) when Prometheus asks, so the metrics cost the training loop nothing between scrapes.

Metrics (every figure in the units a real run has, i.e. emulation time on a dilated scenario):

- ``spantrain_peers``: live members this peer sees;
- ``spantrain_step``: the step this peer runs (or runs next); ``spantrain_loss``: the newest
  step's mean loss (peers of the last stage, which compute it);
- ``spantrain_tokens_per_second``: tokens through this peer's layers per second (median step);
- ``spantrain_stage_seconds{kind="predicted|measured"}``: this peer's compute per step: its stage's
  model FLOPs over the speed its profile measured (what the planner assumed), and the median measured;
- ``spantrain_link_rtt_ms{dst}``, ``spantrain_link_mbps{dst,source="probe|passive"}``;
- ``spantrain_wire_bytes_total{kind,dst,codec}``: bytes sent, by message kind, destination and codec;
- ``spantrain_replans_total``: stage maps adopted after the first; ``spantrain_recoveries_total``:
  layers this peer fetched to recover a stage;
- ``spantrain_fidelity``: the emulated device's padded ops that kept their time (1: every one).
"""
from __future__ import annotations

from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..train import report as run_report

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TrainerCollector:
    """Reads ``trainer`` (a ``train.trainer.Trainer``) at scrape time."""

    def __init__(self, trainer) -> None:
        self.t = trainer

    def describe(self) -> list:
        return []  # registered with auto_describe off: collect() runs only on a scrape

    def collect(self) -> Iterable[Metric]:
        t, peer = self.t, self.t.peer
        name = peer.config.name or (peer.peer_id or "")[:12]

        def gauge(metric: str, doc: str, value: Optional[float], **labels: str) -> Optional[Metric]:
            if value is None:
                return None
            g = GaugeMetricFamily(metric, doc, labels=["peer", *labels])
            g.add_metric([name, *labels.values()], float(value))
            return g

        out = [
            gauge("spantrain_peers", "live members this peer sees", len(peer.live_members())),
            gauge("spantrain_step", "the step this peer runs or runs next", t.step),
            gauge("spantrain_loss", "mean loss of the newest step (last-stage peers)",
                  t.losses[max(t.losses)] if t.losses else None),
            gauge("spantrain_tokens_per_second", "tokens through this peer's layers per second",
                  run_report.tokens_per_s(t)),
            gauge("spantrain_fidelity", "emulated device: fraction of padded ops that kept their time",
                  peer.device.fidelity() if peer.device is not None else None),
        ]
        stage = GaugeMetricFamily("spantrain_stage_seconds", "this peer's compute per step",
                                  labels=["peer", "kind"])
        pred, meas = run_report.stage_seconds(t)
        for kind, v in (("predicted", pred), ("measured", meas)):
            if v is not None:
                stage.add_metric([name, kind], v)
        rtt = GaugeMetricFamily("spantrain_link_rtt_ms", "probed round trip to a peer", labels=["peer", "dst"])
        mbps = GaugeMetricFamily("spantrain_link_mbps", "link bandwidth to a peer", labels=["peer", "dst", "source"])
        for dst, m in sorted(t.measuring.probes.items()):
            if m.rtt_ms is not None:
                rtt.add_metric([name, peer.name_of(dst)], m.rtt_ms)
            if m.mbps is not None:
                mbps.add_metric([name, peer.name_of(dst), "probe"], m.mbps)
        for dst in t.measuring.passive.destinations():
            v = t.measuring.passive.estimate_mbps(dst)
            if v is not None:
                mbps.add_metric([name, peer.name_of(dst), "passive"], v)
        wire = CounterMetricFamily("spantrain_wire_bytes", "bytes sent, by message kind, destination and codec",
                                   labels=["peer", "kind", "dst", "codec"])
        for (kind, dst, codec), n in sorted(t.transport.wire_totals.items()):
            wire.add_metric([name, kind, peer.name_of(dst), codec], n)
        replans = CounterMetricFamily("spantrain_replans", "stage maps adopted after the first", labels=["peer"])
        replans.add_metric([name], max(0, len(t.epochs_adopted) - 1))
        recoveries = CounterMetricFamily("spantrain_recoveries", "layers fetched to recover a stage", labels=["peer"])
        recoveries.add_metric([name], sum(1 for e in t.events if e.get("kind") == "fetched"))
        out += [stage, rtt, mbps, wire, replans, recoveries]
        return [m for m in out if m is not None]


def metrics_text(trainer) -> bytes:
    """The exposition of ``trainer``'s metrics (a registry per call: nothing global, one per peer)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TrainerCollector(trainer))
    return generate_latest(registry)
