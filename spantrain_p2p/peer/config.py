"""What a peer is told at start (``PeerConfig``), and the error a peer that cannot start raises."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import PeerError, SwarmUnreachable  # noqa: F401 (a peer's own errors, raised here)
from ..net.framing import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class PeerConfig:
    join: tuple[str, ...] = ()  # multiaddrs of peers to join; ("auto",) for mDNS; () starts a swarm
    swarm: str = "default"  # the swarm's name: one DHT can hold several swarms
    listen: str = "/ip4/127.0.0.1/tcp/0"  # where p2pd listens
    host: str = "127.0.0.1"  # data plane address
    data_port: int = 0
    announce: tuple[str, ...] = ()  # HOST[:PORT] others reach the data plane at (a forwarded port, a public address)
    identity_path: Optional[str] = None  # stable peer id; created if missing
    name: str = ""  # human name, e.g. the scenario's peer name
    device: dict = field(default_factory=dict)
    heartbeat_s: float = 2.0
    ttl_heartbeats: int = 3  # a record lives this many heartbeats (this many record_s with SWIM)
    # how members learn who is alive: "records" (a record re-stored every heartbeat, gone a few
    # heartbeats after the last) or "swim" (direct probes on the data plane, ``peer.swim_loop``;
    # records re-stored when they change or every record_s): issue 33, measured on idle swarms
    liveness: str = "swim"
    record_s: float = 300.0
    # with SWIM, a record whose only change is the training step is stored at most this often: a
    # training peer's step changes every step, which re-stored (and sent the watchers) every record of
    # the swarm every heartbeat; what acts on a step reads it on the data plane or waits this long
    step_record_s: float = 30.0
    swim_probe_s: float = 1.0  # SWIM: a ping every this often (ack within half, suspect dead after two)
    poll_s: float = 1.0  # how often the member view is refreshed
    # a peer that is not the planner or its standby reads all records only about this many a poll
    # (``membership.read_interval``): the whole member key every N / view_records_per_poll polls
    view_records_per_poll: float = 8.0
    join_timeout_s: float = 30.0
    discover_s: float = 5.0  # how long --join auto looks for a swarm on mDNS
    mdns: bool = False  # advertise on mDNS (always on with --join auto)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    emulate: str = ""  # "SCENARIO:PEER": shape outgoing links and pad compute like that scenario peer
    emulate_t0: Optional[float] = None  # CLOCK_MONOTONIC origin of the scenario's bandwidth traces
    operator: str = ""  # the peer id whose chaos messages an emulated peer takes (its launcher's); "": none
    swarm_key_path: str = ""  # a closed swarm's key file ("": an open swarm)
    allow: tuple[str, ...] = ()  # peer ids this peer takes part with (empty: anyone of the swarm)
    group_key_timeout_s: float = 20.0  # how long a joiner of a closed swarm with --allow waits for its key
    # encrypt data-plane connections (either end asking is enough): AES-256-GCM records, which bind
    # every message to its connection (an on-path attacker can neither read nor inject); on by default
    encrypt: bool = True
    # encrypt connections between peers of this machine too (``handshake``: not asked for otherwise)
    encrypt_on_host: bool = False
    relay_circuits: int = 16  # circuits this peer relays at once for peers that reach each other no other way
    stall_timeout_s: float = 30.0  # a message that stops arriving this long closes its connection
