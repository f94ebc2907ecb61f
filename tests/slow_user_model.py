"""A user model that takes seconds to build, as a large model does (tests/test_peer_start.py)."""
import time

from spantrain_p2p.models.example_user_model import tiny_mlp


def slow_mlp(build_s: float = 2.0, **kwargs):
    time.sleep(float(build_s))  # blocks whatever thread builds it, as building GPT-2 XL's layers would
    return tiny_mlp(**kwargs)
