"""``spantrain-peer``: one peer process: its parser, its config from the command line, and the loop
that runs the peer (and its trainer) until Ctrl-C, SIGTERM or the end of the job."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Optional

from .. import __version__
from .. import import_noise
from ..job.options import add_job_arguments

log = logging.getLogger("spantrain")


def setup_logging(verbose: int) -> None:
    """Logs to stderr, one line each; ``-vv``: debug, hivemind's too."""
    level = logging.DEBUG if verbose > 1 else logging.INFO
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # hivemind is chatty at INFO; its warnings still show
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose > 1 else "WARNING")
    logging.getLogger("hivemind").setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)
    if verbose <= 1:  # torchao's notes of the kernels this machine lacks (``import_noise``)
        import_noise.leave_out()


def peer_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spantrain-peer",
        description="Run one SpanTrain-P2P peer. With no --join it starts a new swarm and prints the address "
        "others join.",
    )
    p.add_argument("--join", action="append", default=[], metavar="MADDR",
                   help="multiaddr of a swarm peer (…/p2p/<peer id>); repeatable; 'auto' finds a swarm on the LAN "
                   "through mDNS (and starts one if there is none)")
    p.add_argument("--swarm", default="default", help="swarm name (default: %(default)s)")
    p.add_argument("--listen", default=None, metavar="MADDR",
                   help="where the p2p daemon listens (default: /ip4/0.0.0.0/tcp/0 when --join names a non-loopback "
                   "address, else /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/PORT for a founder others reach)")
    p.add_argument("--host", default=None, help="data-plane bind address (default: 0.0.0.0 when --join or --listen "
                   "is not loopback, else 127.0.0.1)")
    p.add_argument("--data-port", type=int, default=0, help="data-plane TCP port (default: any free port)")
    p.add_argument("--announce", action="append", default=[], metavar="HOST[:PORT]",
                   help="an address others reach this peer's data plane at (a public address, a forwarded port); "
                   "repeatable (default: the interfaces' addresses, the one towards --join first)")
    p.add_argument("--identity", metavar="PATH", help="private key file for a stable peer id (created if missing)")
    p.add_argument("--name", default="", help="a human name for this peer, shown to others")
    p.add_argument("--emulate", metavar="SCENARIO:PEER",
                   help="behave as PEER of the scenario file SCENARIO (name and device class)")
    p.add_argument("--operator", default="", metavar="PEER_ID",
                   help="an emulated peer takes chaos (link changes) from this peer id only (the launcher's)")
    p.add_argument("--emulate-t0", type=float, default=None, metavar="T",
                   help="CLOCK_MONOTONIC time the scenario's bandwidth traces count from (default: peer start)")
    p.add_argument("--heartbeat", type=float, default=2.0, metavar="S",
                   help="seconds between heartbeats; a silent peer is dropped after 3 (default: %(default)s)")
    p.add_argument("--liveness", choices=("records", "swim"), default="swim",
                   help="how members learn who is alive: swim (the default: direct probes between peers, news "
                        "carried on them; records re-stored only when they change: a peer's control traffic flat "
                        "in the swarm's size) or records (a DHT record re-stored every heartbeat)")
    p.add_argument("--mdns", action="store_true", help="advertise this peer on the LAN through mDNS")
    p.add_argument("--swarm-key", metavar="PATH",
                   help="a closed swarm's key file (`spantrain keygen PATH`): only its holders join, read or send")
    p.add_argument("--allow", action="append", default=[], metavar="PEER_ID|@FILE",
                   help="take part only with these peer ids (repeatable; @FILE: one id per line)")
    p.add_argument("--relay", type=int, default=16, metavar="N",
                   help="relay at most N circuits at once for peers behind NAT that reach each other no other way "
                   "(a reachable peer only; 0: never; default: %(default)s)")
    p.add_argument("--encrypt", action="store_true",
                   help="encrypt data-plane connections to peers of this machine too (every connection that leaves "
                   "it is encrypted and integrity-protected): where others than root can capture its loopback")
    p.add_argument("--stall-timeout", type=float, default=30.0, metavar="S",
                   help="close a data-plane connection whose message stops arriving for S seconds (default: 30)")
    p.add_argument("--byzantine", default="", metavar="ATTACK",
                   help="testing an open swarm's defences: this peer sends forged contributions (gradient-sum "
                   "parts and pseudo-gradients: signflip, signflip1000, random1000, alie, ipm, stale, zero; what it "
                   "sends its pipeline neighbours: zeroact, scaleact, noiseact); "
                   "`spantrain swarm --chaos byzantine:PEER:ATTACK`")
    p.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the peer's event loop: uvloop (libuv's, what hivemind runs its DHT on; the default) or "
                   "Python's own asyncio loop (about a tenth more CPU on a training peer's loop, measured)")
    p.add_argument("--ready-file", metavar="PATH", help="write a JSON line here once joined (for launchers)")
    t = p.add_argument_group("training job (only on the peer that starts the swarm; joiners adopt it)")
    add_job_arguments(t)
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--version", action="version", version=f"spantrain-peer {__version__}")
    return p


def train_options(a: argparse.Namespace):
    """The trainer's options (and, on the peer that defines it, the job) from the parsed command line:
    built by the Python API's own function (``api.job.train_options``), so the two cannot drift."""
    from ..api.job import train_options as api_train_options

    if a.steps is not None and a.join and a.join != ["auto"]:
        raise ValueError("--steps defines the swarm's job: give it to the peer that starts the swarm, not a joiner")
    return api_train_options(a, defines_job=a.steps is not None, byzantine=a.byzantine)


def config_from_args(a: argparse.Namespace):
    """The ``PeerConfig`` of the parsed command line."""
    from ..peer import PeerConfig
    from ..swarm import discovery

    name, device = a.name, {}
    if a.emulate:
        from .. import scenario as sc

        path, sep, peer_name = a.emulate.rpartition(":")
        if not sep or not path or not peer_name:
            raise ValueError(f"--emulate wants SCENARIO:PEER, not {a.emulate!r}")
        s = sc.load(path)
        dev = s.device_of(peer_name)
        name = name or peer_name
        device = {"kind": dev.name, "memory_gb": dev.memory_gb, "gpus": dev.gpus}
    join = tuple(a.join)
    if "auto" in join:
        if len(join) > 1:
            raise ValueError("--join auto cannot be combined with other --join addresses")
    else:
        discovery.parse_join(join)
    if a.heartbeat <= 0:
        raise ValueError("--heartbeat must be positive")
    allow = allow_list(a.allow)
    if a.stall_timeout <= 0:
        raise ValueError("--stall-timeout must be positive")
    from ..net.addresses import default_binds, parse_announce

    for value in a.announce:
        parse_announce(value)
    listen, host = default_binds(a.listen, a.host, join)
    return PeerConfig(join=join, swarm=a.swarm, listen=listen, host=host, data_port=a.data_port,
                      announce=tuple(a.announce), relay_circuits=max(0, a.relay),
                      identity_path=a.identity, name=name, device=device, heartbeat_s=a.heartbeat, mdns=a.mdns, liveness=a.liveness,
                      emulate=a.emulate or "", emulate_t0=a.emulate_t0, operator=a.operator, swarm_key_path=a.swarm_key or "",
                      allow=allow, encrypt=True, encrypt_on_host=a.encrypt, stall_timeout_s=a.stall_timeout)


def allow_list(items: list[str]) -> tuple[str, ...]:
    """Peer ids from ``--allow`` values: ids, or ``@FILE`` with one id per line (# comments)."""
    out: list[str] = []
    for item in items:
        if item.startswith("@"):
            try:
                with open(item[1:], encoding="utf-8") as f:
                    lines = f.read(1 << 20).splitlines()
            except OSError as e:
                raise ValueError(f"--allow {item}: {e.strerror}") from None
            out += [ln.split("#", 1)[0].strip() for ln in lines]
        else:
            out.append(item.strip())
    ids = tuple(dict.fromkeys(i for i in out if i))
    bad = [i for i in ids if not (20 <= len(i) <= 128 and i.isalnum())]
    if bad:
        raise ValueError(f"--allow: {bad[0]!r} is not a peer id")
    if items and not ids:
        raise ValueError("--allow lists no peer id")
    return ids


async def run_peer(config, ready_file: Optional[str], train_options=None) -> int:
    """Runs the peer (a ``Session`` of the Python API) until Ctrl-C or SIGTERM; the exit code: 0, 3 if
    it refused the job, 4 if its trainer crashed (it leaves at once: the others re-plan without it)."""
    from ..api.session import Session
    from ..errors import JobRefused, PeerCrashed, TrainingStopped

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    session = Session(config, train_options)
    trainer = session.trainer
    async with session:
        print(f"swarm address: {session.address}", flush=True)
        if not config.join:
            print(f"others join with: spantrain-peer --join {session.address}", flush=True)
        if ready_file:
            peer = session.peer
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"peer_id": peer.peer_id, "address": peer.address, "maddrs": peer.maddrs,
                           "data_url": peer.dataplane.url, "pid": os.getpid(), "name": config.name}, f)
            os.replace(tmp, ready_file)
        waits = [asyncio.create_task(stop.wait())]
        if trainer is not None:
            waits.append(asyncio.create_task(trainer.finished.wait()))
        try:
            while not stop.is_set():
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if session.done:
                    try:
                        session.raise_for_outcome()
                    except (JobRefused, PeerCrashed) as e:
                        print(f"spantrain-peer: error: {e}", file=sys.stderr, flush=True)
                        return 3 if isinstance(e, JobRefused) else 4
                    except TrainingStopped:  # said in its log and /status; the peer stays for its pages
                        pass
                    waits = [w for w in waits if not w.done()]
        finally:
            for w in waits:
                w.cancel()
        log.info("stopping: leaving the swarm")
    return 0


def _loop_factory(name: str):
    """The event loop ``--event-loop`` names (None: asyncio's own). A training peer's loop carries its
    data plane, control plane and schedule: on the side-by-side's 1F1B swarm uvloop's took 200 and
    217 ms of CPU a step against asyncio's 219 and 241 (four peers, alternating runs, 2026-11-29)."""
    if name == "uvloop":
        import uvloop  # (installed with hivemind, whose DHT runs on it)

        return uvloop.new_event_loop
    return None


def main(argv: Optional[list[str]] = None) -> int:
    """``spantrain-peer``; the exit code: 0 done or stopped, 1 bad arguments or no start, 3 refused, 4 crashed."""
    args = peer_parser().parse_args(argv)
    setup_logging(args.verbose)
    from .._hivemind_lite import install

    install()  # ~0.9 s of CPU less per peer (see the module)
    import torch

    torch.set_num_threads(1)  # peers share the machine's cores; more threads only add stalls
    from ..peer import PeerError
    from ..scenario import ScenarioError

    try:
        config = config_from_args(args)
        from ..train import loop_cpu

        with asyncio.Runner(loop_factory=loop_cpu.wrap_loop_factory(_loop_factory(args.event_loop))) as runner:
            return runner.run(run_peer(config, args.ready_file, train_options(args)))
    except (PeerError, ScenarioError, ValueError) as e:
        print(f"spantrain-peer: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
