"""A run's figures in real time: a scenario with ``time_dilation = K`` runs K times slower than the
world it stands for, so its rates are multiplied by K and its durations divided by K before anyone
reads them (ratios, fidelity, utilization and MFU are the same in either time). Every figure the
peers and the launcher measure is in emulation time; these functions are the only conversion."""
from __future__ import annotations

from typing import Any

RATES = ("samples_per_s", "tokens_per_s", "samples_per_s_wall", "bound_samples_per_s",
         "aggregate_bound_samples_per_s", "predicted_samples_per_s", "configured_predicted_samples_per_s",
         "simulated_samples_per_s")
DURATIONS = ("step_s", "wall_s", "predicted_step_s", "configured_predicted_step_s", "simulated_step_s", "step_s_median", "compute_s_median", "recovery_s",
             "replan_s", "formed_s", "t_s", "probe_seconds", "probe_seconds_per_peer",
             # a peer's step breakdown (train.cpu_use) and its CPU seconds
             "compute_s", "wait_s", "gradient_sum_s", "optimizer_s", "other_s", "sends_in_flight_s",
             "compute_core_wait_s",
             "process_cpu_s", "training_threads_cpu_s", "background_cpu_s", "daemon_cpu_s")
NESTED = ("peers", "epochs", "events", "plan", "plans", "runs", "breakdown", "cpu")


def _convert(d: dict, k: float) -> dict:
    out = dict(d)
    for key in RATES:
        if isinstance(out.get(key), (int, float)) and not isinstance(out.get(key), bool):
            out[key] = round(out[key] * k, 6)
    for key in DURATIONS:
        if isinstance(out.get(key), (int, float)) and not isinstance(out.get(key), bool):
            out[key] = round(out[key] / k, 6)
    for key in NESTED:
        v = out.get(key)
        if isinstance(v, list):
            out[key] = [_convert(x, k) if isinstance(x, dict) else x for x in v]
        elif isinstance(v, dict):
            out[key] = {n: _convert(x, k) if isinstance(x, dict) else x for n, x in v.items()}
    return out


def run_summary(summary: dict[str, Any], k: float) -> dict[str, Any]:
    """The run summary (``spantrain swarm --json``) in real time; ``time_dilation`` says K."""
    if k == 1.0:
        return summary
    return {**_convert(summary, k), "time_dilation": k}


def measurements(summary: dict[str, Any], k: float) -> dict[str, Any]:
    """The ``--measure-only`` summary in real time: link RTTs / K, bandwidths x K."""
    if k == 1.0:
        return summary
    out = _convert(summary, k)
    out["links"] = [{**ln, "rtt_ms": ln["rtt_ms"] / k if ln.get("rtt_ms") is not None else None,
                     "mbps": ln["mbps"] * k if ln.get("mbps") is not None else None} for ln in summary["links"]]
    out["time_dilation"] = k
    return out
