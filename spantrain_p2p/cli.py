"""Command lines: ``spantrain-peer`` (one peer) and ``spantrain`` (the operator's tool)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Optional

from . import __version__

log = logging.getLogger("spantrain")


def _setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # hivemind is chatty at INFO; its warnings still show
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose > 1 else "WARNING")
    logging.getLogger("hivemind").setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)


# ---- spantrain-peer ----------------------------------------------------------------------------
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
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", metavar="MADDR",
                   help="where the p2p daemon listens (default: %(default)s; use /ip4/0.0.0.0/tcp/PORT on a LAN)")
    p.add_argument("--host", default="127.0.0.1", help="data-plane listen address (default: %(default)s)")
    p.add_argument("--data-port", type=int, default=0, help="data-plane TCP port (default: any free port)")
    p.add_argument("--identity", metavar="PATH", help="private key file for a stable peer id (created if missing)")
    p.add_argument("--name", default="", help="a human name for this peer, shown to others")
    p.add_argument("--emulate", metavar="SCENARIO:PEER",
                   help="behave as PEER of the scenario file SCENARIO (name and device class)")
    p.add_argument("--heartbeat", type=float, default=2.0, metavar="S",
                   help="seconds between heartbeats; a silent peer is dropped after 3 (default: %(default)s)")
    p.add_argument("--mdns", action="store_true", help="advertise this peer on the LAN through mDNS")
    p.add_argument("--ready-file", metavar="PATH", help="write a JSON line here once joined (for launchers)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--version", action="version", version=f"spantrain-peer {__version__}")
    return p


def _config_from_args(a: argparse.Namespace):
    from .peer import PeerConfig
    from .swarm import discovery

    name, device = a.name, {}
    if a.emulate:
        from . import scenario as sc

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
    return PeerConfig(join=join, swarm=a.swarm, listen=a.listen, host=a.host, data_port=a.data_port,
                      identity_path=a.identity, name=name, device=device, heartbeat_s=a.heartbeat, mdns=a.mdns)


async def _run_peer(config, ready_file: Optional[str]) -> int:
    from .peer import Peer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Peer(config) as peer:
        print(f"swarm address: {peer.address}", flush=True)
        if not config.join:
            print(f"others join with: spantrain-peer --join {peer.address}", flush=True)
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"peer_id": peer.peer_id, "address": peer.address, "maddrs": peer.maddrs,
                           "data_url": peer.dataplane.url, "pid": os.getpid(), "name": config.name}, f)
            os.replace(tmp, ready_file)
        await stop.wait()
        log.info("stopping: leaving the swarm")
    return 0


def peer_main(argv: Optional[list[str]] = None) -> int:
    args = peer_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from .peer import PeerError
    from .scenario import ScenarioError

    try:
        config = _config_from_args(args)
        return asyncio.run(_run_peer(config, args.ready_file))
    except (PeerError, ScenarioError, ValueError) as e:
        print(f"spantrain-peer: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


# ---- spantrain -------------------------------------------------------------------------------
def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spantrain", description="SpanTrain-P2P operator tool")
    p.add_argument("--version", action="version", version=f"spantrain {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    st = sub.add_parser("status", help="list the live members of a running swarm")
    st.add_argument("--join", action="append", required=True, metavar="MADDR", help="multiaddr of any swarm peer")
    st.add_argument("--swarm", default="default")
    st.add_argument("--timeout", type=float, default=30.0)
    st.add_argument("--json", action="store_true", help="print one JSON object on the last line of stdout")
    st.add_argument("-v", "--verbose", action="count", default=0)

    sw = sub.add_parser("swarm", help="launch a local swarm of peer processes from a scenario file")
    sw.add_argument("--scenario", required=True, metavar="FILE", help="scenario file, e.g. peers/lan-4.toml")
    sw.add_argument("--duration", type=float, default=None, metavar="S",
                    help="stop the swarm after S seconds once formed (default: run until Ctrl-C)")
    sw.add_argument("--run-dir", default=None, help="where peer logs go (default: a new folder under runs/)")
    sw.add_argument("--heartbeat", type=float, default=2.0)
    sw.add_argument("--json", action="store_true", help="print one JSON summary on the last line of stdout")
    sw.add_argument("-v", "--verbose", action="count", default=0)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = main_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from .scenario import ScenarioError

    try:
        if args.cmd == "status":
            from .ops import status_command

            return asyncio.run(status_command(args))
        if args.cmd == "swarm":
            from .launch import swarm_command

            return swarm_command(args)
    except (ScenarioError, ValueError) as e:
        print(f"spantrain {args.cmd}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2
