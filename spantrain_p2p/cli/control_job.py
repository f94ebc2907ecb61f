"""A training swarm's control plane against N, simulated (``sim.control_job``) for the design before
(commit ``63efce7``) and the code now, their rates taken from the code's own constants, the sizes
from real encoders (``cli.join_path``): ``scripts/control_plane_job.py`` prints and plots them."""
from __future__ import annotations

import math
from dataclasses import replace

from ..sim.control_job import JobDesign, JobSizes, simulate_job
from .join_path import entry_sizes, planner_at


def designs(n: int, weather: bool = True, weather_s: float = 0.0) -> dict[str, JobDesign]:
    """The two designs at ``n`` peers; ``weather``: every peer re-publishes its links as often as the
    code lets it (the worst case), or every ``weather_s`` where given (a live run's rate), else never
    (a quiet network)."""
    from ..peer.node import STEP_RECORD_PER_PEER_S
    from ..peer.config import PeerConfig
    from ..swarm import election
    from ..train import coordinator, map_tree, measuring, run_records
    from ..train.decide import REPLAN_CHECK_S

    cfg = PeerConfig()
    never = math.inf
    before = JobDesign(
        "before", map_read_s=run_records.MAP_POLL_S, map_holders=5, far_lease_s=1.0, far_holders=5,
        step_record_s=cfg.step_record_s, step_told=True, weather_s=REPLAN_CHECK_S if weather else never,
        versions=False, whole_read_s=REPLAN_CHECK_S if n <= coordinator.WHOLE_READ_PEERS else n / 20.0,
        map_members_read=True, alive_by_status=True)
    now = JobDesign(
        "now", map_read_s=max(run_records.MAP_POLL_S, min(run_records.MAP_QUIET_MAX_S, run_records.MAP_QUIET_PER_PEER_S * n)),
        map_holders=run_records.QUIET_HOLDERS, news_holders=run_records.NEWS_HOLDERS, map_keep_s=run_records.MAP_TTL_S / 3,
        lease_s=election.LEASE_S / election.RENEWALS, close=election.CLOSE,
        far_lease_s=max(1.0, min(election.FAR_MAX_S, election.FAR_PER_PEER_S * n)), far_holders=election.FAR_HOLDERS,
        step_record_s=min(cfg.record_s, max(cfg.step_record_s, STEP_RECORD_PER_PEER_S * n)), step_told=False,
        measure_keep_s=900.0, weather_s=max(REPLAN_CHECK_S, measuring.PASSIVE_PER_PEER_S * n) if weather else never,
        versions=True, pushed=True, link_deltas=True, record_news=False, voters=coordinator.GROUP_VOTERS, map_members_read=False, alive_by_status=False,
        map_push=True, map_fanout=map_tree.FANOUT, map_check_peer=True)
    if weather_s:
        before, now = replace(before, weather_s=max(weather_s, before.weather_s)), replace(now, weather_s=max(weather_s, now.weather_s))
    return {"before": before, "now": now}


def sizes_at(n: int) -> JobSizes:
    s = entry_sizes()
    _took, map_bytes = planner_at(n)
    return JobSizes(link_entry=s.links, link_change=s.links_change, profile_entry=s.profile, job_copy=s.job_copy,
                    map_bytes=map_bytes)


def figures(ns, weather: bool = True) -> dict:
    """{design: [one row per N: the steady state's figures, the planner's bytes/s, one epoch's bytes]}."""
    out: dict[str, list] = {}
    for n in ns:
        z = sizes_at(n)
        for name, d in designs(n, weather).items():
            if not weather:
                d = replace(d, name=f"{name}, no weather")
            f, epoch = simulate_job(d, n, z)
            out.setdefault(d.name, []).append({**f.to_dict(), "planner_bytes_per_s": epoch["planner"]["bytes_per_s"],
                                               "epoch_peer_bytes": epoch["peer_bytes"],
                                               "epoch_planner_bytes": epoch["planner_bytes"], "epoch_max_bytes": epoch["max_bytes"], "busiest": epoch["busiest"],
                                               "map_bytes": z.map_bytes})
    return out


def calibrate(path: str) -> dict:
    """A live ``spantrain swarm --json`` run (``control_training`` per peer) beside its simulation:
    the sim's steady state at the run's N and links re-publishing rate, plus its epochs' bursts
    spread over the window. Returns the live and simulated mean bytes and calls a peer a second."""
    import json

    from ..train import run_records

    with open(path) as f:
        d = json.loads([x for x in f.read().splitlines() if x.startswith("{")][-1])
    rows = [r["control_training"] for r in d["peers"] if r.get("control_training")]
    n, window = len(d["peers"]), sum(r["window_s"] for r in rows) / len(rows)
    live_bytes = sum(r["bytes_per_s"] for r in rows) / len(rows)
    live_calls = sum(r["calls_out_per_s"] for r in rows) / len(rows)
    publishes = sum(r["rows"].get("out rpc_store links", {}).get("calls_per_s", 0.0) for r in rows) / len(rows) / 5
    epochs = len(d["epochs"])
    out = {"n": n, "window_s": window, "epochs": epochs, "links_published_per_s": publishes,
           "live": {"bytes_per_s": live_bytes, "calls_per_s": live_calls}}
    z = sizes_at(n)
    for name, des in designs(n, weather_s=1.0 / publishes if publishes else math.inf).items():
        # the maps in the key: those of the epochs of the last MAP_TTL_S (all of them where the run
        # was shorter), half of them on average over the run
        ttl = 600.0 if name == "before" else run_records.MAP_TTL_S
        # each peer's state changes twice an epoch (a told record: news)
        des = replace(des, maps_held=max(1, round(epochs * min(1.0, ttl / window) / 2)), news_per_s=2 * n * epochs / window)
        f, e = simulate_job(des, n, z)
        # a byte moved counts at both ends (sent by one peer, received by another), as the meter counts it
        moved = e["peer_bytes"] + (e["planner_bytes"] - e["peer_bytes"]) / n
        out[name] = {"bytes_per_s": f.bytes_per_s["mean"] + 2 * epochs * moved / window,
                     "calls_per_s": f.calls_per_s["mean"] + epochs * e["peer_calls"] / window}
    return out
