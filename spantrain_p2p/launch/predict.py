"""What the offline tools say of the plan a live run followed, in the scenario's configured world:
the cost model's and the discrete-event simulator's step times (``spantrain plan`` prices plans the
same way), so a run's measured speed can be set beside both.

The live planner predicts from what its peers *measured*; these predictions read the scenario
(``Snapshot.from_scenario(emulated=True)``: the world the emulation really runs, in emulation
time, like every figure the launcher gathers before ``real_time`` converts them).
"""
from __future__ import annotations

import math
from typing import Any, Optional


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
        stages.append(pt.Stage(tuple(st["peers"]), (st["layers"][0], st["layers"][1]), tuple(v / total for v in vals)))
    comp = tuple(summary_plan.get("compression") or ())
    return pt.Plan(tuple(stages), summary_plan.get("schedule") or resolve_schedule(job.schedule),
                   job.micro_batch_size, job.num_micro_batches, comp)


def configured(summary_plan: Optional[dict], job_dict: Optional[dict], scenario: Any) -> dict:
    """``{"configured_predicted_step_s", "simulated_step_s"}`` of the run's plan on the scenario's
    configured world (emulation time); ``{}`` when there is nothing to price (no plan, a user model)."""
    from ..plan.cost import estimate
    from ..plan.types import Snapshot
    from ..sim import simulate
    from ..train.job import JobSpec
    from ..train.planning import model_profile

    if not summary_plan or not job_dict or scenario is None:
        return {}
    try:
        job = JobSpec.from_dict(job_dict)
        prof = model_profile(job)
        if prof is None:
            return {}
        plan = plan_of(summary_plan, job)
        snap = Snapshot.from_scenario(scenario, emulated=True)
        est = estimate(plan, snap, prof).step_s
        sim = simulate(plan, snap, prof, seed=0).step_s
    except (ValueError, KeyError, TypeError) as e:  # a plan the offline tools cannot price: say why
        return {"prediction_error": f"{type(e).__name__}: {e}"}
    return {"configured_predicted_step_s": round(est, 6) if math.isfinite(est) else None,
            "simulated_step_s": round(sim, 6) if math.isfinite(sim) else None}


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
