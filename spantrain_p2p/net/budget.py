"""What a data-plane server lets its remotes hold: connections and bytes in flight.

Pure bookkeeping (no sockets), so the limits are tested as plain functions. A remote is who the
handshake said it is (a peer id); connections still in their handshake share a pool of their own,
so strangers cannot crowd out members. Bytes are reserved when a frame is announced, released when
its handler is done with it; a reservation over any limit is refused with the reason.
Members (of the swarm, or the current stage map: the server's ``is_member``) draw on the main
pool; others on a small ``stranger_bytes`` pool, so a crowd of fresh identities in an open swarm
cannot take the memory that training needs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Limits:
    total_bytes: int = 2 << 30  # announced and not yet handled, all remotes together
    per_peer_bytes: int = 1 << 30
    stranger_bytes: int = 256 << 20  # all non-members together
    max_connections: int = 512
    per_peer_connections: int = 64
    max_handshakes: int = 64  # connections not yet authenticated (or still in their first bytes)
    handshake_timeout_s: float = 10.0
    stall_timeout_s: float = 30.0  # a frame that stops arriving for this long closes its connection

    def __post_init__(self):
        if min(self.total_bytes, self.per_peer_bytes, self.stranger_bytes, self.max_connections,
               self.per_peer_connections, self.max_handshakes) <= 0 or min(self.handshake_timeout_s,
                                                                          self.stall_timeout_s) <= 0:
            raise ValueError("every data-plane limit must be positive")


class Budget:
    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self.bytes_by_peer: Counter[str] = Counter()
        self.conns_by_peer: Counter[str] = Counter()
        self.total_bytes = 0
        self.stranger_bytes = 0
        self.connections = 0
        self.handshakes = 0

    # ---- connections ----------------------------------------------------------------------
    def begin_handshake(self) -> Optional[str]:
        if self.handshakes >= self.limits.max_handshakes:
            return f"too many connections being opened ({self.handshakes}); try again later"
        if self.connections + self.handshakes >= self.limits.max_connections:
            return f"this peer has {self.limits.max_connections} connections already"
        self.handshakes += 1
        return None

    def end_handshake(self) -> None:
        self.handshakes -= 1

    def connect(self, peer: str) -> Optional[str]:
        """Counts an authenticated connection of ``peer`` (call ``end_handshake`` first)."""
        if self.conns_by_peer[peer] >= self.limits.per_peer_connections:
            return f"{peer} has {self.limits.per_peer_connections} connections to this peer already"
        if self.connections >= self.limits.max_connections:
            return f"this peer has {self.limits.max_connections} connections already"
        self.conns_by_peer[peer] += 1
        self.connections += 1
        return None

    def disconnect(self, peer: str) -> None:
        self.conns_by_peer[peer] -= 1
        if self.conns_by_peer[peer] <= 0:
            del self.conns_by_peer[peer]
        self.connections -= 1

    # ---- bytes ----------------------------------------------------------------------------
    def reserve(self, peer: str, nbytes: int, member: bool) -> Optional[str]:
        """Takes ``nbytes`` for a frame ``peer`` announced; the reason if that is over a limit."""
        lim = self.limits
        if self.total_bytes + nbytes > lim.total_bytes:
            return f"this peer has {self.total_bytes >> 20} MiB of messages in flight; try again later"
        if self.bytes_by_peer[peer] + nbytes > lim.per_peer_bytes:
            return f"{peer} has {self.bytes_by_peer[peer] >> 20} MiB in flight to this peer already"
        if not member and self.stranger_bytes + nbytes > lim.stranger_bytes:
            return "messages from non-members are over their budget; try again later"
        self.total_bytes += nbytes
        self.bytes_by_peer[peer] += nbytes
        if not member:
            self.stranger_bytes += nbytes
        return None

    def release(self, peer: str, nbytes: int, member: bool) -> None:
        self.total_bytes -= nbytes
        self.bytes_by_peer[peer] -= nbytes
        if self.bytes_by_peer[peer] <= 0:
            del self.bytes_by_peer[peer]
        if not member:
            self.stranger_bytes -= nbytes
