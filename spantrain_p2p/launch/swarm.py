"""``spantrain swarm``: one peer process per scenario peer on this machine, the first alone, the rest
joining it; then form only, measure, or train (following the run, firing chaos), and stop them all.

The launcher only starts processes and reads what they report; it coordinates nothing.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Optional

from .. import scenario as sc
from ..job.options import peer_argv
from .chaos import check_order, parse as parse_chaos
from .follow import train_and_report
from .processes import PeerProcess, new_run_dir, wait_until
from . import real_time
from .report import measure_and_report


def launch_scenario(scenario_path: str, run_dir: str, heartbeat: float = 2.0, swarm: Optional[str] = None,
                    extra_args: tuple[str, ...] = (), first_args: tuple[str, ...] = (),
                    hold: tuple[str, ...] = (), per_peer: Optional[dict[str, tuple[str, ...]]] = None
                    ) -> list[PeerProcess]:
    """Starts one peer per scenario peer: the first one alone (with ``first_args``), the rest joining it.
    Peers named in ``hold`` are prepared (with --join) but not started: ``start()`` them later;
    ``per_peer``: more flags for some peers by name (``--byzantine`` of the attack harness)."""
    s = sc.load(scenario_path)
    swarm = swarm or f"{s.name}-{os.getpid()}-{int(time.time())}"
    common = ["--swarm", swarm, "--heartbeat", str(heartbeat), *extra_args]
    procs = [PeerProcess(p.name, ["--emulate", f"{scenario_path}:{p.name}", *common,
                                  *(per_peer or {}).get(p.name, ())], run_dir) for p in s.peers]
    starting = [p for p in procs if p.name not in hold]
    starting[0].args += list(first_args)
    try:
        first = starting[0].start()
        first.wait_ready(60)
        for p in procs:
            if p is not first:
                p.args += ["--join", first.info["address"]]
        for p in starting[1:]:
            p.start()
        for p in starting[1:]:
            p.wait_ready(90)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def job_args(args, num_peers: int) -> tuple[list[str], list[str]]:
    """(flags for the peer that defines the job, flags for every peer) from `spantrain swarm` options;
    the job waits for ``num_peers`` ready peers unless ``--peers`` says otherwise."""
    peers = args.peers if getattr(args, "peers", None) is not None else num_peers
    return peer_argv({**vars(args), "peers": peers})


def _smallest_workload_op(args) -> Optional[float]:
    """The FLOPs of the workload's smallest padded op of a micro-batch (None without a workload)."""
    if not getattr(args, "workload", None):
        return None
    from ..models import workload
    from ..job.spec import JobSpec

    job = JobSpec(workload=args.workload, workload_seq_len=args.workload_seq_len,
                  micro_batch_size=args.micro_batch_size)
    return min(f for op in workload.layer_flops(job, 0, workload.num_layers(job)) for f in op.values() if f > 0)


def swarm_command(args) -> int:
    code, summary = run_swarm(args)
    if summary is not None and args.json:
        print(json.dumps(summary), flush=True)
    return code


def run_swarm(args) -> tuple[int, Optional[dict]]:
    run_dir = args.run_dir or new_run_dir()
    os.makedirs(run_dir, exist_ok=True)
    if getattr(args, "time_dilation", None) is not None:  # the peers read a copy at that dilation
        args.scenario = sc.write_dilated(args.scenario, args.time_dilation, os.path.join(run_dir, "scenario.toml"))
    s = sc.load(args.scenario)
    chaos = [parse_chaos(c, [p.name for p in s.peers], list(s.regions)) for c in (args.chaos or [])]
    check_order(chaos)
    held = tuple(c.target for c in chaos if c.action == "join")
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    say(f"launching {len(s.peers)} peers of scenario {s.name!r} (logs in {run_dir})")
    if (warning := sc.emulation_warning(s, _smallest_workload_op(args))) is not None:
        print(f"spantrain swarm: warning: {warning}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    procs: list[PeerProcess] = []
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1) or (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        training = args.steps is not None or args.measure_only
        if args.measure_only:
            args.steps = 0
        first_args, every_args = job_args(args, len(s.peers) - len(held)) if training else ([], [])
        every_args += ["--emulate-t0", str(time.monotonic())]
        # chaos comes from this launcher only: its identity, its peer id on every peer's command line
        from ..swarm.identity import Identity

        operator = Identity.generate()
        args.operator_identity = os.path.join(run_dir, "operator.id")
        if os.path.exists(args.operator_identity):
            os.remove(args.operator_identity)
        operator.save(args.operator_identity)
        every_args += ["--operator", operator.peer_id, "--liveness", getattr(args, "liveness", "swim")]
        if getattr(args, "verbose", 0) > 1:  # -vv: the peers log at debug level too
            every_args.append("-" + "v" * args.verbose)
        procs = launch_scenario(args.scenario, run_dir, heartbeat=args.heartbeat, extra_args=tuple(every_args),
                                first_args=tuple(first_args), hold=held,
                                per_peer={c.target: ("--byzantine", c.attack) for c in chaos if c.action == "byzantine"})
        all_procs = procs
        procs = [p for p in procs if p.name not in held]
        n = len(procs)

        def launch_peer(name: str) -> None:
            p = next(x for x in all_procs if x.name == name)
            p.start()
            procs.append(p)
        started = time.monotonic() - t0

        def everyone_sees_all():
            counts = [p.status()["member_count"] for p in procs]
            return counts if all(c == n for c in counts) else None

        # each peer confirms a member once it answered or was read: with SWIM's one ping a second, 32
        # peers on this 2-core box saw all 57-62 s after the last start (lan-32, 2026-11-28)
        wait_until(everyone_sees_all, max(60.0, 3.0 * n), what=f"every peer to see all {n}")
        formed = time.monotonic() - t0
        say(f"swarm formed: {n}/{n} peers see each other after {formed:.1f}s (all started after {started:.1f}s)")
        say(f"  {'peer':<10} {'peer id':<48} {'state':<8} data plane")
        # a peer busy starting its job (its data read and tokenized, its model built) can take more
        # than a status call's 5 s to answer on a loaded box: that is no reason to stop the swarm
        sts = [wait_until(p.status, 30, what=f"{p.name} to answer /status") for p in procs]
        for p, st in zip(procs, sts):
            say(f"  {p.name:<10} {p.info['peer_id']:<48} {st['state']:<8} {p.info['data_url']}")
        say(f"join this swarm with: spantrain-peer --join {procs[0].info['address']} --swarm {sts[0]['swarm']}")
        say(f"dashboard (any peer's data plane serves it): {procs[0].info['data_url']}/")
        if args.measure_only:
            summary = real_time.measurements(measure_and_report(procs, s, say), s.time_dilation)
        elif training:
            summary = real_time.run_summary(train_and_report(procs, args, say, chaos, launch_peer, s), s.time_dilation)
            summary["scenario"] = s.name
            summary["run_dir"] = run_dir
            with open(os.path.join(run_dir, "summary.json"), "w") as f:
                json.dump(summary, f)
            say(f"pictures of this run: spantrain report {run_dir}")
            if summary["losses"]:
                say(f"trained {summary['steps']} steps: loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}, "
                    f"{summary['samples_per_s']:.4g} samples/s, median step {summary['step_s']:.4g}s" +
                    (f" (real time: the emulation ran {s.time_dilation:g}x slower)" if s.time_dilation != 1 else ""))
            other = {k: v for k, v in (summary.get("paths") or {}).items() if v["path"] != "direct"}
            if other:
                say("paths: " + ", ".join(f"{k} {v['path']}" + (f" via {v['via']}" if v["via"] else "")
                                          for k, v in sorted(other.items())))
        elif args.duration is None:
            say("Ctrl-C stops the swarm")
            while all(p.alive() for p in procs):
                time.sleep(0.5)
            dead = [p.name for p in procs if not p.alive()]
            say(f"peer(s) {', '.join(dead)} exited; stopping the swarm")
        else:
            time.sleep(args.duration)
        if not training:
                summary = {"scenario": s.name,
                       "peers": [{"name": p.name, **{k: p.info[k] for k in ("peer_id", "address", "data_url")}}
                                 for p in procs],
                       "formed_s": round(formed, 3), "members_seen": n, "run_dir": run_dir}
        code = 0
    except KeyboardInterrupt:
        say("stopping the swarm")
        summary, code = None, 130
    except (TimeoutError, RuntimeError) as e:
        print(f"spantrain swarm: error: {e}", file=sys.stderr, flush=True)
        summary, code = None, 1
    finally:
        for p in procs:
            p.signal(signal.SIGINT)
        for p in procs:
            p.stop(timeout=10)
        for p in locals().get("all_procs", []):
            p.kill()
    return code, summary
