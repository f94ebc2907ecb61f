"""Launching peer processes on this machine: ``spantrain swarm`` and the tests use this.

Each peer is a real ``spantrain-peer`` process (``python -m spantrain_p2p peer``) with its own
log file; the launcher only starts processes and reads what they report, it coordinates nothing.
Peers get SIGTERM if the launcher dies, and ``stop`` escalates to SIGKILL, so none is left behind.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

_PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass
class PeerProcess:
    name: str
    args: list[str]
    run_dir: str
    proc: Optional[subprocess.Popen] = None
    info: dict = field(default_factory=dict)

    @property
    def ready_file(self) -> str:
        return os.path.join(self.run_dir, f"{self.name}.ready.json")

    @property
    def log_file(self) -> str:
        return os.path.join(self.run_dir, f"{self.name}.log")

    def start(self) -> "PeerProcess":
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        cmd = [sys.executable, "-m", "spantrain_p2p", "peer", "--ready-file", self.ready_file, *self.args]
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_term_with_parent if sys.platform.startswith("linux") else None,
            )
        return self

    def poll_ready(self) -> bool:
        """True once the peer wrote its ready file; RuntimeError if it exited first."""
        if self.info:
            return True
        if os.path.exists(self.ready_file):
            with open(self.ready_file) as f:
                self.info = json.load(f)
            return True
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"peer {self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
        return False

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.poll_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)
        return self.info

    def status(self, timeout: float = 5.0, path: str = "/status") -> dict:
        with urllib.request.urlopen(f"{self.info['data_url']}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGINT (graceful: tombstone, daemon stopped), SIGKILL to the group if it lingers."""
        if self.proc is None:
            return None
        self.signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the peer and its p2pd share its session
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def new_run_dir(base: str = "runs", tag: str = "swarm") -> str:
    path = os.path.join(base, f"{tag}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


def wait_until(pred, timeout: float, interval: float = 0.25):
    """Polls ``pred`` until it returns a truthy value; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = pred()
        except (OSError, ValueError):
            v = None
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout:.0f}s")
        time.sleep(interval)


def launch_scenario(scenario_path: str, run_dir: str, heartbeat: float = 2.0, swarm: Optional[str] = None,
                    extra_args: tuple[str, ...] = (), first_args: tuple[str, ...] = ()) -> list[PeerProcess]:
    """Starts one peer per scenario peer: the first one alone (with ``first_args``), the rest joining it."""
    from . import scenario as sc

    s = sc.load(scenario_path)
    swarm = swarm or f"{s.name}-{os.getpid()}-{int(time.time())}"
    common = ["--swarm", swarm, "--heartbeat", str(heartbeat), *extra_args]
    procs = [PeerProcess(p.name, ["--emulate", f"{scenario_path}:{p.name}", *common], run_dir) for p in s.peers]
    procs[0].args += list(first_args)
    try:
        first = procs[0].start()
        first.wait_ready(60)
        for p in procs[1:]:
            p.args += ["--join", first.info["address"]]
            p.start()
        for p in procs[1:]:
            p.wait_ready(90)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def job_args(args, num_peers: int) -> tuple[list[str], list[str]]:
    """(flags for the peer that defines the job, flags for every peer) from `spantrain swarm` options."""
    first = ["--steps", str(args.steps), "--peers", str(num_peers), "--seed", str(args.seed),
             "--micro-batches", str(args.micro_batches), "--micro-batch-size", str(args.micro_batch_size),
             "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--schedule", args.schedule]
    for kv in args.model_arg:
        first += ["--model-arg", kv]
    first += ["--stages", str(args.stages), "--checkpoint-every", str(args.checkpoint_every),
              "--compression", args.compression, "--plan", args.plan]
    every = ["--model", args.model, "--recv-timeout", str(args.recv_timeout)]
    if args.dump_grads:
        every += ["--dump-grads", args.dump_grads]
    return first, every


def summarize(reports: list[dict], samples_per_step: int, seq_len: int) -> dict:
    """The run summary from the peers' reports (see README: run summary)."""
    staged = [r for r in reports if r.get("stage") is not None]
    if not staged:
        return {"steps": 0, "losses": [], "samples_per_s": 0.0, "tokens_per_s": 0.0, "step_s": None, "plan": None}
    last_stage = max(r["stage"] for r in staged)
    sums: dict[int, list[float]] = {}
    for r in staged:
        if r["stage"] == last_stage:
            for step, total, count in r["loss_sums"]:
                acc = sums.setdefault(step, [0.0, 0])
                acc[0] += total
                acc[1] += count
    losses = [sums[s][0] / sums[s][1] for s in sorted(sums)]
    last = next(r for r in staged if r["stage"] == last_stage)
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    for r in staged:
        for step, t0, t1 in r["step_times"]:
            ends[step] = max(ends.get(step, 0.0), t1)
            starts[step] = min(starts.get(step, float("inf")), t0)
    steps = sorted(ends)
    intervals = [ends[b] - ends[a] for a, b in zip(steps, steps[1:])] or [ends[s] - starts[s] for s in steps]
    wall = ends[steps[-1]] - starts[steps[0]] if steps else 0.0
    sps = len(steps) * samples_per_step / wall if wall > 0 else 0.0
    import statistics

    return {"steps": len(steps), "losses": losses, "samples_per_s": round(sps, 3),
            "tokens_per_s": round(sps * seq_len, 1), "step_s": round(statistics.median(intervals), 5) if intervals else None,
            "wall_s": round(wall, 3), "plan": last["plan"],
            "peers": [{"name": r["name"], "stage": r["stage"], "layers": r["layers"], "steps_done": r["steps_done"],
                       "step_s_median": r["step_s_median"], "compute_s_median": r["compute_s_median"],
                       "error": r["error"]} for r in reports]}


def _progress(procs: list["PeerProcess"], total: int, t_start: float) -> tuple[Optional[str], bool, Optional[str]]:
    """(progress line, finished, error) from the peers' /status."""
    sts = []
    for p in procs:
        if not p.alive():
            return None, False, f"peer {p.name} exited (code {p.proc.returncode}):\n{p.log_tail(8)}"
        sts.append(p.status())
    trains = [st.get("train") or {} for st in sts]
    errors = [f"{p.name}: {t['error']}" for p, t in zip(procs, trains) if t.get("error")]
    if errors:
        return None, False, "; ".join(errors)
    staged = [(st, t) for st, t in zip(sts, trains) if t.get("stage") is not None]
    if not staged:
        return "waiting for the stage map…", False, None
    done = min(t["steps_done"] for _, t in staged)
    loss = next((t["loss"] for _, t in staged if t["stage"] == t["num_stages"] - 1), None)
    elapsed = time.monotonic() - t_start
    rate = done / elapsed if elapsed > 0 and done else 0.0
    eta = (total - done) / rate if rate else float("nan")
    line = (f"step {done:>4}/{total}  loss {loss:.4f}  {rate:.2f} steps/s  ETA {eta:.0f}s" if loss is not None
            else f"step {done:>4}/{total}")
    finished = all(st["state"] == "done" for st, _ in staged)
    return line, finished, None


def train_and_report(procs: list["PeerProcess"], args, say) -> dict:
    """Follows training until every stage is done; returns the run summary."""
    t_start = time.monotonic()
    last_line, last_print = "", 0.0
    while True:
        line, finished, error = _progress(procs, args.steps, t_start)
        if error:
            raise RuntimeError(f"training failed: {error}")
        now = time.monotonic()
        if line and line != last_line and (now - last_print > 1.0 or finished):
            say(line)
            last_line, last_print = line, now
        if finished:
            break
        time.sleep(0.3)
    reports = [p.status(path="/report") for p in procs]
    return summarize(reports, args.micro_batches * args.micro_batch_size, args.seq_len)


def measurement_summary(scenario, measurements: list[dict]) -> dict:
    """The --measure-only contract: measured links and devices beside the scenario's configuration."""
    links, devices, ops, ok_ops = [], [], 0, 0
    for m in measurements:
        src = m["peer"]
        for dst, lm in sorted(m["links"].items()):
            conf, _ = scenario.link_between(src, dst)
            links.append({"src": src, "dst": dst, "rtt_ms": lm["rtt_ms"], "mbps": lm["mbps"], "status": lm["status"],
                          "configured_rtt_ms": conf.rtt_ms, "configured_mbps": conf.mbps})
        dev = scenario.device_of(src)
        devices.append({"peer": src, "tflops": m["tflops"], "configured_tflops": dev.tflops,
                        "memory_gb": m["memory_gb"], "configured_memory_gb": dev.memory_gb})
        stats = m.get("device_stats") or {}
        ops += stats.get("padded_ops", 0)
        ok_ops += stats.get("padded_ops", 0) - stats.get("overruns", 0)
    windows = [m["probe_window"] for m in measurements if m.get("probe_window")]
    return {"links": links, "devices": devices,
            # from the first probe of any peer to the last: the swarm's whole probing phase
            "probe_seconds": round(max(w[1] for w in windows) - min(w[0] for w in windows), 3) if windows else 0.0,
            "probe_seconds_per_peer": max((m["probe_seconds"] for m in measurements), default=0.0),
            "fidelity": round(ok_ops / ops, 4) if ops else None}


def measure_and_report(procs: list["PeerProcess"], scenario, say, timeout: float = 300) -> dict:
    say("measuring: device profiles and link probes…")
    wait_until(lambda: all(p.status()["state"] == "done" or not p.alive() for p in procs), timeout, interval=0.5)
    dead = [p.name for p in procs if not p.alive()]
    if dead:
        raise RuntimeError(f"peer(s) {', '.join(dead)} exited while measuring")
    return measurement_summary(scenario, [p.status(path="/measurements") for p in procs])


def swarm_command(args) -> int:
    from . import scenario as sc

    s = sc.load(args.scenario)
    run_dir = args.run_dir or new_run_dir()
    os.makedirs(run_dir, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    say(f"launching {len(s.peers)} peers of scenario {s.name!r} (logs in {run_dir})")
    t0 = time.monotonic()
    procs: list[PeerProcess] = []
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1) or (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        training = args.steps is not None or args.measure_only
        if args.measure_only:
            args.steps = 0
        first_args, every_args = job_args(args, len(s.peers)) if training else ([], [])
        every_args += ["--emulate-t0", str(time.monotonic())]
        if args.measure_only:
            every_args.append("--measure-only")
        procs = launch_scenario(args.scenario, run_dir, heartbeat=args.heartbeat, extra_args=tuple(every_args),
                                first_args=tuple(first_args))
        n = len(procs)
        started = time.monotonic() - t0

        def everyone_sees_all():
            counts = [p.status()["member_count"] for p in procs]
            return counts if all(c == n for c in counts) else None

        wait_until(everyone_sees_all, 60)
        formed = time.monotonic() - t0
        say(f"swarm formed: {n}/{n} peers see each other after {formed:.1f}s (all started after {started:.1f}s)")
        say(f"  {'peer':<10} {'peer id':<48} {'state':<8} data plane")
        for p in procs:
            st = p.status()
            say(f"  {p.name:<10} {p.info['peer_id']:<48} {st['state']:<8} {p.info['data_url']}")
        say(f"join this swarm with: spantrain-peer --join {procs[0].info['address']} --swarm "
            f"{procs[0].status()['swarm']}")
        if args.measure_only:
            summary = measure_and_report(procs, s, say)
        elif training:
            summary = train_and_report(procs, args, say)
            summary["scenario"] = s.name
            summary["run_dir"] = run_dir
            if summary["losses"]:
                say(f"trained {summary['steps']} steps: loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}, "
                    f"{summary['samples_per_s']:.1f} samples/s, median step {summary['step_s']:.3f}s")
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
    if summary is not None and args.json:
        print(json.dumps(summary), flush=True)
    return code
