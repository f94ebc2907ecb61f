"""The errors a user of SpanTrain-P2P can catch, one type per kind of failure, each with the message
the command line prints for it (``spantrain-peer: error: <message>``). All are ``SpanTrainError``s.

Low in the package (every room may raise them): the peer's start (``PeerError``), a job's refusal
(``JobRefused``) and the Python API's outcomes of a run share them.
"""
from __future__ import annotations


class SpanTrainError(RuntimeError):
    """Any failure SpanTrain-P2P reports to its user; the message says what happened and why."""


class PeerError(SpanTrainError):
    """A peer could not start or join (a port in use, an identity file another peer holds, a closed
    swarm's key, an admission refused)."""


class SwarmUnreachable(PeerError):
    """No address given to join answered: ``could not join via ...``."""


class JobRefused(SpanTrainError):
    """This peer cannot take part in the swarm's job (another protocol, a model it may not import,
    another fingerprint); the message says why."""


class TrainingStopped(SpanTrainError):
    """The run stopped before its last step (the planner stopped it, or this peer's steps failed for
    good); the message is the reason."""


class NoFeasiblePlan(TrainingStopped):
    """The planner found no plan the peers can run (``no feasible plan: ...``: the model does not fit
    their memory, too few peers for a fixed plan)."""


class PeerCrashed(SpanTrainError):
    """A peer's trainer died of an unexpected error (a bug, a broken model): ``trainer failed: ...``."""
