"""Planning: the cost model, the planner search, the baselines and the plan (stage map) type.

Pure functions over plain frozen data: no network, no torch at plan time.

    from spantrain_p2p.plan import Snapshot, ModelProfile, plan, baselines, estimate
    result = plan(Snapshot.from_scenario(scenario.load("peers/cee-3region.toml")),
                  ModelProfile.from_model_config(default_planning_model()))
    result.plan.to_dict()
"""
from .cost import Estimate, estimate
from .planner import (PlannerOptions, PlanResult, baselines, greedy_baseline, plan, uniform_baseline)
from .types import (COMPRESSIONS, LayerProfile, Link, ModelProfile, Network, PeerInfo, Plan, Snapshot, Stage,
                    compression_ratio, default_planning_model)

__all__ = [
    "COMPRESSIONS", "Estimate", "LayerProfile", "Link", "ModelProfile", "Network", "PeerInfo", "Plan",
    "PlanResult", "PlannerOptions", "Snapshot", "Stage", "baselines", "compression_ratio",
    "default_planning_model", "estimate", "greedy_baseline", "plan", "uniform_baseline",
]
