"""Discrete-event simulation of a plan, peer by peer, with the runtime's own micro-batch owners and
action lists (``pipeline.assignment``): the check on the cost model, and planners compared at scale."""
from .simulator import SimResult, simulate

__all__ = ["SimResult", "simulate"]
