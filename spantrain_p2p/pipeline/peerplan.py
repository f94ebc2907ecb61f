"""Old home of ``peer_actions``: import it from ``pipeline.assignment`` (kept until the trainer does)."""
from .assignment import check_deadlock_free, peer_actions  # noqa: F401
