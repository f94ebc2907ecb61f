"""The ``Peer``'s life cycle and its view of the swarm's members.

A peer runs hivemind's ``P2P`` and a ``DHTNode`` inside its own asyncio loop (no forked DHT
process), an aiohttp data plane, and a heartbeat that keeps its signed record alive in the DHT.
Closing it writes a tombstone, cancels every task it started and stops its daemon.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import replace
from typing import Any, Optional

from .. import PROTOCOL_VERSION, __version__
from ..net.client import DataPlaneClient
from ..net.budget import Limits
from ..net.addresses import announced_urls, order_maddrs, p2p_announce, port_mapping_wanted
from ..net.dataplane import DataPlaneServer, Retry
from ..net.handshake import Authenticator
from ..net.probe_messages import PROBE_KIND, handle_probe
from ..swarm import discovery, find_values, measure, membership
from ..swarm.daemon import daemon_socket_pattern, sweep_stale_sockets, tie_daemons_to_this_process
from ..swarm.bootstrap import BootstrapFailed, bootstrap
from ..swarm.control_meter import ControlMeter
from ..swarm.guard import REPLICAS, GuardedDHT
from ..swarm.sealing import SwarmKey
from ..swarm.identity import Identity
from ..swarm.validator import SwarmValidator
from ..swarm.records import PeerRecord, seal
from .config import PeerConfig, PeerError, SwarmUnreachable
from ..view import dashboard
from .emulation import CHAOS_KIND, chaos_handler, emulated_link, machine_of, start_emulation
from .loop_lag import LoopLag
from . import admission, leave, member_view, reach, swim_loop

log = logging.getLogger("spantrain.peer")


def local_device_summary() -> dict:
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0.0
    return {"kind": "cpu", "cpus": os.cpu_count() or 1, "memory_gb": round(mem, 1)}


class Peer:
    def __init__(self, config: PeerConfig = PeerConfig()):
        self.config = config
        self.identity: Optional[Identity] = None
        self.instance = secrets.token_hex(8)
        self.state = "joining"
        self.reach = ""  # how others reach this peer's data plane (records.REACH; reach.check finds out)
        self.paths = None  # net.paths.Paths, once started
        self.progress: dict = {}
        self.started_at = time.monotonic()
        self.started_unix = time.time()  # the same moment on the wall clock, which other peers' reports share
        # seconds from start to the first time this peer entered each state, and ("map") first had a
        # stage map: a joiner's way to its first plan, in the run summary
        self.milestones: dict[str, float] = {}
        self.maddrs: list[str] = []
        self.dataplane: Optional[DataPlaneServer] = None
        self.client = DataPlaneClient(config.max_message_bytes)
        self.emulator = None  # net.emulator.LinkEmulator when emulating a scenario peer
        self.device = None  # profile.virtual.VirtualDevice when emulating
        self._p2p = None
        self._dht = None
        self.plan_peers: Optional[frozenset[str]] = None  # the current stage map's peers (``in_main_budget``)
        self.evicted: set[str] = set()  # peers convicted of attacking the job: refused as members
        self._advertiser: Optional[discovery.Advertiser] = None
        self._tmpdir: Optional[str] = None
        self._tasks: list[asyncio.Task] = []
        self._seq = 0
        self._sealed: Optional[tuple[PeerRecord, dict]] = None  # (record, signed value) last announced
        self._view: dict[str, PeerRecord] = {}
        self._last_url: dict[str, str] = {}  # peer id -> data-plane address of its latest live record
        self._on_bad = membership.BadRecordLog()
        self._view_changed = asyncio.Event()
        # name -> callable(brief=...) returning JSON, merged into /status (and /status/brief)
        self.status_extras: dict[str, Any] = {}
        self._before_serving: list = []  # callables(peer) run once the data plane exists, before it serves
        self.swarm_key: Optional[SwarmKey] = None
        self.member_checks: list = []  # callables(peer_id) -> bool: more ways to know a member (the stage map)
        self.watch_checks: list = []  # callables() -> bool: this peer reads the members every poll (the planner)
        self.followed: frozenset[str] = frozenset()  # members whose new records it reads on SWIM news (``swim_loop``)
        self.gone_done: set[str] = set()  # the map's peers that left done with the job (``member_view.note_views``)
        # callable(before, after) -> [peer id]: whom SWIM tells of a death (None, None), or of this peer's
        # new record ``after`` (its last told: ``before``), where a job says (``Coordinator.watchers``)
        self.watcher_ids = None
        self.map_head: Optional[tuple] = None  # (term, epoch, job) of the stage map followed: on SWIM messages
        self.on_map_head = None  # callable(term, epoch, job): a member follows that map (``RunRecords.heard_head``)
        self.measured_signed: dict[str, dict] = {}  # kind -> this peer's latest signed entry (``note_measured``)
        self.on_measured = None  # callable(peer id, kind, payload): a member's new entry, sent with its record
        self._waiting = 0  # callers of wait_members: they read every poll
        self._read_at = 0.0  # monotonic time of the last read of the whole member key
        self.allow: Optional[frozenset[str]] = None  # the allow-list, this peer included (None: no list)
        self.loop_lag = LoopLag()  # how long the event loop was held (nothing may hold it for long)
        self.control = ControlMeter(config.swarm)  # this peer's DHT calls and their bytes (/status "control")
        self.swim: Optional[swim_loop.SwimLoop] = None  # liveness by direct probes (--liveness swim)

    # ---- public surface -------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        assert self.identity is not None, "peer not started"
        return self.identity.peer_id

    @property
    def address(self) -> str:
        """The multiaddr others join (ends in /p2p/<peer id>)."""
        return self.maddrs[0] if self.maddrs else ""

    @property
    def dht(self):
        return self._dht

    async def members(self, latest: bool = True) -> list[PeerRecord]:
        """Live members (this peer included), sorted by peer id, read fresh from the DHT."""
        view = await membership.read_members(self._dht, self.config.swarm, self._on_bad, latest=latest)
        self._update_view(view)
        return self.live_members()

    def live_members(self) -> list[PeerRecord]:
        """The members as of the last poll, without a DHT round trip."""
        return sorted((r for r in self._view.values() if r.alive), key=lambda r: r.peer_id)

    def member_ids(self) -> frozenset[str]:
        """Every live member's id, this peer's too: the records' and, with SWIM, its member list's (a
        peer that does not watch holds the records it needed only)."""
        ids = {p for p, r in self._view.items() if r.alive} | {self.peer_id}
        return frozenset(ids | set(self.swim.swim.live()) if self.swim is not None else ids)

    async def wait_members(self, count: int, timeout: float) -> list[PeerRecord]:
        """Waits until the view has exactly ``count`` live members; TimeoutError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._waiting += 1  # read every poll meanwhile
        try:
            while len(self.live_members()) != count:
                self._view_changed.clear()
                left = deadline - loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError(f"saw {len(self.live_members())} members, not {count}, in {timeout}s")
                try:
                    await asyncio.wait_for(self._view_changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._waiting -= 1
        return self.live_members()

    def watching(self) -> bool:
        """Whether this peer reads the whole member key every poll (``member_view.watching``)."""
        return member_view.watching(self)

    async def read_for_map(self, peer_ids) -> None:
        """A new stage map names ``peer_ids``: the members read as it needs (``member_view.for_map``)."""
        await member_view.for_map(self, peer_ids)

    def mark(self, milestone: str) -> None:
        """Notes the first time this peer reached ``milestone`` (seconds from its start: ``milestones``)."""
        self.milestones.setdefault(milestone, round(time.monotonic() - self.started_at, 2))

    async def set_state(self, state: str, **progress) -> None:
        """Changes this peer's state (and progress fields others read), announced at once."""
        if state != self.state or (progress and progress != self.progress):
            if state != self.state:
                log.info("state %s -> %s", self.state, state)
            for mark in (*(("map",) if "epoch" in progress else ()), state):  # (map first: 6.52 > 6.51 once)
                self.mark(mark)
            self.state = state
            # the training step stays, the most memory this peer found it can hold (``train.decide.memory_caps``)
            # and the version of its measurements (``note_measured``)
            kept = {k: v for k, v in self.progress.items() if k in ("step", "memory_cap") or k.startswith("mv.")}
            self.progress = {**kept, **progress}
            await self._announce()

    async def note_measured(self, what: str, mv: int, signed: dict) -> None:
        """This peer published its ``what`` of measurement version ``mv`` (``swarm.measure``; its DHT
        value ``signed``): its record says so at once, and goes with the entry to the planner and the
        grouping's voters (``SwimLoop.stored``)."""
        field = measure.version_field(what)
        self.measured_signed[what] = signed
        if self.progress.get(field) != mv:
            self.progress = {**self.progress, field: mv}
            await self._announce()

    def before_serving(self, hook) -> None:
        """Registers ``hook(peer)``, run at start once the data plane exists (to add handlers and routes)."""
        self._before_serving.append(hook)

    def name_of(self, peer_id: str) -> str:
        rec = self._view.get(peer_id)
        return rec.name if rec is not None and rec.name else peer_id

    def link_to(self, peer_id: str):
        """The emulated link to a peer (None when not emulating, or for a peer outside the scenario)."""
        return emulated_link(self.emulator, self.name_of(peer_id)) if self.emulator is not None else None

    def data_url_of(self, peer_id: str) -> Optional[str]:
        """Where a live member serves: its record's, or where SWIM holds it alive without one here
        (found dead across a cut, back since: its record left the view), where it served last."""
        rec = self._view.get(peer_id)
        if rec is None and self.swim is not None and self.swim.swim.is_live(peer_id):
            return self._last_url.get(peer_id)
        return rec.data_url if rec is not None and rec.alive else None

    def last_data_url(self, peer_id: str) -> Optional[str]:
        """Where a peer served last, even after its record expired (None after its tombstone)."""
        rec = self._view.get(peer_id)
        return None if rec is not None and not rec.alive else self._last_url.get(peer_id)

    def spawn(self, coro, name: str) -> asyncio.Task:
        """Starts a task the peer owns: cancelled on close, and its crash is logged."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        return task

    def status(self, brief: bool = False) -> dict[str, Any]:
        """``/status``; ``brief`` (``/status/brief``): without the control plane's and the DHT's
        figures and with the extras' brief parts (``train.report.status``): a run's follower asks every
        peer each second, and the whole page held a training peer's event loop 1.7-2.0 ms a call."""
        members = self.live_members()
        return {
            "peer_id": self.identity.peer_id if self.identity else None,
            "name": self.config.name,
            "state": self.state,
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "swarm": self.config.swarm,
            "address": self.address,
            "data_url": self.dataplane.url if self.dataplane else None,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "members": [{"peer_id": r.peer_id, "name": r.name, "state": r.state, "progress": dict(r.progress)}
                        for r in members],
            "member_count": len(self.member_ids()),  # with SWIM, its list's: a peer holds the records it needs
            "members_read_s_ago": round(time.monotonic() - self._read_at, 1) if self._read_at else None,
            "device": (self.config.device or {}).get("kind") or (str(self.device) if self.device else None),
            "region": self.emulator.me.region if self.emulator is not None else None,
            "loop_lag": self.loop_lag.status(),
            **({} if brief else {"dht_refused": self._dht_refused(), "control": self.control.snapshot()}),
            **{k: fn(brief=brief) for k, fn in self.status_extras.items()},
        }

    def _dht_refused(self) -> dict[str, int]:
        """What this peer's DHT node refused to keep or to believe, by reason (``validator``)."""
        node = getattr(self._dht, "node", self._dht)
        validator = getattr(getattr(node, "protocol", None), "record_validator", None)
        return dict(getattr(validator, "refused", {}))

    # ---- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> "Peer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Joins (or founds) the swarm. A start that fails closes what it had opened (its data plane's
        port, its tasks, its daemon, its key file) before the error goes on: a caller that catches it
        keeps nothing of it."""
        try:
            await self._start()
        except BaseException:
            await self.close(graceful=False)
            raise

    async def _start(self) -> None:
        from hivemind.dht.node import DHTNode
        from hivemind.p2p import P2P, P2PDaemonError

        from ..swarm import daemon_wire

        daemon_wire.install()
        cfg = self.config
        self.spawn(self.loop_lag.run(), "loop-lag")
        identity_path, check_identity = admission.prepare_identity(self)
        if cfg.swarm_key_path:
            try:
                self.swarm_key = SwarmKey.load(cfg.swarm_key_path)
            except (OSError, ValueError) as e:
                raise PeerError(f"--swarm-key {cfg.swarm_key_path}: {getattr(e, 'strerror', None) or e}") from None
        if cfg.allow:
            self.allow = frozenset(cfg.allow) | {self.peer_id}
        self.client.auth = Authenticator(self.identity, self.swarm_key, cfg.encrypt, admit=self._admit,
                                         host=None if cfg.encrypt_on_host else machine_of(self))
        join = list(cfg.join)
        auto = join == ["auto"]
        if auto:
            join = await discovery.browse(cfg.swarm, cfg.discover_s)
            log.info("mDNS: %s", f"found {len(join)} address(es) of swarm {cfg.swarm!r}" if join else
                     f"no swarm {cfg.swarm!r} on the LAN; starting a new one")
        else:
            join = discovery.parse_join(join)

        if cfg.emulate:
            self.emulator, self.device = start_emulation(cfg.emulate, cfg.emulate_t0)
        self.dataplane = DataPlaneServer(cfg.host, cfg.data_port, self.status, cfg.max_message_bytes,
                                         auth=self.client.auth, limits=Limits(stall_timeout_s=cfg.stall_timeout_s))
        self.dataplane.add_json_get("/status/brief", lambda: self.status(brief=True))
        self.dataplane.is_member = self.in_main_budget
        self.dataplane.policy = self._message_policy
        self.dataplane.register(PROBE_KIND, handle_probe)
        if cfg.liveness == "swim":
            self.swim = swim_loop.install(self)
        dashboard.install(self, self.dataplane)
        if self.emulator is not None:
            self.dataplane.register(CHAOS_KIND, chaos_handler(lambda: self.emulator, cfg.operator))
        for hook in self._before_serving:
            hook(self)
        try:
            await self.dataplane.start()
        except OSError as e:
            raise PeerError(str(e)) from None
        self.dataplane.announced = announced_urls(cfg.host, self.dataplane.port, cfg.announce, join)
        self.paths = reach.install(self)

        tie_daemons_to_this_process()
        swept = await asyncio.to_thread(sweep_stale_sockets, daemon_socket_pattern())
        if swept:
            log.info("removed %d p2p daemon socket files nothing listens on any more", swept)
        try:
            self._p2p = await P2P.create(
                initial_peers=join or None,
                host_maddrs=[cfg.listen],
                announce_maddrs=p2p_announce(cfg.listen, cfg.announce) or None,
                identity_path=identity_path,
                nat_port_map=port_mapping_wanted(cfg.listen),
                check_if_identity_free=False,  # hivemind's check misses live peers; see admission.refuse_duplicate
                startup_timeout=cfg.join_timeout_s,
            )
        except P2PDaemonError as e:
            msg = str(e)
            if "failed to connect to bootstrap peers" in msg:
                raise SwarmUnreachable(f"could not join via {', '.join(join)}: no address answered") from None
            if "address already in use" in msg.lower():
                raise PeerError(f"cannot listen on {cfg.listen}: address already in use") from None
            raise PeerError(f"p2p daemon failed: {msg}") from None
        admission.forget_key_file(self)
        self.control.attach(self._p2p)  # before the DHT node adds its handlers
        self.maddrs = order_maddrs([str(m) for m in await self._p2p.get_visible_maddrs()], self.dataplane.announced)

        validator = SwarmValidator(cfg.swarm, self.identity, closed=self.swarm_key is not None)
        # No background re-reads of cached keys (every key is polled on purpose, and a record lives a
        # few seconds: hivemind re-read each one after every use), no copies pushed to the node nearest
        # a key after each read (the whole dictionary again): issue 33's measurements. The local cache
        # itself stays: without it the suite's busiest runs saw partial reads (a node's cached copy is
        # still served to other readers, which is why a find of a swarm key returns the dictionary from
        # any node that read it: the next step of issue 33).
        node = await DHTNode.create(p2p=self._p2p, wait_timeout=3, record_validator=validator,
                                    num_replicas=REPLICAS, cache_refresh_before_expiry=0, cache_nearest=0)
        self._dht = node  # closed with the peer, even if joining fails below
        await find_values.serve(self._p2p, node.protocol)  # reads at a key's holders, without the neighbours
        try:
            if join:  # retried with backoff: a founder busy starting its job may miss one ping
                await asyncio.wait_for(bootstrap(node, join, cfg.join_timeout_s), cfg.join_timeout_s + 10)
        except (asyncio.TimeoutError, BootstrapFailed) as e:
            raise SwarmUnreachable(f"could not join via {', '.join(join)}: "
                            f"{e or f'no peer answered within {cfg.join_timeout_s:.0f}s'}") from None
        except Exception as e:
            if join and check_identity and "can't access this node" in str(e):
                # The bootstrap peer calls us back by peer id; with our identity already live in the
                # swarm, libp2p may route that call to the other process, so the check fails.
                raise PeerError(
                    f"could not join via {', '.join(join)}: the swarm cannot call this peer back; identity "
                    f"{cfg.identity_path} (peer id {self.peer_id}) may be already used by a live peer "
                    f"(or a firewall blocks incoming connections)") from None
            if join:
                raise SwarmUnreachable(f"could not join via {', '.join(join)}: {e}") from None
            raise

        self._dht = GuardedDHT(node, self.swarm_key, self.allow, values_only=True)
        if self.swim is not None:  # nobody reads every member key on a timer: a store looks up its own
            self._dht.together, self._dht.holders_ttl = False, swim_loop.HOLDERS_TTL_S  # key's nodes, seldom
        if self._dht.grouped:
            await admission.take_group_key(self, joining=bool(join))
        view = await admission.check_admission(self) if join else {}
        if check_identity:
            await admission.refuse_duplicate(self)
        self._update_view(view)  # the members a joiner asks to dial it back (a founder alone has none)
        await reach.at_start(self, joining=bool(join))  # before others read an address of ours that may not work
        await self._announce()
        if self.swim is None:
            self._update_view(await membership.read_members(self._dht, cfg.swarm, self._on_bad))
        else:  # SWIM's member list from a member, not every record (a watcher reads them: member_view)
            await self.swim.fetch_list()
        self.spawn(self._heartbeat_loop(), "heartbeat")
        if self.swim is not None:
            self.spawn(self.swim.run(), "swim")
            self.spawn(self.swim.read_unknown(), "swim-reads")
        self.spawn(reach.keep(self, self.paths), "paths")
        self.spawn(member_view.keep(self), "watch-members")
        if auto or cfg.mdns:
            self._advertiser = discovery.Advertiser(self.peer_id, cfg.swarm, self.maddrs)
            try:
                await self._advertiser.start()
            except Exception as e:  # LAN discovery is a convenience: the peer works without it
                log.warning("mDNS advertising failed: %s", e)
                self._advertiser = None
        await self.set_state("idle")
        log.info("joined swarm %r as %s (%d member(s)); address %s", cfg.swarm, self.peer_id,
                 len(self.live_members()), self.address)

    async def close(self, graceful: bool = True) -> None:
        """Leaves the swarm: tasks cancelled (training stops first: it must not answer its own
        departure), goodbye and tombstone (if graceful), servers and daemon stopped (``leave``)."""
        await leave.leave(self, graceful)

    # ---- internals ------------------------------------------------------------------------
    def is_member(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is this peer or one whose live record it has seen (and no tombstone since)."""
        if peer_id in self.evicted:
            return False
        rec = self._view.get(peer_id)
        if peer_id == self.peer_id or (rec.alive if rec is not None else peer_id in self._last_url):
            return True
        if self.swim is not None and self.swim.swim.is_live(peer_id):  # known by SWIM's news alone
            return True
        return any(check(peer_id) for check in self.member_checks)

    def ever_member(self, peer_id: str) -> bool:
        """Whether this peer has seen a record of ``peer_id`` in this run (a planner that died
        since still signed the maps the swarm runs on; a process that never joined did not)."""
        return peer_id == self.peer_id or peer_id in self._view or peer_id in self._last_url

    def in_main_budget(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s frames draw on the data plane's main byte pool: the peers of the
        current stage map once there is one (``plan_peers``, set by the trainer), else members.
        In an open swarm anyone can be a member; only the map's peers carry training's bytes."""
        if self.plan_peers is not None:
            return peer_id in self.plan_peers or peer_id == self.peer_id
        return self.is_member(peer_id)

    def _admit(self, peer_id: str) -> Optional[str]:
        """Why a data-plane connection from ``peer_id`` is refused (None: it is not). The swarm key,
        in a closed swarm, is checked by the handshake itself."""
        if self.allow is not None and peer_id not in self.allow:
            return f"peer {peer_id} is not on this swarm's allow-list"
        return None

    def _message_policy(self, kind: str, sender: str) -> Optional[str]:
        """Probes (a joining peer measures before it is known) and chaos (the operator's launcher)
        come from anyone the handshake admitted; every other kind from members only."""
        if kind in (PROBE_KIND, CHAOS_KIND, reach.DIALBACK_KIND) or self.is_member(sender):
            return None
        if kind == swim_loop.KIND and sender not in self.evicted:  # a joiner's first pings
            return None
        raise Retry(f"{sender} is not a member of swarm {self.config.swarm!r} (or not yet seen by this peer)")

    def _record(self) -> tuple[PeerRecord, dict]:
        """This peer's record and its signed value: the last ones while nothing in it changed, so
        that a heartbeat re-stores the same signed bytes (with a later expiry, under the store's own
        signature) and readers, who keep the signatures they checked, do not check them again."""
        from hivemind.utils import get_dht_time

        content = PeerRecord(
            peer_id=self.peer_id, seq=0, ts=0.0, state=self.state, version=__version__,
            data_url=self.dataplane.url if self.dataplane else "", maddrs=tuple(self.maddrs[:4]),
            instance=self.instance, name=self.config.name, device=dict(self.config.device or local_device_summary()),
            progress=dict(self.progress), reach=self.reach,
        )
        if self._sealed is None or replace(self._sealed[0], seq=0, ts=0.0) != content:
            self._seq += 1
            rec = replace(content, seq=self._seq, ts=get_dht_time())
            self._sealed = (rec, seal(rec, self.identity))
        return self._sealed

    async def _announce(self, tell: bool = True) -> None:
        """Stores this peer's record; with SWIM, ``tell``s the watchers (and the pings) of it too."""
        if self._dht is None:
            return
        ttl = (self.config.record_s if self.swim else self.config.heartbeat_s) * self.config.ttl_heartbeats
        rec, sealed = self._record()
        ok = await membership.announce(self._dht, self.config.swarm, sealed, self.peer_id, ttl)
        if not ok:
            log.debug("heartbeat %d was not stored by any DHT node", rec.seq)
        self._view[self.peer_id] = rec
        if self.swim is not None:
            self.swim.stored(rec.seq, sealed, tell=tell)

    def step_record_s(self) -> float:
        """How often a record whose only change is its training step is stored, with SWIM:
        ``step_record_s``, or ``STEP_RECORD_PER_PEER_S`` a member where more, at most ``record_s``
        (at 1,000 peers every 30 s put 6.7 KB/s on each node of a member key)."""
        return min(self.config.record_s, max(self.config.step_record_s, STEP_RECORD_PER_PEER_S * len(self.member_ids())))

    async def _heartbeat_loop(self) -> None:
        """Re-stores our record every heartbeat; with SWIM (which tells liveness), only when it
        changed (its training step alone: at most every ``step_record_s``) or every ``record_s``."""
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.config.heartbeat_s
        stored_at = loop.time()
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            try:
                last = self._view.get(self.peer_id)
                rec = self._record()[0]
                since = loop.time() - stored_at
                step_only = last is not None and _but_step(rec) == _but_step(last)
                if self.swim is None or last is None or since >= self.config.record_s or (rec.seq != last.seq and (
                        since >= self.step_record_s() or not step_only)):
                    stored_at = loop.time()
                    # a new step is no news: the watchers are not sent it, nor told of it on the pings
                    # (at 1,000 training peers, 33 records a second at each watcher, and the news
                    # of steps filled every ping's room before joins' and deaths')
                    await self._announce(tell=not step_only)
            except Exception as e:
                log.warning("heartbeat failed: %s", e)
            # a fixed rate: a slow store (a busy machine) must not stretch the period towards the TTL
            next_at = max(next_at + self.config.heartbeat_s, loop.time())

    async def read_records(self, peer_ids) -> None:
        """Reads the member keys of ``peer_ids`` (not every key) into the view: records of members
        SWIM told of (``swim_loop``)."""
        self.take_records(await membership.read_members(self._dht, self.config.swarm, self._on_bad, peer_ids=peer_ids))

    def take_records(self, got: dict[str, PeerRecord]) -> None:
        member_view.take(self, got)

    def _update_view(self, view: dict[str, PeerRecord], whole: bool = True) -> None:
        member_view.update(self, view, whole)

    def _task_done(self, task: asyncio.Task) -> None:
        if task in self._tasks:
            self._tasks.remove(task)  # short-lived ones (news of a stage map) do not pile up
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s crashed: %r", task.get_name(), task.exception())


STEP_RECORD_PER_PEER_S = 0.3


def _but_step(rec: PeerRecord) -> PeerRecord:
    """A record as compared for a change worth storing at once: without its seq, time and step."""
    return replace(rec, seq=0, ts=0.0, progress={k: v for k, v in rec.progress.items() if k != "step"})
