"""What the outside sees of a trainer: ``GET /status``'s ``train`` part (progress, plan, recent
losses, events) and ``GET /report`` (the whole run: losses, step times, wire bytes, codecs,
device figures), which ``spantrain swarm`` gathers into its summary."""
from __future__ import annotations

import logging
import statistics
import time
from typing import Optional

from ..models.devices import describe
from ..swarm.control_meter import run_rates, window_rates
from . import cpu_use, memory_use


def status(t, brief: bool = False) -> dict:
    """The trainer's part of ``/status``; ``brief`` (``/status/brief``, what ``spantrain swarm`` follows a
    run by): without the whole run's histories and the figures the dashboard draws (step breakdown,
    CPU, memory, links), which took most of a call's time on the peer's event loop."""
    smap, job = t.smap, t.job
    last = t.losses.get(max(t.losses)) if t.losses else None
    out = {"job": job.job_id if job else None, "stage": t.stage,
           "num_stages": smap.num_stages if smap else None,
           "epoch": smap.epoch if smap else None, "step": t.step,
           "steps_done": t.steps_done, "steps_total": job.steps if job else None,
           "loss": last, "error": t.error or t.refused,
           **t.coordinator.status(),
           "recent_losses": [[st, a, n, e] for st, (a, n, e) in
                             t.loss_sums.last(30) + sorted(t.recovery.held_losses.items())[-30:]],
           "plan": (t.full_map or smap).summary() if smap else None, "events": t.events[-20:],
           "recent_steps": [[st, round(e, 3), round(e - s, 4), ep] for st, s, e, ep in t.step_times[-60:]],
           "tokens_per_s": tokens_per_s(t),
           **({"island": t.island, "round": t.outer.round} if t.island is not None else {}),
           "defence": {**t.defence.status(), "verify": t.verifier.status()}}
    if brief:
        return out
    return {**out,
            # the whole run, thinned (a page opened mid-run draws it from step 0)
            "loss_history": [[st, a, n, e] for st, (a, n, e) in t.loss_sums.thinned()],
            "throughput_history": t.throughput.rows(t.work["tokens_per_step"]) if t.work else [],
            "stage_seconds": dict(zip(("predicted", "measured"), stage_seconds(t))),
            "step_breakdown": cpu_use.step_breakdown([t.timelines[k] for k in sorted(t.timelines)[-10:]]),
            "cpu": t.cpu.figures(),
            "memory": {"measured_peak": t.memory_state["state"] + t.stash_peak_bytes + t.recompute_transient
                       if t.memory_state else None, "predicted_peak": (t.memory_predicted or {}).get("peak"),
                       **({"proxy": True} if job and job.workload else {})},
            "links_mbps": {t.peer.name_of(d): round(v, 2) for d in t.measuring.passive.destinations()
                           if (v := t.measuring.passive.estimate_mbps(d)) is not None}}


def report(t) -> dict:
    """The trainer's whole run, for ``/report``."""
    from .planning import known_model_profile

    smap, job, tr = t.smap, t.job, t.transport
    durations = [e - s for _, s, e, _ in t.step_times]
    return {"peer_id": t.peer.peer_id, "name": t.peer.config.name, "stage": t.stage, "defence": {**t.defence.status(), "verify": t.verifier.status()},
            "layers": list(smap.stages[t.stage].layers) if smap and t.stage is not None else None,
            "plan": smap.summary() if smap else None, "job": job.to_dict() if job else None,
            # the planner's view of the model: the launcher prices the run's plan with it (``launch.predict``)
            "model_profile": (p.to_dict() if job and (p := known_model_profile(job)) is not None else None),
            "steps_done": t.steps_done, "losses": [[s, loss] for s, loss in sorted(t.losses.items())],
            "loss_sums": [[s, a, n, e] for s, (a, n, e) in t.loss_sums.items()],  # (StepRows: in step order)
            "step_times": [list(x) for x in t.step_times],
            "step_s_median": statistics.median(durations) if durations else None,
            "wire_bytes": [[s, {smap.name_of(d): b for d, b in per.items()}]
                           for s, per in sorted(tr.wire_bytes.items())] if smap else [],
            "codecs": dict(tr.codecs_used),
            "device_stats": t.peer.device.stats().to_dict() if t.peer.device else None,
            "train_device": train_device_stats(t.peer.device, t.device_base),
            "compute_s_median": statistics.median(t.compute_s) if t.compute_s else None,
            "step_breakdown": cpu_use.step_breakdown([t.timelines[k] for k in sorted(t.timelines)]),
            "cpu": t.cpu.figures(),
            "control": run_rates(t.peer.control.snapshot()) if getattr(t.peer, "control", None) else None,
            # from this peer's first stage map on: a training swarm's control plane, per method and key
            "control_training": window_rates(t.records.control_at_map, t.peer.control.snapshot())
            if t.records.control_at_map is not None else None,
            "memory": {**memory_use.report(t.memory_state, t.stash_peak_bytes, t.memory_predicted, t.recompute,
                                           t.recompute_transient, t.torch_device, proxy=bool(job and job.workload)),
                       "shard": bool(smap and t.stage is not None and smap.stages[t.stage].shard)},
            "deadlines": tr.deadline_report() if job else {},
            "deadline_extensions": tr.deadline_extensions,
            "lanes": dict(tr.lanes.messages) if tr.lanes is not None else None,  # tensors sent on lanes, through the loop
            "data_fetched": list(t.data_share.fetched),
            "device": describe(t.torch_device),
            "model_flops_per_sample": model_flops_per_sample(job) if job else None,
            "device_peak_flops_per_s": t.peak[0] if t.peak else t.peer.device.flops_per_s if t.peer.device else None,
            "work": work_figures(t.work, t.peak, statistics.median(durations) if durations else None),
            "loss_scale": t.loss_scale, "skipped_steps": list(t.skipped),
            "timelines": [t.timelines[k] for k in sorted(t.timelines)],
            "error": t.error, "refused": t.refused, "milestones": dict(t.peer.milestones),
            "started_unix": t.peer.started_unix, "weighed": dict(t.coordinator.weighed),
            "network": t.peer.paths.status() if getattr(t.peer, "paths", None) is not None else None,
            **({"island": t.island, "islands": t.outer.report(),
                "full_plan": t.full_map.summary()} if t.island is not None else {})}


def log_step(log, step: int, data_step: int, loss: Optional[float], times: tuple, compute_s: float) -> None:
    """A step's line in the peer's log: its loss (the last stage) and where its time went (``times``:
    when it started, its pipeline ended, its gradient sum ended, its optimizer ended)."""
    if loss is None and not log.isEnabledFor(logging.DEBUG):
        return
    t0, t_pipe, t_sum, t1 = times
    t2 = time.time()
    parts = (f"{t2 - t0:.3f}s: pipeline {t_pipe - t0:.3f} (compute {compute_s:.3f}), gradient "
             f"sum {t_sum - t_pipe:.3f}, optimizer {t1 - t_sum:.3f}, snapshot {t2 - t1:.3f}")
    if loss is not None:
        log.info("step %d: loss %.4f (%s)", data_step, loss, parts)
    else:
        log.debug("step %d (%s)", step, parts)


def tokens_per_s(t) -> Optional[float]:
    """Tokens through this peer's layers per second, over its last 20 steps (median)."""
    durations = [e - s for _, s, e, _ in t.step_times[-20:]]
    if not t.work or not durations:
        return None
    return round(t.work["tokens_per_step"] / statistics.median(durations), 3)


def stage_seconds(t) -> tuple[Optional[float], Optional[float]]:
    """(predicted, measured) compute seconds per step of this peer: its layers' model FLOPs over the
    speed its profile measured (what the planner assumed of it), and the median it took."""
    measured = statistics.median(t.compute_s[-20:]) if t.compute_s else None
    prof = t.measuring.profile
    flops = (t.work or {}).get("model_flops_per_step")
    predicted = flops / (prof.effective_tflops * 1e12) if flops and prof and prof.effective_tflops else None
    return predicted, measured


def model_flops_per_sample(job) -> Optional[float]:
    """F + B + W FLOPs of one sample through the whole model (the planner's count; None: a user model)."""
    from .planning import model_profile

    prof = model_profile(job)
    return None if prof is None else sum(x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in prof.layers)


def stage_work(job, first: int, last: int, actions) -> dict:
    """What this peer computes per step: tokens through its layers and their model FLOPs (forward
    and both backward halves, from the planner's profile of the model; None for a user model)."""
    from ..pipeline.schedule import Op
    from .planning import model_profile

    samples = sum(a.op is Op.F for a in actions) * job.micro_batch_size
    prof = model_profile(job)
    flops = None if prof is None else samples * sum(x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops
                                                    for x in prof.layers[first:last])
    seq = job.workload_seq_len if job.workload else job.seq_len  # a workload's tokens, not its proxy's
    return {"tokens_per_step": samples * seq, "model_flops_per_step": flops}


def work_figures(work: Optional[dict], peak: Optional[tuple[float, str]], step_s: Optional[float]) -> Optional[dict]:
    """tokens/s, achieved model FLOP/s and MFU (achieved over the device's peak) of a peer."""
    if not work or not step_s:
        return None
    out = {"tokens_per_s": round(work["tokens_per_step"] / step_s, 1), "model_flops_per_step": work["model_flops_per_step"],
           "achieved_flops_per_s": None, "peak_flops_per_s": peak[0] if peak else None,
           "peak_source": peak[1] if peak else None, "mfu": None}
    if work["model_flops_per_step"] is not None:
        out["achieved_flops_per_s"] = work["model_flops_per_step"] / step_s
        if peak and peak[0] > 0:
            out["mfu"] = round(out["achieved_flops_per_s"] / peak[0], 5)
    return out


def train_device_stats(dev, base) -> Optional[dict]:
    """FLOPs, padded ops and overruns of the virtual device since training began (``base``: its
    counters then), and its speed."""
    if dev is None:
        return None
    now = dev.stats()
    d = {"flops": now.flops, "padded_ops": now.padded_ops, "overruns": now.overruns}
    if base is not None:
        d = {k: v - getattr(base, k) for k, v in d.items()}
    d["flops_per_s"] = dev.flops_per_s
    return d
