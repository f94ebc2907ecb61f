"""Planning: which peers run which layers, in which order, with which schedule and compression.

Pure functions over plain frozen data: no network, no torch.

- ``types``: peers, links, the model's per-layer profile, ``Stage`` and ``Plan``; ``model``: the
  reference transformer's config, parameter and FLOP counts;
- ``layout`` and ``cost``: what a plan means peer by peer, and its step time in closed form;
- ``planner`` (the entry, ``plan()``) over ``search`` (the search context), ``candidates``,
  ``dp``, ``local_search``, ``exhaustive``; ``baselines`` and the ``PLAN_KINDS`` a job may ask for;
- ``stagemap``: the map the peers follow (wire format, ``placeholder_map``);
- ``synthetic``: generated swarms for planning at scale.

    from spantrain_p2p.plan import Snapshot, ModelProfile, plan, baselines, estimate
    result = plan(Snapshot.from_scenario(scenario.load("peers/cee-3region.toml")),
                  ModelProfile.from_model_config(default_planning_model()))
    result.plan.to_dict()
"""
from .baselines import PLAN_KINDS, greedy_baseline, uniform_baseline
from .cost import Estimate, estimate
from .model import ModelConfig
from .planner import baselines, plan
from .search import PlannerOptions, PlanResult
from .types import (COMPRESSIONS, LayerProfile, Link, ModelProfile, Network, PeerInfo, Plan, Snapshot, Stage,
                    compression_ratio, default_planning_model)

__all__ = [
    "COMPRESSIONS", "Estimate", "LayerProfile", "Link", "ModelConfig", "ModelProfile", "Network", "PLAN_KINDS",
    "PeerInfo", "Plan", "PlanResult", "PlannerOptions", "Snapshot", "Stage", "baselines", "compression_ratio",
    "default_planning_model", "estimate", "greedy_baseline", "plan", "uniform_baseline",
]
