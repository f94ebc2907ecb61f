"""What the offline tools say of the plan a live run followed, in the scenario's configured world:
the cost model's and the discrete-event simulator's step times (``spantrain plan`` prices plans the
same way), so a run's measured speed can be set beside both.

The live planner predicts from what its peers *measured*; these predictions read the scenario
(``Snapshot.from_scenario(emulated=True)``: the world the emulation really runs, in emulation
time, like every figure the launcher gathers before ``real_time`` converts them).
"""
from __future__ import annotations

import importlib
import math
import threading
from typing import Any, Optional

# what ``configured`` imports: torch among them (0.84 s of a lan-4 run's launcher, at its end)
_NEEDS = ("spantrain_p2p.plan.cost", "spantrain_p2p.plan.types", "spantrain_p2p.sim", "spantrain_p2p.job.spec",
          "spantrain_p2p.train.planning")


def prefetch() -> threading.Thread:
    """Imports what ``configured`` needs on a thread of its own, while the launcher waits on the run,
    instead of after the run's last step (a second of the end of every ``spantrain swarm``)."""
    t = threading.Thread(target=lambda: [importlib.import_module(m) for m in _NEEDS], name="prefetch", daemon=True)
    t.start()
    return t


def plan_of(summary_plan: dict, job):
    """The ``plan.types.Plan`` of a run summary's stage map (peers by scenario name; the job's
    schedule where the map names none)."""
    from ..pipeline.schedule import resolve_schedule
    from ..plan import types as pt

    stages = []
    for st in summary_plan["stages"]:
        shares = st.get("microbatch_share") or {}
        vals = [float(shares.get(p, 1.0)) for p in st["peers"]]
        total = sum(vals) or 1.0
        stages.append(pt.Stage(tuple(st["peers"]), (st["layers"][0], st["layers"][1]), tuple(v / total for v in vals),
                               st.get("recompute", "none")))
    comp = tuple(summary_plan.get("compression") or ())
    return pt.Plan(tuple(stages), summary_plan.get("schedule") or resolve_schedule(job.schedule),
                   job.micro_batch_size, job.num_micro_batches, comp)


def configured(summary_plan: Optional[dict], job_dict: Optional[dict], scenario: Any,
               profile: Optional[dict] = None) -> dict:
    """``{"configured_predicted_step_s", "simulated_step_s"}`` of the run's plan on the scenario's
    configured world (emulation time); ``{}`` when there is nothing to price (no plan, a user model).
    ``profile``: the model's profile as a peer of the run reported it (``ModelProfile.to_dict``);
    without it the model is profiled here, as the peers did (1.8 s for the built-in model at the end
    of a run, 3.9-5.8 for a transformers one)."""
    from ..plan.cost import estimate
    from ..plan.types import ModelProfile, Snapshot
    from ..sim import simulate
    from ..job.spec import JobSpec
    from ..train.planning import model_profile

    if not summary_plan or not job_dict or scenario is None:
        return {}
    try:
        job = JobSpec.from_dict(job_dict)
        prof = ModelProfile.from_dict(profile) if profile is not None else model_profile(job)
        if prof is None:
            return {}
        snap = Snapshot.from_scenario(scenario, emulated=True)
        if summary_plan.get("islands"):
            return {"configured_predicted_step_s": _islands_step_s(summary_plan, job, snap, prof),
                    "simulated_step_s": None}
        plan = plan_of(summary_plan, job)
        est = estimate(plan, snap, prof).step_s
        sim = simulate(plan, snap, prof, seed=0).step_s
    except (ValueError, KeyError, TypeError) as e:  # a plan the offline tools cannot price: say why
        return {"prediction_error": f"{type(e).__name__}: {e}"}
    return {"configured_predicted_step_s": round(est, 6) if math.isfinite(est) else None,
            "simulated_step_s": round(sim, 6) if math.isfinite(sim) else None}


def _islands_step_s(summary_plan: dict, job, snap, prof) -> Optional[float]:
    """A map with islands on the configured world: each island's plan in the cost model, the
    exchange of its codec, the round at the map's steps per round; seconds per step of data."""
    from ..plan import islands as isl
    from ..plan.cost import estimate
    from ..plan.layout import LinkTable

    from dataclasses import replace

    plans, step_s, first = [], [], 0
    split = job.island_split  # an island's step: 1/split of a data step's micro-batches
    for x in summary_plan["islands"]:
        sub = {**summary_plan, "stages": summary_plan["stages"][first:first + x["stages"]],
               "schedule": x.get("schedule") or summary_plan.get("schedule"), "compression": x.get("compression")}
        first += x["stages"]
        plans.append(replace(plan_of(sub, job), num_micro_batches=job.num_micro_batches // split))
        step_s.append(estimate(plans[-1], snap, prof).step_s * split)
    ex_s, _ = isl.exchange_cost(plans, prof, LinkTable(snap), summary_plan["exchange_codec"])
    steps = [x["steps_per_round"] for x in summary_plan["islands"]]
    period = isl.round_period(steps, step_s, ex_s)
    return round(period / sum(steps), 6) if math.isfinite(period) else None


def rates(summary: dict) -> dict:
    """Samples/s of each prediction beside the measured rate, and measured over each."""
    gb = summary.get("samples_per_step") or 0
    out: dict[str, Optional[float]] = {}
    for key, name in (("predicted_step_s", "predicted"), ("configured_predicted_step_s", "configured_predicted"),
                      ("simulated_step_s", "simulated")):
        step = summary.get(key)
        sps = gb / step if step else None
        out[f"{name}_samples_per_s"] = round(sps, 6) if sps else None
        meas = summary.get("samples_per_s")
        out[f"measured_over_{name}"] = round(meas / sps, 4) if sps and meas else None
    return out
