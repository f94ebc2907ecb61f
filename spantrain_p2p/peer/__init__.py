"""The ``Peer``: one member of a swarm, and the Python API of SpanTrain-P2P.

    async with Peer(PeerConfig(join=("/ip4/…/p2p/Qm…",))) as peer:
        print(peer.address, [m.peer_id for m in await peer.members()])

    config.py     PeerConfig (what a peer is told at start) and PeerError (a reason meant for the user)
    node.py       the Peer: start and close, heartbeat, the membership view, /status, owned tasks
    emulation.py  behaving as a scenario peer: its virtual device, its shaped links, the launcher's
                  link-factor (chaos) handler
"""
from .config import PeerConfig, PeerError
from .node import Peer

__all__ = ["Peer", "PeerConfig", "PeerError"]
