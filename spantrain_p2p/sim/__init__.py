"""Discrete-event simulation of a plan: the check on the cost model, and planners compared at scale."""
from .simulator import SimResult, simulate

__all__ = ["SimResult", "simulate"]
