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

from .. import __version__

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
    p.add_argument("--emulate-t0", type=float, default=None, metavar="T",
                   help="CLOCK_MONOTONIC time the scenario's bandwidth traces count from (default: peer start)")
    p.add_argument("--heartbeat", type=float, default=2.0, metavar="S",
                   help="seconds between heartbeats; a silent peer is dropped after 3 (default: %(default)s)")
    p.add_argument("--mdns", action="store_true", help="advertise this peer on the LAN through mDNS")
    p.add_argument("--ready-file", metavar="PATH", help="write a JSON line here once joined (for launchers)")
    t = p.add_argument_group("training job (only on the peer that starts the swarm; joiners adopt it)")
    t.add_argument("--steps", type=int, help="define the swarm's job: train this many steps")
    t.add_argument("--peers", type=int, default=1, help="ready peers to wait for before training (default 1)")
    t.add_argument("--model", default="transformer", metavar="SPEC",
                   help="'transformer' (built in) or package.module:function returning a list of layers; on a "
                   "joiner it names the user model this peer agrees to run")
    t.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="argument of the model (transformer: dim, depth, heads, mlp_ratio, vocab, seed); repeatable")
    t.add_argument("--seq-len", type=int, default=32)
    t.add_argument("--micro-batch-size", type=int, default=4)
    t.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    t.add_argument("--seed", type=int, default=0, help="seed of the data order and the model init")
    t.add_argument("--schedule", default="auto", choices=["auto", "gpipe", "1f1b", "zb-h1"],
                   help="pipeline schedule (default auto: the planner picks)")
    t.add_argument("--plan", default="planner", choices=["planner", "even", "gpipe-uniform", "1f1b-uniform", "greedy"],
                   help="who places the layers (default: the planner, from the measurements)")
    t.add_argument("--recv-timeout", type=float, default=60.0, metavar="S",
                   help="upper bound of every activation/gradient receive; below it the deadline follows the recent waits (default %(default)s)")
    t.add_argument("--compression", default="none",
                   help="activations/gradients between stages: none, fp16, int8, topk:R, adaptive (default none)")
    t.add_argument("--stages", type=int, default=0,
                   help="pipeline depth: 0 = one peer per stage; N = peers share N stages as data-parallel replicas")
    t.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="checkpoint every K steps (0: never)")
    p.add_argument("--checkpoint-dir", default="checkpoints", help="where this peer writes its checkpoints")
    t.add_argument("--no-measure", action="store_true", help="skip device profiling and link probing")
    t.add_argument("--measure-only", action="store_true", help="measure (profile and probe), then stop")
    t.add_argument("--dump-grads", metavar="DIR", help="save this stage's gradients of --dump-step to DIR (testing)")
    t.add_argument("--dump-step", type=int, default=0)
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--version", action="version", version=f"spantrain-peer {__version__}")
    return p


def _model_args(pairs: list[str]) -> dict:
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--model-arg wants KEY=VALUE, not {kv!r}")
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _train_options(a: argparse.Namespace):
    from ..train.job import BUILTIN, JobSpec
    from ..train.trainer import TrainOptions

    allowed = (a.model,) if a.model != BUILTIN else ()
    job = None
    if a.steps is not None:
        if a.join and a.join != ["auto"]:
            raise ValueError("--steps defines the swarm's job: give it to the peer that starts the swarm, not a joiner")
        job = JobSpec(model=a.model, model_args=_model_args(a.model_arg), seq_len=a.seq_len,
                      micro_batch_size=a.micro_batch_size, num_micro_batches=a.micro_batches, steps=a.steps,
                      seed=a.seed, lr=a.lr, optimizer=a.optimizer, schedule=a.schedule, peers=a.peers,
                      recv_timeout_s=a.recv_timeout, stages=a.stages, compression=a.compression, plan=a.plan, checkpoint_every=a.checkpoint_every)
        # the model is built here once (its fingerprint goes into the job): a --model that does not
        # import or build stops this peer now, with the reason, instead of leaving a swarm that waits
        try:
            job = job.finalized()
        except Exception as e:
            raise ValueError(str(e) if isinstance(e, ValueError) else f"--model {a.model!r} failed to build: {e!r}") \
                from None
    return TrainOptions(job=job, allowed_models=allowed, dump_grads_dir=a.dump_grads, dump_step=a.dump_step,
                        checkpoint_dir=a.checkpoint_dir, measure=not a.no_measure, measure_only=a.measure_only)


def _config_from_args(a: argparse.Namespace):
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
    return PeerConfig(join=join, swarm=a.swarm, listen=a.listen, host=a.host, data_port=a.data_port,
                      identity_path=a.identity, name=name, device=device, heartbeat_s=a.heartbeat, mdns=a.mdns,
                      emulate=a.emulate or "", emulate_t0=a.emulate_t0)


async def _run_peer(config, ready_file: Optional[str], train_options=None) -> int:
    from ..peer import Peer
    from ..train.trainer import Trainer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    peer = Peer(config)
    trainer = Trainer(peer, train_options) if train_options is not None else None
    async with peer:
        if trainer is not None:
            peer.spawn(trainer.run(), "trainer")
        print(f"swarm address: {peer.address}", flush=True)
        if not config.join:
            print(f"others join with: spantrain-peer --join {peer.address}", flush=True)
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"peer_id": peer.peer_id, "address": peer.address, "maddrs": peer.maddrs,
                           "data_url": peer.dataplane.url, "pid": os.getpid(), "name": config.name}, f)
            os.replace(tmp, ready_file)
        waits = [asyncio.create_task(stop.wait())]
        if trainer is not None:
            waits.append(asyncio.create_task(trainer.finished.wait()))
        while not stop.is_set():
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if trainer is not None and trainer.refused:
                print(f"spantrain-peer: error: refusing to join this run: {trainer.refused}", file=sys.stderr, flush=True)
                for w in waits:
                    w.cancel()
                return 3
            if trainer is not None and trainer.crashed:
                # leave (tombstone) so that the others re-plan without this peer at once
                print(f"spantrain-peer: error: {trainer.error}", file=sys.stderr, flush=True)
                for w in waits:
                    w.cancel()
                return 4
            if trainer is not None and trainer.finished.is_set():
                waits = [w for w in waits if not w.done()]
        for w in waits:
            w.cancel()
        log.info("stopping: leaving the swarm")
    return 0


def peer_main(argv: Optional[list[str]] = None) -> int:
    args = peer_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from .._hivemind_lite import install

    install()  # ~0.9 s of CPU less per peer (see the module)
    import torch

    torch.set_num_threads(1)  # peers share the machine's cores; more threads only add stalls
    from ..peer import PeerError
    from ..scenario import ScenarioError

    try:
        config = _config_from_args(args)
        return asyncio.run(_run_peer(config, args.ready_file, _train_options(args)))
    except (PeerError, ScenarioError, ValueError) as e:
        print(f"spantrain-peer: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


# ---- spantrain -------------------------------------------------------------------------------
def add_swarm_arguments(sw: argparse.ArgumentParser) -> None:
    """The options of `spantrain swarm` (and `spantrain bench`, which runs swarms)."""
    sw.add_argument("--scenario", required=True, metavar="FILE", help="scenario file, e.g. peers/lan-4.toml")
    sw.add_argument("--duration", type=float, default=None, metavar="S",
                    help="stop the swarm after S seconds once formed (default: run until Ctrl-C)")
    sw.add_argument("--run-dir", default=None, help="where peer logs go (default: a new folder under runs/)")
    sw.add_argument("--heartbeat", type=float, default=2.0)
    sw.add_argument("--json", action="store_true", help="print one JSON summary on the last line of stdout")
    sw.add_argument("--steps", type=int, default=None, help="train this many steps, then stop (default: only form)")
    sw.add_argument("--model", default="transformer", metavar="SPEC",
                    help="'transformer' or package.module:function returning a list of layers")
    sw.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    sw.add_argument("--seq-len", type=int, default=32)
    sw.add_argument("--micro-batch-size", type=int, default=4)
    sw.add_argument("--micro-batches", type=int, default=4)
    sw.add_argument("--lr", type=float, default=1e-3)
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--schedule", default="auto", choices=["auto", "gpipe", "1f1b", "zb-h1"])
    sw.add_argument("--plan", default="planner", choices=["planner", "even", "gpipe-uniform", "1f1b-uniform", "greedy"])
    sw.add_argument("--recv-timeout", type=float, default=60.0)
    sw.add_argument("--stages", type=int, default=0, help="pipeline depth (0: one peer per stage)")
    sw.add_argument("--chaos", action="append", default=[], metavar="SPEC",
                    help="fault injection, repeatable: kill:PEER@step=K, kill:planner@step=K, join:PEER@step=K, "
                    "degrade:A-B:F@t=S, restore:A-B@t=S")
    sw.add_argument("--measure-only", action="store_true",
                    help="profile devices and probe links, print the measurements, stop")
    sw.add_argument("--compression", default="none", help="none, fp16, int8, int:BITS (2-7), topk:R or adaptive")
    sw.add_argument("--checkpoint-every", type=int, default=0, metavar="K")
    sw.add_argument("--dump-grads", metavar="DIR", help="peers save their gradients of step 0 here (testing)")
    sw.add_argument("-v", "--verbose", action="count", default=0, help="-vv: debug logs, the peers' too")


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

    pl = sub.add_parser("plan", help="plan a scenario offline and compare with the baselines")
    from .plan import add_plan_arguments

    add_plan_arguments(pl)
    pl.add_argument("-v", "--verbose", action="count", default=0)

    add_swarm_arguments(sub.add_parser("swarm", help="launch a local swarm of peer processes from a scenario file"))
    add_swarm_arguments(sub.add_parser("bench", help="the planner's plan and the baselines, back to back, with ratios"))
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = main_parser().parse_args(argv)
    _setup_logging(args.verbose)
    if args.cmd in ("swarm", "bench"):
        from .. import zygote

        zygote.prestart()  # it imports torch and hivemind while this process imports its own modules
    from .._hivemind_lite import install

    install()
    from ..scenario import ScenarioError

    try:
        if args.cmd == "status":
            from .status import status_command

            return asyncio.run(status_command(args))
        if args.cmd == "plan":
            from .plan import plan_command

            return plan_command(args)
        if args.cmd == "swarm":
            from ..launch import swarm_command

            return swarm_command(args)
        if args.cmd == "bench":
            from ..launch import bench_command

            if args.steps is None:
                args.steps = 30
            return bench_command(args)
    except (ScenarioError, ValueError) as e:
        print(f"spantrain {args.cmd}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2
