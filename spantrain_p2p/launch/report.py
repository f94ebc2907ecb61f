"""The run's figures from what the peers report: the run summary (losses, samples/s, step time),
figures per stage-map epoch, the plan's prediction against the measured speed, utilization, wire
bytes, emulation fidelity, the ``--measure-only`` measurements, and a stage map in words."""
from __future__ import annotations

import statistics
from typing import Optional

from .processes import PeerProcess, wait_until


def summarize(reports: list[dict], samples_per_step: int, seq_len: int) -> dict:
    """The run summary from the peers' reports (see README: run summary)."""
    staged = [r for r in reports if r.get("stage") is not None]
    if not staged:
        return {"steps": 0, "losses": [], "samples_per_s": 0.0, "tokens_per_s": 0.0, "step_s": None, "plan": None}
    if any(r.get("island") is not None for r in staged):
        return islands_summary(reports, samples_per_step, seq_len)
    last_stage = max(r["stage"] for r in staged)
    sums = _loss_sums(r for r in staged if r["stage"] == last_stage)
    last = next(r for r in staged if r["stage"] == last_stage)
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    for r in staged:
        for step, t0, t1, *_ in r["step_times"]:
            ends[step] = max(ends.get(step, 0.0), t1)
            starts[step] = min(starts.get(step, float("inf")), t0)
    steps = sorted(ends)
    intervals = [ends[b] - ends[a] for a, b in zip(steps, steps[1:])] or [ends[s] - starts[s] for s in steps]
    wall = ends[steps[-1]] - starts[steps[0]] if steps else 0.0
    step_s = statistics.median(intervals) if intervals else None
    # steady state: a step's samples over the median time between step completions
    sps = samples_per_step / step_s if step_s else 0.0
    return {"steps": len(steps), "losses": [sums[s][0] / sums[s][1] for s in sorted(sums)],
            "samples_per_s": round(sps, 3), "tokens_per_s": round(sps * seq_len, 1),
            "step_s": round(step_s, 5) if step_s else None,
            "samples_per_s_wall": round(len(steps) * samples_per_step / wall, 3) if wall > 0 else 0.0,
            "wall_s": round(wall, 3), "plan": last["plan"],
            "peers": _peer_rows(reports), "mfu": _swarm_mfu(reports), **_loss_scale(staged),
            "paths": paths_of(reports)}


def paths_of(reports: list[dict]) -> dict[str, dict]:
    """"SRC->DST" -> {"path", "via"}: how each peer reached each other one (direct, reversed,
    hole-punched, relayed), from the peers' reports."""
    out = {}
    for r in reports:
        net = r.get("network") or {}
        for dst, used in sorted((net.get("paths") or {}).items()):
            if dst != r.get("name") and isinstance(used, dict):
                out[f"{r.get('name') or r.get('peer_id')}->{dst}"] = {"path": used.get("path"), "via": used.get("via")}
    return out


def _loss_sums(last_stage_reports) -> dict[int, tuple[float, int]]:
    """step -> (loss sum, count) from the last stage's reports: each replica of the last stage reports
    the whole step's loss; the report with the largest count is kept."""
    sums: dict[int, tuple[float, int]] = {}
    for r in last_stage_reports:
        for step, total, count, _epoch in r["loss_sums"]:
            if count > sums.get(step, (0.0, 0))[1]:
                sums[step] = (total, count)
    return sums


def _weighed(reports: list[dict]) -> dict[str, float]:
    """Peer id -> when (unix) a planner first planned with its measurements, over every planner."""
    out: dict[str, float] = {}
    for r in reports:
        for p, t in (r.get("weighed") or {}).items():
            out[p] = min(t, out.get(p, t))
    return out


def _milestones(r: dict, weighed: dict[str, float]) -> Optional[dict]:
    """The peer's own milestones, and "planned": seconds from its start to the first plan a planner
    made with its measurements (a plan may still leave it a spare: ``decide.ReplanHysteresis``)."""
    m = r.get("milestones")
    if m is None or r.get("peer_id") not in weighed or not r.get("started_unix"):
        return m
    return {**m, "planned": round(weighed[r["peer_id"]] - r["started_unix"], 2)}


def _peer_rows(reports: list[dict], islands: bool = False) -> list[dict]:
    """Every peer's row of the run summary (with its island), the planners' weighing taken once."""
    weighed = _weighed(reports)
    return [{**({"island": r.get("island")} if islands else {}), **_peer_row(r, weighed)} for r in reports]


def _peer_row(r: dict, weighed: Optional[dict[str, float]] = None) -> dict:
    """One peer of the run summary."""
    return {"name": r["name"], "stage": r["stage"], "layers": r["layers"], "steps_done": r["steps_done"],
            "step_s_median": r["step_s_median"], "compute_s_median": r["compute_s_median"],
            "breakdown": r.get("step_breakdown"), "cpu": r.get("cpu"), "control": r.get("control"), "control_training": r.get("control_training"),
            "milestones": _milestones(r, weighed or {}),
            "device": (r.get("device") or {}).get("device"), **_work(r.get("work")), "error": r["error"]}


def islands_summary(reports: list[dict], samples_per_step: int, seq_len: int) -> dict:
    """The run summary of a map with islands: losses by data step (each island's last stage reports
    its own steps' losses), samples/s over the time every island was training (from the moment the
    slowest island finished its first step to the last step's end), and the exchange's figures."""
    staged = [r for r in reports if r.get("stage") is not None and r.get("island") is not None]
    by_island: dict[int, list[dict]] = {}
    for r in staged:
        by_island.setdefault(r["island"], []).append(r)
    last = {k: max(r["stage"] for r in rs) for k, rs in by_island.items()}
    sums = _loss_sums(r for r in staged if r["stage"] == last[r["island"]])
    ends: dict[int, float] = {}
    first_end: dict[int, float] = {}
    for k, rs in by_island.items():
        mine = [(step, t1) for r in rs for step, _t0, t1, *_ in r["step_times"]]
        for step, t1 in mine:
            ends[step] = max(ends.get(step, 0.0), t1)
        if mine:
            first_end[k] = min(t1 for _s, t1 in mine)
    steps = sorted(ends)
    t_a = max(first_end.values()) if first_end else 0.0
    t_b = max(ends.values()) if ends else 0.0
    done = sum(1 for t in ends.values() if t_a < t <= t_b)
    sps = done * samples_per_step / (t_b - t_a) if t_b > t_a and done else 0.0
    starts = [t0 for r in staged for _s, t0, *_ in r["step_times"]]
    wall = t_b - min(starts) if starts else 0.0
    rounds = [row for r in staged for row in (r.get("islands") or {}).get("rounds", [])]
    n_rounds = max((row["round"] for row in rounds), default=-1) + 1
    # the exchange of round r is hidden where it was done before the end of round r + 1: the time
    # the peers waited for it there against the time its sending took. Not counted: the last
    # round's (nothing overlaps it: the run ends) and the one merged at the end of the last round,
    # which may be a short one (the job's steps left)
    waits = [row["wait_s"] for row in rounds if row["round"] < n_rounds - 2]
    exch = [row["send_s"] for r in staged for row in (r.get("islands") or {}).get("sends", [])
            if row["round"] < n_rounds - 2]
    sent = sum((r.get("islands") or {}).get("bytes_sent", 0) for r in staged)
    tokens = len(steps) * samples_per_step * seq_len
    hidden = None
    if exch and sum(exch) > 0:
        hidden = round(max(0.0, 1.0 - (sum(waits) / len(waits)) / (sum(exch) / len(exch))), 4)
    islands = [{"island": k, "peers": sorted(r["name"] for r in rs),
                "steps": len({s for r in rs for s, *_ in r["step_times"]}),
                "step_s_median": statistics.median([x for r in rs if (x := r.get("step_s_median"))] or [0.0])}
               for k, rs in sorted(by_island.items())]
    first = staged[0]
    return {"steps": len(steps), "losses": [sums[s][0] / sums[s][1] for s in sorted(sums)],
            "samples_per_s": round(sps, 3), "tokens_per_s": round(sps * seq_len, 1),
            "step_s": round(samples_per_step / sps, 5) if sps else None,
            "samples_per_s_wall": round(len(steps) * samples_per_step / wall, 3) if wall > 0 else 0.0,
            "wall_s": round(wall, 3), "plan": first.get("full_plan") or first["plan"],
            "sync": "islands",
            "islands": {"islands": islands, "rounds": n_rounds,
                        "codec": (first.get("islands") or {}).get("codec"),
                        "exchange_bytes": sent, "exchange_bytes_per_round": round(sent / n_rounds) if n_rounds else None,
                        "exchange_bytes_per_token": round(sent / tokens, 3) if tokens else None,
                        "send_s_median": round(statistics.median(exch), 4) if exch else None,
                        "wait_s_median": round(statistics.median(waits), 4) if waits else None,
                        "hidden": hidden, **_left_out(staged)},
            "peers": _peer_rows(reports, islands=True), "mfu": _swarm_mfu(reports),
            **_loss_scale(staged)}


def _left_out(staged: list[dict]) -> dict:
    """Islands left out of a round (the keeper's decisions, by epoch), the data steps whose training
    never reached the shared weights (those islands' steps of those rounds, trained and dropped or
    never trained), and how each left-out peer caught up: merged the members' contributions or
    fetched their state, then went on (just behind) or rejoined at a later round (further behind)."""
    out = sorted({(row["epoch"], row["round"], i) for r in staged
                  for row in (r.get("islands") or {}).get("left_out", []) for i in row["islands"]})
    rejoins = [{"peer": r["name"], "island": r.get("island"), **row} for r in staged
               for row in (r.get("islands") or {}).get("rejoins", [])]
    # the totals: each keeper's report lists only its last 50 rows (a long cut leaves more out)
    totals: dict[str, list[int]] = {}
    for r in staged:
        for e, t in ((r.get("islands") or {}).get("left_out_totals") or {}).items():
            if isinstance(t, list) and len(t) == 2 and all(type(x) is int for x in t):
                totals[e] = max(totals.get(e, [0, 0]), t)
    return {"left_out": [{"epoch": e, "round": rnd, "island": i} for e, rnd, i in out],
            "left_out_rounds": sum(t[0] for t in totals.values()),
            "left_out_data_steps": sum(t[1] for t in totals.values()), "rejoins": rejoins}


def _loss_scale(staged: list[dict]) -> dict:
    """fp16: the scale the run ended with, and the steps every peer skipped (they overflowed)."""
    scales = [r["loss_scale"] for r in staged if r.get("loss_scale") is not None]
    if not scales:
        return {}
    return {"loss_scale": min(scales), "skipped_steps": sorted({s for r in staged for s in r.get("skipped_steps", ())})}


def _work(w: Optional[dict]) -> dict:
    return {k: (w or {}).get(k) for k in ("tokens_per_s", "mfu", "peak_source")}


def _swarm_mfu(reports: list[dict]) -> Optional[float]:
    """The swarm's MFU: the training peers' achieved model FLOP/s over the sum of their peaks (peers
    the plan left idle count in ``aggregate_utilization`` instead)."""
    ws = [r.get("work") for r in reports if r.get("work")]
    if not ws or any(w.get("achieved_flops_per_s") is None or not w.get("peak_flops_per_s") for w in ws):
        return None
    return round(sum(w["achieved_flops_per_s"] for w in ws) / sum(w["peak_flops_per_s"] for w in ws), 5)


def epoch_figures(reports: list[dict], plans: dict[int, dict], samples_per_step: int) -> list[dict]:
    """Per stage-map epoch: its steps, measured samples/s (a step's samples over the median time
    between consecutive step completions inside the epoch) and the plan's predicted samples/s."""
    ends: dict[int, dict[int, float]] = {}
    for r in reports:
        for row in r.get("step_times", []):
            if len(row) >= 4:
                step, _, t1, epoch = row[:4]
                per = ends.setdefault(epoch, {})
                per[step] = max(per.get(step, 0.0), t1)
    out = []
    for epoch in sorted(set(ends) | set(plans)):
        per = ends.get(epoch, {})
        steps = sorted(per)
        gaps = [per[b] - per[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
        sps = samples_per_step / statistics.median(gaps) if gaps else None
        pred = (plans.get(epoch) or {}).get("predicted_step_s") or None
        row = {"epoch": epoch, "steps": len(steps), "first_step": steps[0] if steps else None,
               "samples_per_s": round(sps, 3) if sps else None,
               "predicted_samples_per_s": round(samples_per_step / pred, 3) if pred else None}
        row["ratio"] = round(row["samples_per_s"] / row["predicted_samples_per_s"], 3) \
            if row["samples_per_s"] and row["predicted_samples_per_s"] else None
        out.append(row)
    return out


def describe_plan(plan: dict) -> str:
    """A stage map as a few lines for people: its epoch, the stages and their peers, the prediction."""
    head = f"plan epoch {plan['epoch']} (planner term {plan.get('term', 0)})"
    if plan.get("schedule"):
        head += f", schedule {plan['schedule']}"
    if plan.get("predicted_step_s"):
        head += f", predicted {plan['predicted_step_s']:.3f}s per step"
        if plan.get("bottleneck"):
            head += f" (bottleneck {plan['bottleneck']})"
    if plan.get("reason"):
        head += f"; {plan['reason']}"
    lines = [head + ":"]
    for i, st in enumerate(plan.get("stages", [])):
        a, b = st["layers"]
        shares = st.get("microbatch_share") or {}
        peers = ", ".join(f"{p} {shares[p]:.0%}" if p in shares and len(st["peers"]) > 1 else p for p in st["peers"])
        lines.append(f"  stage {i}: layers {a}-{b - 1} on {peers}")
    return "\n".join(lines)


def aggregate_bound(reports: list[dict]) -> Optional[float]:
    """The aggregate-compute bound: samples/s if every peer's device, used by the plan or not, ran
    the model's FLOPs at its full speed (the physical limit). None unless every peer says both."""
    peaks = [r.get("device_peak_flops_per_s") for r in reports]
    per_sample = next((r["model_flops_per_sample"] for r in reports if r.get("model_flops_per_sample")), None)
    if not reports or per_sample is None or any(not p for p in peaks):
        return None
    return round(sum(peaks) / per_sample, 3)


def figures(summary: dict, reports: list[dict], scenario=None) -> dict:
    """DESIGN.md section 5 figures from the peers' reports: prediction and bound, utilization,
    wire bytes per step (by link class when the scenario is known), emulation fidelity."""
    plan = summary.get("plan") or {}
    gb = summary.get("samples_per_step") or 0
    pred = plan.get("predicted_step_s") or None
    out = {"predicted_step_s": pred, "bottleneck": plan.get("bottleneck") or None,
           "bound_samples_per_s": round(gb / pred, 3) if pred else None}
    devs = [r.get("train_device") for r in reports if r.get("train_device")]
    wall = summary.get("wall_s") or 0
    if devs and wall:
        out["compute_utilization"] = round(sum(d["flops"] for d in devs) / wall / sum(d["flops_per_s"] for d in devs), 4)
        padded = sum(d["padded_ops"] for d in devs)
        out["fidelity"] = round(1 - sum(d["overruns"] for d in devs) / padded, 4) if padded else None
    else:
        out["compute_utilization"], out["fidelity"] = None, None
    out["aggregate_bound_samples_per_s"] = agg = aggregate_bound(reports)
    sps = summary.get("samples_per_s")
    out["aggregate_utilization"] = round(sps / agg, 4) if agg and sps else None
    per_step: dict[int, int] = {}
    by_class: dict[str, list[int]] = {}
    for r in reports:
        for step, per in r.get("wire_bytes", []):
            per_step[step] = per_step.get(step, 0) + sum(per.values())
            if scenario is not None:
                for dst, nbytes in per.items():
                    try:
                        cls = scenario.link_between(r["name"], dst)[0].name
                    except Exception:
                        cls = "unknown"
                    by_class.setdefault(cls, []).append(nbytes)
    steps = max(1, len(per_step))
    if scenario is not None:  # everything that crossed from one region to another: activations, gradient
        # sums, the islands' exchange (the figure --sync islands is to cut)
        tokens = (summary.get("steps") or 0) * gb * (summary.get("seq_len") or 0)
        crossed = _cross_region_bytes(reports, scenario)
        out["cross_region_bytes"] = crossed
        out["cross_region_bytes_per_token"] = round(crossed / tokens, 3) if tokens else None
    out["wire_bytes_per_step"] = int(statistics.median(per_step.values())) if per_step else 0
    out["wire_bytes_per_step_by_link_class"] = {k: int(sum(v) / steps) for k, v in sorted(by_class.items())}
    # the codec each peer last used per kind and destination ("act->vol-03": "int:6")
    out["codecs"] = {f"{r['name']}:{k}": c for r in reports for k, c in sorted((r.get("codecs") or {}).items())}
    return out


def _cross_region_bytes(reports: list[dict], scenario) -> int:
    region = {p.name: p.region for p in scenario.peers}
    total = 0
    for r in reports:
        sent = [per for _step, per in r.get("wire_bytes", [])] + [(r.get("islands") or {}).get("bytes_to", {})]
        for per in sent:
            total += sum(n for dst, n in per.items() if region.get(dst) != region.get(r["name"]))
    return total


def measurement_summary(scenario, measurements: list[dict]) -> dict:
    """The --measure-only contract: measured links and devices beside the scenario's configuration."""
    links, devices, ops, ok_ops = [], [], 0, 0
    for m in measurements:
        src = m["peer"]
        for dst, lm in sorted(m["links"].items()):
            conf, _ = scenario.link_between(src, dst)
            links.append({"src": src, "dst": dst, "rtt_ms": lm["rtt_ms"], "mbps": lm["mbps"], "status": lm["status"],
                          "configured_rtt_ms": conf.rtt_ms, "configured_mbps": conf.mbps})
        dev = scenario.device_of(src)
        devices.append({"peer": src, "tflops": m["tflops"], "configured_tflops": dev.tflops,
                        "memory_gb": m["memory_gb"], "configured_memory_gb": dev.memory_gb})
        stats = m.get("device_stats") or {}
        ops += stats.get("padded_ops", 0)
        ok_ops += stats.get("padded_ops", 0) - stats.get("overruns", 0)
    windows = [m["probe_window"] for m in measurements if m.get("probe_window")]
    return {"links": links, "devices": devices,
            # from the first probe of any peer to the last: the swarm's whole probing phase
            "probe_seconds": round(max(w[1] for w in windows) - min(w[0] for w in windows), 3) if windows else 0.0,
            "probe_seconds_per_peer": max((m["probe_seconds"] for m in measurements), default=0.0),
            "fidelity": round(ok_ops / ops, 4) if ops else None}


def measure_and_report(procs: list["PeerProcess"], scenario, say, timeout: float = 300) -> dict:
    say("measuring: device profiles and link probes…")
    wait_until(lambda: all(p.status()["state"] == "done" or not p.alive() for p in procs), timeout, interval=0.5,
               what="every peer to finish measuring")
    dead = [p.name for p in procs if not p.alive()]
    if dead:
        raise RuntimeError(f"peer(s) {', '.join(dead)} exited while measuring")
    return measurement_summary(scenario, [p.status(timeout=30, path="/measurements") for p in procs])
