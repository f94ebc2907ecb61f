"""Is a peer alive? Heartbeats in the DHT (``swarm.membership``) drop a silent peer after a few
beats; training cannot wait that long, so a receive that runs past its deadline, or a planner that
misses a peer's record, asks the peer itself: one that answers its ``/status`` quickly at the
address it served from last is alive (a record that expired on a busy machine is no death), one
that left with a tombstone or does not answer is dead. With SWIM, the peer is asked by a ping."""
from __future__ import annotations

STATUS_TIMEOUT_S = 2.0


def reachable_at(peer, peer_id: str):
    """Where to send ``peer_id`` a message it is expected to take (a peer of the map, an island's
    keeper): its live record's address, else where it served last (None after its tombstone). SWIM
    holds the other side of a cut dead and drops its record from the view; sends there stopped for
    good and did not resume once the link was back (the islands' cut-off test)."""
    return peer.data_url_of(peer_id) or peer.last_data_url(peer_id)


async def answers_at(client, url: str, timeout_s: float = STATUS_TIMEOUT_S) -> bool:
    """Whether the data plane at ``url`` answers ``/status`` within ``timeout_s``."""
    try:
        await client.status(url, timeout=timeout_s)
        return True
    except Exception:
        return False


async def is_alive(peer, peer_id: str, timeout_s: float = STATUS_TIMEOUT_S) -> bool:
    """Whether ``peer_id`` still answers where it served last, within ``timeout_s`` (this peer
    itself always does)."""
    if peer_id == peer.peer_id:
        return True
    url = peer.last_data_url(peer_id)  # None once it left with a tombstone
    if url is None:
        return False
    swim = getattr(peer, "swim", None)
    if swim is not None and swim.url_of(peer_id) is not None:
        # a SWIM ping (about 100 bytes each way): ``/status`` carries the peer's whole member view,
        # and a re-plan asks every ready peer (200 MB for a planner at 1,000 peers, issue 33)
        return await swim.ping(peer_id, timeout_s)
    return await answers_at(peer.client, url, timeout_s)
