"""SpanTrain-P2P: train one model across heterogeneous peers joined by slow, unstable links.

The Python API (``spantrain_p2p.api``), exported here and loaded on first use (``import
spantrain_p2p`` stays light for the command line)::

    import spantrain_p2p as spantrain

    job = spantrain.Job("hf:gpt2-tiny", data="corpus.txt", steps=30, seq_len=64)
    with spantrain.LocalSwarm(job, peers=2) as swarm:
        for r in swarm.steps():
            print(r.step, r.loss)
        swarm.export("trained")
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 4  # bumped when wire records or messages change incompatibly (2: member records in buckets; 3: measurements and job copies too; 4: a profile may carry the host's optimizer step, a field protocol 3 refuses)

_API = {"AsyncLocalSwarm", "Job", "LocalSwarm", "Session", "StepResult", "join", "start"}
_ERRORS = {"SpanTrainError", "PeerError", "SwarmUnreachable", "JobRefused", "TrainingStopped", "NoFeasiblePlan",
           "PeerCrashed"}
__all__ = sorted(_API | _ERRORS | {"PeerConfig"})


def __getattr__(name: str):
    """The public names, imported when first asked for (the API loads torch and hivemind)."""
    import importlib

    if name in _API:
        return getattr(importlib.import_module(".api", __name__), name)
    if name in _ERRORS:
        return getattr(importlib.import_module(".errors", __name__), name)
    if name == "PeerConfig":
        return importlib.import_module(".peer.config", __name__).PeerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
