"""What a data-plane server lets its remotes hold: connections and bytes in flight.

Pure bookkeeping (no sockets), so the limits are tested as plain functions. A remote is who the
handshake said it is (a peer id); connections still in their handshake share a pool of their own,
so strangers cannot crowd out members. Bytes are reserved when a frame is announced, released when
its handler is done with it; a reservation over any limit is refused with the reason.
Members (of the current stage map once there is one, else of the swarm: the server's
``is_member``) draw on the main pool; others on a small ``stranger_bytes`` pool, so a crowd of
fresh identities in an open swarm cannot take the memory that training needs.

Every count is also kept per source address (the host part), before and after the handshake, so
one host holding many sockets (silent, or authenticated as many identities) takes only its share;
handshakes from one address are rate-limited (a token bucket) before any RSA work is done.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional


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
    # a frame must also arrive whole within stall_timeout_s + its size at this rate: one byte every
    # few seconds no longer holds its reservation for ever
    min_rate_bytes_s: float = 32 << 10
    idle_timeout_s: float = 120.0  # an authenticated connection with no request this long is closed
    per_address_handshakes: int = 16  # of max_handshakes, from one source address
    per_address_connections: int = 128  # of max_connections, from one source address
    handshakes_per_s: float = 20.0  # per source address (a burst of per_address_handshakes)
    # addresses the per-address limits leave alone: every peer of a swarm on one machine connects
    # from 127.0.0.1 (a process on the same host can do worse than hold sockets anyway); tests and
    # benchmarks attack from other loopback addresses (127.0.0.66, ...)
    unlimited_addresses: tuple[str, ...] = ("127.0.0.1", "::1")

    def __post_init__(self):
        if min(self.total_bytes, self.per_peer_bytes, self.stranger_bytes, self.max_connections,
               self.per_peer_connections, self.max_handshakes, self.per_address_handshakes,
               self.per_address_connections) <= 0 or min(self.handshake_timeout_s, self.stall_timeout_s,
                                                         self.min_rate_bytes_s, self.idle_timeout_s,
                                                         self.handshakes_per_s) <= 0:
            raise ValueError("every data-plane limit must be positive")

    def frame_deadline_s(self, nbytes: int) -> float:
        """How long a frame of ``nbytes`` may take to arrive, from its announcement."""
        return self.stall_timeout_s + nbytes / self.min_rate_bytes_s


class Budget:
    def __init__(self, limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self.bytes_by_peer: Counter[str] = Counter()
        self.conns_by_peer: Counter[str] = Counter()
        self.handshakes_by_addr: Counter[str] = Counter()
        self.conns_by_addr: Counter[str] = Counter()
        self._tokens: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)
        self.total_bytes = 0
        self.stranger_bytes = 0
        self.connections = 0
        self.handshakes = 0

    # ---- connections ----------------------------------------------------------------------
    def begin_handshake(self, addr: str = "") -> Optional[str]:
        lim = self.limits
        if self.handshakes >= lim.max_handshakes:
            return f"too many connections being opened ({self.handshakes}); try again later"
        capped = self._capped(addr)
        if capped and self.handshakes_by_addr[addr] >= lim.per_address_handshakes:
            return f"too many connections being opened from {addr or 'one address'}; try again later"
        if self.connections + self.handshakes >= lim.max_connections:
            return f"this peer has {lim.max_connections} connections already"
        if capped and self.conns_by_addr[addr] + self.handshakes_by_addr[addr] >= lim.per_address_connections:
            return f"{addr or 'one address'} has {lim.per_address_connections} connections to this peer already"
        self.handshakes += 1
        self.handshakes_by_addr[addr] += 1
        return None

    def end_handshake(self, addr: str = "") -> None:
        self.handshakes -= 1
        self._drop(self.handshakes_by_addr, addr)

    def handshake_allowed(self, addr: str = "") -> Optional[str]:
        """Takes a token for one handshake's RSA work from ``addr``'s bucket; the reason if empty."""
        lim, now = self.limits, self.clock()
        if not self._capped(addr):
            return None
        tokens, at = self._tokens.get(addr, (float(lim.per_address_handshakes), now))
        tokens = min(float(lim.per_address_handshakes), tokens + (now - at) * lim.handshakes_per_s)
        if tokens < 1.0:
            self._tokens[addr] = (tokens, now)
            return f"too many handshakes from {addr or 'one address'}; try again later"
        self._tokens[addr] = (tokens - 1.0, now)
        if len(self._tokens) > 4096:  # addresses long quiet have full buckets: forget them
            for a, (t, when) in list(self._tokens.items()):
                if t + (now - when) * lim.handshakes_per_s >= lim.per_address_handshakes:
                    del self._tokens[a]
        return None

    def connect(self, peer: str, addr: str = "", member: bool = True) -> Optional[str]:
        """Counts an authenticated connection of ``peer`` (call ``end_handshake`` first). Others
        than members (``Budget.reserve``'s sense) leave a quarter of the slots free for members."""
        lim = self.limits
        if self.conns_by_peer[peer] >= lim.per_peer_connections:
            return f"{peer} has {lim.per_peer_connections} connections to this peer already"
        if self.connections >= (lim.max_connections if member else lim.max_connections * 3 // 4):
            return f"this peer has {self.connections} connections already"
        if self._capped(addr) and self.conns_by_addr[addr] >= lim.per_address_connections:
            return f"{addr or 'one address'} has {lim.per_address_connections} connections to this peer already"
        self.conns_by_peer[peer] += 1
        self.conns_by_addr[addr] += 1
        self.connections += 1
        return None

    def disconnect(self, peer: str, addr: str = "") -> None:
        self._drop(self.conns_by_peer, peer)
        self._drop(self.conns_by_addr, addr)
        self.connections -= 1

    def _capped(self, addr: str) -> bool:
        """Whether the per-address limits apply to ``addr``."""
        return addr not in self.limits.unlimited_addresses

    @staticmethod
    def _drop(counter: Counter, key: str) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]

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


class LogBudget:
    """At most one log line a key (a source address, a message kind) every ``every_s``: the first of
    a burst as it comes, the next after the pause with the count of those left out between. A remote
    that opens connections or sends bad frames as fast as it can would otherwise have this peer
    write a line for each (936 refused connections in one test's logs, from a few attackers in a
    minute). ``max_keys`` bounds the memory: past it, the key written longest ago is forgotten."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic, max_keys: int = 1024):
        self.every_s, self.clock, self.max_keys = every_s, clock, max_keys
        self._keys: dict[str, list] = {}  # key -> [when last written, lines left out since]

    def take(self, key: str) -> Optional[tuple[int, float]]:
        """None: leave this line out; else write it, with (lines left out before it, over seconds)."""
        now = self.clock()
        seen = self._keys.get(key)
        if seen is not None and now - seen[0] < self.every_s:
            seen[1] += 1
            return None
        left = (seen[1], now - seen[0]) if seen is not None else (0, 0.0)
        self._keys.pop(key, None)  # written last: to the end of the dict, the last to be forgotten
        self._keys[key] = [now, 0]
        if len(self._keys) > self.max_keys:
            del self._keys[next(iter(self._keys))]
        return left

    def line(self, key: str, msg: str, *args) -> Optional[tuple[str, tuple]]:
        """``(msg, args)`` to write if ``key``'s budget allows, saying how many were left out; None:
        leave it out."""
        left = self.take(key)
        if left is None:
            return None
        if left[0]:
            return msg + " (and %d more like it, left out of the log over %.0fs)", (*args, *left)
        return msg, args

    def warning(self, logger, key: str, msg: str, *args) -> None:
        """``logger.warning(msg, *args)`` if ``key``'s budget allows, saying how many were left out."""
        said = self.line(key, msg, *args)
        if said is not None:
            logger.warning(said[0], *said[1])
