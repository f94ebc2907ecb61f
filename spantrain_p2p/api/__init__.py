"""The Python API: define a job, found or join a swarm, follow its steps, get the trained model.

    job.py      Job (a job from keyword arguments named as spantrain-peer's flags), train_options
                (what the command line and the API both build a peer's trainer options with)
    session.py  Session (one peer in this process), start, join, StepResult
    local.py    AsyncLocalSwarm and LocalSwarm (a founder and joiners in this process; LocalSwarm
                without asyncio in the user's code)

The package exports these names (``spantrain_p2p.__all__``) with the errors of ``errors.py``.
"""
from .job import Job
from .local import AsyncLocalSwarm, LocalSwarm
from .session import Session, StepResult, join, start

__all__ = ["AsyncLocalSwarm", "Job", "LocalSwarm", "Session", "StepResult", "join", "start"]
