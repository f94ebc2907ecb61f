"""``spantrain``, the operator's tool: its parser and the dispatch to each subcommand."""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Optional

from .. import __version__
from ..job.options import add_job_arguments
from ..peer_command.main import setup_logging


def add_swarm_arguments(sw: argparse.ArgumentParser) -> None:
    """The options of `spantrain swarm` (and `spantrain bench`, which runs swarms)."""
    sw.add_argument("--scenario", required=True, metavar="FILE", help="scenario file, e.g. peers/lan-4.toml")
    sw.add_argument("--duration", type=float, default=None, metavar="S",
                    help="stop the swarm after S seconds once formed (default: run until Ctrl-C)")
    sw.add_argument("--run-dir", default=None, help="where peer logs go (default: a new folder under runs/)")
    sw.add_argument("--heartbeat", type=float, default=2.0)
    sw.add_argument("--liveness", choices=("records", "swim"), default="swim",
                    help="the peers' --liveness (default swim: direct probes, news carried on them; records: a DHT record every heartbeat)")
    sw.add_argument("--time-dilation", type=float, default=None, metavar="K",
                    help="run the scenario's world K times slower than real time instead of its own time_dilation "
                    "(the same world: every figure is reported in real time)")
    sw.add_argument("--json", action="store_true", help="print one JSON summary on the last line of stdout")
    add_job_arguments(sw.add_argument_group("training job (passed on to the peers; --steps, or --measure-only, "
                                            "starts it)"), swarm=True)
    sw.add_argument("--chaos", action="append", default=[], metavar="SPEC",
                    help="fault injection, repeatable: kill:PEER@step=K, kill:planner@step=K, join:PEER@step=K, "
                    "degrade:A-B:F@WHEN, restore:A-B@WHEN (WHEN: step=K; t=S, seconds after "
                    "training's first step; after=S, seconds after the --chaos before it fired)")
    sw.add_argument("-v", "--verbose", action="count", default=0, help="-vv: debug logs, the peers' too")


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spantrain", description="SpanTrain-P2P operator tool")
    p.add_argument("--version", action="version", version=f"spantrain {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    st = sub.add_parser("status", help="list the live members of a running swarm")
    st.add_argument("--join", action="append", required=True, metavar="MADDR", help="multiaddr of any swarm peer")
    st.add_argument("--swarm", default="default")
    st.add_argument("--timeout", type=float, default=30.0)
    st.add_argument("--swarm-key", metavar="PATH", help="the key file of a closed swarm")
    st.add_argument("--allow", action="append", default=[], metavar="PEER_ID|@FILE",
                    help="a closed swarm's allow-list (as its peers'): read it as a listed member, with --identity")
    st.add_argument("--identity", metavar="PATH", help="an identity on the allow-list (spantrain-peer --identity makes one)")
    st.add_argument("--json", action="store_true", help="print one JSON object on the last line of stdout")
    st.add_argument("-v", "--verbose", action="count", default=0)

    pl = sub.add_parser("plan", help="plan a scenario offline and compare with the baselines")
    from .plan import add_plan_arguments

    add_plan_arguments(pl)
    pl.add_argument("-v", "--verbose", action="count", default=0)

    add_swarm_arguments(sub.add_parser("swarm", help="launch a local swarm of peer processes from a scenario file"))
    be = sub.add_parser("bench", help="the planner's plan and the baselines, back to back, with ratios")
    add_swarm_arguments(be)
    be.add_argument("--runs", default=None, metavar="LIST",
                    help="which runs, in order (default: planner,islands,best-region,gpipe-uniform,1f1b-uniform; planner is the step-synchronous plan, islands the --sync islands one)")
    from .tokenizer import add_tokenizer_arguments

    add_tokenizer_arguments(sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a local data set"))
    from .export import add_export_arguments

    ex = sub.add_parser("export", help="write a checkpoint as a transformers directory (from_pretrained loads it)")
    add_export_arguments(ex)
    ex.add_argument("-v", "--verbose", action="count", default=0)
    kg = sub.add_parser("keygen", help="write a new swarm key: peers given it (--swarm-key) form a closed swarm")
    kg.add_argument("path", metavar="PATH", help="where the key goes (created with mode 0600; never overwritten)")
    kg.add_argument("-v", "--verbose", action="count", default=0)
    ident = sub.add_parser("identity", help="make (if missing) a peer identity file and print its peer id, "
                                            "the id an allow-list names")
    ident.add_argument("path", metavar="PATH", help="the identity file (spantrain-peer --identity PATH uses it)")
    ident.add_argument("-v", "--verbose", action="count", default=0)
    rp = sub.add_parser("report", help="draw a run's pictures (loss, tokens/s, a step's timeline, links) as PNGs")
    rp.add_argument("run_dir", metavar="RUN_DIR", help="a folder `spantrain swarm --steps N` wrote (it says where)")
    rp.add_argument("--out", default=None, help="where the pictures go (default: RUN_DIR/report)")
    rp.add_argument("--step", type=int, default=None, help="the step whose timeline to draw (default: the newest kept)")
    rp.add_argument("-v", "--verbose", action="count", default=0)
    return p


def keygen_command(path: str) -> int:
    from ..swarm.sealing import SwarmKey

    try:
        key = SwarmKey.write_new(path)
    except FileExistsError:
        print(f"spantrain keygen: error: {path} exists; a swarm key is never overwritten", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"spantrain keygen: error: {path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote swarm key {path} (key id {key.key_id.hex()}); give it to every member out of band:\n"
          f"  spantrain-peer --swarm-key {path} ...\n"
          f"operator token for the dashboard and the pages of the swarm's peers (keep it as secret as the key):\n"
          f"  {key.operator_token}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = main_parser().parse_args(argv)
    setup_logging(args.verbose)
    if args.cmd in ("swarm", "bench"):
        from ..launch import zygote

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
        if args.cmd == "report":
            from ..view.pictures import report

            paths = report(args.run_dir, args.out, args.step)
            for k, v in paths.items():
                print(f"{k:>10}: {v or '(no data for it in this run)'}")
            return 0
        if args.cmd == "keygen":
            return keygen_command(args.path)
        if args.cmd == "identity":
            from ..swarm.identity import Identity

            try:
                ident, created = Identity.load_or_create(args.path)
            except (OSError, ValueError) as e:
                print(f"spantrain identity: error: {args.path}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
                return 1
            print(ident.peer_id)
            print(f"{'made' if created else 'read'} {args.path}: give it to `spantrain-peer --identity`, and "
                  f"the id above to the swarm's --allow list", file=sys.stderr)
            return 0
        if args.cmd == "export":
            from .export import export_command

            return export_command(args)
        if args.cmd == "tokenizer":
            from .tokenizer import tokenizer_command

            return tokenizer_command(args)
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
