"""Launching peer processes on this machine: ``spantrain swarm`` and the tests use this.

Each peer is a real ``spantrain-peer`` process with its own log file, forked by this launcher's
zygote (``zygote.py``: torch and hivemind imported once; ``SPANTRAIN_ZYGOTE=0`` starts each peer as
``python -m spantrain_p2p peer`` instead). The launcher only starts processes and reads what they
report, it coordinates nothing. Peers get SIGTERM if the launcher dies, and ``stop`` escalates to
SIGKILL, so none is left behind.
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
from typing import Optional, Union

from . import zygote

_PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass
class PeerProcess:
    name: str
    args: list[str]
    run_dir: str
    proc: Optional[Union[subprocess.Popen, zygote.ForkedPeer]] = None
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
        argv = ["--ready-file", self.ready_file, *self.args]
        if zygote.enabled():
            try:
                self.proc = zygote.shared().spawn(argv, self.log_file)
                return self
            except zygote.ZygoteError as e:
                print(f"spantrain: {e}; starting peer {self.name} as a new process", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "spantrain_p2p", "peer", *argv]
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
        """To the peer process only: its p2pd, in the same process group, must outlive a SIGINT long
        enough for the peer to write its tombstone through it and stop it (a group-wide SIGINT
        killed the daemon first, and every peer spent 5-10 s in timeouts before exiting)."""
        if self.alive():
            try:
                os.kill(self.proc.pid, sig)
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
                    extra_args: tuple[str, ...] = (), first_args: tuple[str, ...] = (),
                    hold: tuple[str, ...] = ()) -> list[PeerProcess]:
    """Starts one peer per scenario peer: the first one alone (with ``first_args``), the rest joining it.
    Peers named in ``hold`` are prepared (with --join) but not started: ``start()`` them later."""
    from . import scenario as sc

    s = sc.load(scenario_path)
    swarm = swarm or f"{s.name}-{os.getpid()}-{int(time.time())}"
    common = ["--swarm", swarm, "--heartbeat", str(heartbeat), *extra_args]
    procs = [PeerProcess(p.name, ["--emulate", f"{scenario_path}:{p.name}", *common], run_dir) for p in s.peers]
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
    sums: dict[int, tuple[float, int]] = {}  # each replica of the last stage reports the whole step's loss
    for r in staged:
        if r["stage"] == last_stage:
            for step, total, count, _epoch in r["loss_sums"]:
                if count > sums.get(step, (0.0, 0))[1]:
                    sums[step] = (total, count)
    losses = [sums[s][0] / sums[s][1] for s in sorted(sums)]
    last = next(r for r in staged if r["stage"] == last_stage)
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    for r in staged:
        for step, t0, t1, *_ in r["step_times"]:
            ends[step] = max(ends.get(step, 0.0), t1)
            starts[step] = min(starts.get(step, float("inf")), t0)
    steps = sorted(ends)
    intervals = [ends[b] - ends[a] for a, b in zip(steps, steps[1:])] or [ends[s] - starts[s] for s in steps]
    wall = ends[steps[-1]] - starts[steps[0]] if steps else 0.0
    import statistics

    step_s = statistics.median(intervals) if intervals else None
    # steady state: a step's samples over the median time between step completions
    sps = samples_per_step / step_s if step_s else 0.0
    return {"steps": len(steps), "losses": losses, "samples_per_s": round(sps, 3),
            "tokens_per_s": round(sps * seq_len, 1), "step_s": round(step_s, 5) if step_s else None,
            "samples_per_s_wall": round(len(steps) * samples_per_step / wall, 3) if wall > 0 else 0.0,
            "wall_s": round(wall, 3), "plan": last["plan"],
            "peers": [{"name": r["name"], "stage": r["stage"], "layers": r["layers"], "steps_done": r["steps_done"],
                       "step_s_median": r["step_s_median"], "compute_s_median": r["compute_s_median"],
                       "error": r["error"]} for r in reports]}


def epoch_figures(reports: list[dict], plans: dict[int, dict], samples_per_step: int) -> list[dict]:
    """Per stage-map epoch: its steps, measured samples/s (a step's samples over the median time
    between consecutive step completions inside the epoch) and the plan's predicted samples/s."""
    import statistics

    ends: dict[int, dict[int, float]] = {}
    for r in reports:
        for row in r.get("step_times", []):
            if len(row) >= 4:
                step, _, t1, epoch = row[:4]
                per = ends.setdefault(epoch, {})
                per[step] = max(per.get(step, 0.0), t1)
    out = []
    for epoch in sorted(set(ends) | set(plans)):
        per = ends.get(epoch, {})
        steps = sorted(per)
        gaps = [per[b] - per[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
        sps = samples_per_step / statistics.median(gaps) if gaps else None
        pred = (plans.get(epoch) or {}).get("predicted_step_s") or None
        row = {"epoch": epoch, "steps": len(steps), "first_step": steps[0] if steps else None,
               "samples_per_s": round(sps, 3) if sps else None,
               "predicted_samples_per_s": round(samples_per_step / pred, 3) if pred else None}
        row["ratio"] = round(row["samples_per_s"] / row["predicted_samples_per_s"], 3) \
            if row["samples_per_s"] and row["predicted_samples_per_s"] else None
        out.append(row)
    return out


def set_link_factor(urls: list[str], regions: tuple[str, str], factor: float) -> list[Optional[Exception]]:
    """Tells every peer to run its emulated links between two regions at ``factor`` x bandwidth;
    the error of each peer that did not take it (None where it did)."""
    import asyncio

    from .net.dataplane import DataPlaneClient

    async def send_all():
        client = DataPlaneClient()
        try:
            header = {"regions": list(regions), "factor": factor}
            return await asyncio.gather(*(client.send(u, "chaos", header, timeout=5) for u in urls),
                                        return_exceptions=True)
        finally:
            await client.close()

    return [r if isinstance(r, Exception) else None for r in asyncio.run(send_all())]


class RunFollower:
    """Follows a training run from the peers' /status: progress line, chaos, losses, events.

    Losses are gathered while the run goes (each peer's recent ones, tagged with its epoch), so a
    peer killed later does not take its part of the loss curve with it; for each step the newest
    epoch's values count (a redone step replaces the abandoned one).
    """

    def __init__(self, procs: list["PeerProcess"], args, say, chaos: list, launch_peer=None):
        self.procs, self.args, self.say = procs, args, say
        self.chaos = sorted(chaos, key=lambda c: (c.at_step if c.at_step is not None else -1, c.at_t or 0))
        self.launch_peer = launch_peer
        self.t0 = time.monotonic()
        self.killed: set[str] = set()
        self.losses: dict[tuple[int, str], dict[int, tuple[float, int]]] = {}
        self.plans: dict[int, dict] = {}
        self.events: list[dict] = []
        self.pending_recovery: list[dict] = []
        self.pending_replan: list[dict] = []
        self.train_t0: Optional[float] = None  # when the first stage map was seen
        self.max_step = 0

    def live(self) -> list["PeerProcess"]:
        return [p for p in self.procs if p.name not in self.killed and p.proc is not None]

    def poll(self) -> tuple[list[tuple["PeerProcess", dict]], Optional[str]]:
        sts = []
        for p in self.live():
            if not p.alive():
                return [], f"peer {p.name} exited (code {p.proc.returncode}):\n{p.log_tail(8)}"
            try:
                if not p.poll_ready():
                    continue  # a newcomer still starting
                sts.append((p, p.status()))
            except OSError:
                continue
        for p, st in sts:
            t = st.get("train") or {}
            if t.get("error") and "stopped the run" in t["error"]:
                return sts, f"{p.name}: {t['error']}"
            plan = t.get("plan")
            if plan:
                self.plans.setdefault(plan["epoch"], plan)
            for step, total, count, epoch in t.get("recent_losses", []):
                self.losses.setdefault((epoch, p.name), {})[step] = (total, count)
        return sts, None

    def loss_curve(self) -> list[float]:
        """Per step, the newest epoch's loss; every replica of the last stage reports the whole
        step's (sum, count) (the replicas add them up with the gradients), so any one report will do."""
        best: dict[int, tuple[int, float, int]] = {}
        for (epoch, _), steps in self.losses.items():
            for step, (total, count) in steps.items():
                if step not in best or (epoch, count) > (best[step][0], best[step][2]):
                    best[step] = (epoch, total, count)
        return [best[s][1] / best[s][2] for s in sorted(best) if best[s][2]]

    def fire_chaos(self, sts) -> None:
        now = time.monotonic() - self.t0
        if self.plans and self.train_t0 is None:
            self.train_t0 = time.monotonic()  # @t=S counts from the first stage map: training's start
        now_train = time.monotonic() - self.train_t0 if self.train_t0 is not None else -1.0
        done = min((st["train"]["steps_done"] for _, st in sts if (st.get("train") or {}).get("stage") is not None),
                   default=0)
        for c in list(self.chaos):  # in order; one not yet due does not hold back another that is
            if (c.at_step is not None and done < c.at_step) or (c.at_t is not None and now_train < c.at_t):
                continue
            self.chaos.remove(c)
            ev = {"kind": c.action, "target": c.target, "step": self.max_step, "t_s": round(now, 2)}
            if c.action == "kill":
                name = c.target
                planner = next((st["train"].get("planner") for _, st in sts if (st.get("train") or {}).get("planner")), None)
                if name == "planner":
                    name = planner
                elif name == "worker":
                    name = next((p.name for p, st in sts if (st.get("train") or {}).get("stage") is not None
                                 and p.name != planner), None)
                victim = next((p for p in self.live() if p.name == name), None)
                if victim is None:
                    self.say(f"chaos: cannot kill {c.target}: not running")
                    continue
                victim.kill()
                self.killed.add(victim.name)
                ev["target"] = victim.name
                self.say(f"chaos: killed {victim.name} (SIGKILL) after step {done}")
                self.pending_recovery.append(ev)
            elif c.action == "join":
                self.say(f"chaos: {c.target} joins at step {done}")
                self.launch_peer(c.target)
                self.pending_recovery.append(ev)
            else:
                peers = [p for p in self.live() if p.info]
                errors = set_link_factor([p.info["data_url"] for p in peers], c.regions, c.factor)
                for p, err in zip(peers, errors):
                    if err is not None:
                        self.say(f"chaos: {p.name} did not take {c.describe()}: {err}")
                self.say(f"chaos: {c.describe()}")
                ev["factor"] = c.factor
                ev["t_train_s"] = round(now_train, 2)
                self.pending_replan.append(ev)
            ev["epoch_before"] = max(self.plans) if self.plans else 0
            self.events.append(ev)

    def check_replans(self) -> None:
        """A link change is answered by a re-plan: ``replan_s`` is the time until a newer stage map
        appeared (None while there is none: e.g. a blip the swarm rightly sat out)."""
        for ev in list(self.pending_replan):
            if self.plans and max(self.plans) > ev["epoch_before"]:
                ev["replan_s"] = round(time.monotonic() - self.t0 - ev["t_s"], 2)
                ev["epoch_after"] = max(self.plans)
                self.pending_replan.remove(ev)
                self.say(f"re-planned {ev['replan_s']}s after {ev['kind']} {ev['target']} (epoch {ev['epoch_after']})")

    def check_recovery(self, sts) -> None:
        """An event is recovered once a newer epoch runs past the step the swarm had reached."""
        for ev in list(self.pending_recovery):
            newer = [st for _, st in sts if (st.get("train") or {}).get("plan")
                     and st["train"]["plan"]["epoch"] > ev["epoch_before"] and st["state"] in ("training", "done")]
            if newer and min(st["train"]["step"] for st in newer) > ev["step"]:
                ev["recovery_s"] = round(time.monotonic() - self.t0 - ev["t_s"], 2)
                self.pending_recovery.remove(ev)
                self.say(f"recovered from {ev['kind']} {ev['target']} in {ev['recovery_s']}s")

    def follow(self) -> dict:
        total = self.args.steps
        last_line, last_print = "", 0.0
        shown: set[int] = set()
        while True:
            sts, error = self.poll()
            if error:
                raise RuntimeError(f"training failed: {error}")
            for epoch in sorted(set(self.plans) - shown):
                shown.add(epoch)
                self.say(describe_plan(self.plans[epoch]))
            staged = [(p, st) for p, st in sts if (st.get("train") or {}).get("stage") is not None]
            self.max_step = max([self.max_step] + [st["train"]["step"] for _, st in staged])
            self.fire_chaos(sts)
            self.check_recovery(sts)
            self.check_replans()
            newest = max(self.plans) if self.plans else 0
            current = [(p, st) for p, st in staged if st["train"]["plan"]["epoch"] == newest]
            # weather still to come does not hold a finished run back; a kill or join does
            pending = [c for c in self.chaos if c.action in ("kill", "join")]
            finished = bool(current) and not pending and all(st["state"] == "done" for _, st in current) and \
                all(st["state"] != "recovering" for _, st in sts)
            curve = self.loss_curve()
            done = min((st["train"]["step"] for _, st in current), default=0)
            elapsed = time.monotonic() - self.t0
            line = f"step {done:>4}/{total}" + (f"  loss {curve[-1]:.4f}" if curve else "") + \
                (f"  epoch {newest}" if newest > 1 else "")
            if line != last_line and (time.monotonic() - last_print > 1.0 or finished):
                rate = done / elapsed if elapsed > 0 else 0.0
                eta = (total - done) / rate if rate else float("nan")
                self.say(f"{line}  {rate:.2f} steps/s  ETA {eta:.0f}s")
                last_line, last_print = line, time.monotonic()
            if finished:
                return {"statuses": sts}
            # each poll asks every peer for its status: on a shared machine that is CPU the training
            # peers miss, so poll often only while a chaos event, recovery or re-plan is being timed
            busy = self.chaos or self.pending_recovery or self.pending_replan
            time.sleep(0.3 if busy else 1.0)


def describe_plan(plan: dict) -> str:
    """A stage map as a few lines for people: its epoch, the stages and their peers, the prediction."""
    head = f"plan epoch {plan['epoch']} (planner term {plan.get('term', 0)})"
    if plan.get("schedule"):
        head += f", schedule {plan['schedule']}"
    if plan.get("predicted_step_s"):
        head += f", predicted {plan['predicted_step_s']:.3f}s per step"
        if plan.get("bottleneck"):
            head += f" (bottleneck {plan['bottleneck']})"
    lines = [head + ":"]
    for i, st in enumerate(plan.get("stages", [])):
        a, b = st["layers"]
        shares = st.get("microbatch_share") or {}
        peers = ", ".join(f"{p} {shares[p]:.0%}" if p in shares and len(st["peers"]) > 1 else p for p in st["peers"])
        lines.append(f"  stage {i}: layers {a}-{b - 1} on {peers}")
    return "\n".join(lines)


def figures(summary: dict, reports: list[dict], scenario=None) -> dict:
    """DESIGN.md section 5 figures from the peers' reports: prediction and bound, utilization,
    wire bytes per step (by link class when the scenario is known), emulation fidelity."""
    import statistics

    plan = summary.get("plan") or {}
    gb = summary.get("samples_per_step") or 0
    pred = plan.get("predicted_step_s") or None
    out = {"predicted_step_s": pred, "bottleneck": plan.get("bottleneck") or None,
           "bound_samples_per_s": round(gb / pred, 3) if pred else None}
    devs = [r.get("train_device") for r in reports if r.get("train_device")]
    wall = summary.get("wall_s") or 0
    if devs and wall:
        out["compute_utilization"] = round(sum(d["flops"] for d in devs) / wall / sum(d["flops_per_s"] for d in devs), 4)
        padded = sum(d["padded_ops"] for d in devs)
        out["fidelity"] = round(1 - sum(d["overruns"] for d in devs) / padded, 4) if padded else None
    else:
        out["compute_utilization"], out["fidelity"] = None, None
    per_step: dict[int, int] = {}
    by_class: dict[str, list[int]] = {}
    for r in reports:
        for step, per in r.get("wire_bytes", []):
            per_step[step] = per_step.get(step, 0) + sum(per.values())
            if scenario is not None:
                for dst, nbytes in per.items():
                    try:
                        cls = scenario.link_between(r["name"], dst)[0].name
                    except Exception:
                        cls = "unknown"
                    by_class.setdefault(cls, []).append(nbytes)
    steps = max(1, len(per_step))
    out["wire_bytes_per_step"] = int(statistics.median(per_step.values())) if per_step else 0
    out["wire_bytes_per_step_by_link_class"] = {k: int(sum(v) / steps) for k, v in sorted(by_class.items())}
    # the codec each peer last used per kind and destination ("act->vol-03": "int:6")
    out["codecs"] = {f"{r['name']}:{k}": c for r in reports for k, c in sorted((r.get("codecs") or {}).items())}
    return out


def train_and_report(procs: list["PeerProcess"], args, say, chaos=(), launch_peer=None, scenario=None) -> dict:
    """Follows training until every stage of the newest epoch is done; returns the run summary."""
    follower = RunFollower(procs, args, say, list(chaos), launch_peer)
    follower.follow()
    reports = []
    for p in follower.live():
        try:
            reports.append(p.status(path="/report"))
        except OSError:
            continue
    summary = summarize(reports, args.micro_batches * args.micro_batch_size, args.seq_len)
    summary["losses"] = follower.loss_curve()
    epochs = sorted(follower.plans)
    moves = 0
    for a, b in zip(epochs, epochs[1:]):
        old = {tuple(s["layers"]): sorted(s["peers"]) for s in follower.plans[a]["stages"]}
        new = {tuple(s["layers"]): sorted(s["peers"]) for s in follower.plans[b]["stages"]}
        moves += sum(1 for k, v in new.items() if old.get(k) != v)
    summary["samples_per_step"] = args.micro_batches * args.micro_batch_size
    summary.update(figures(summary, reports, scenario))
    summary["epochs"] = epoch_figures(reports, follower.plans, summary["samples_per_step"])
    summary.update({"replans": max(0, len(epochs) - 1), "stage_moves": moves,
                    "lost_steps": max(0, args.steps - len(summary["losses"])), "events": follower.events,
                    "plans": [follower.plans[e] for e in epochs]})
    return summary


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


def bench_command(args) -> int:
    """The planner's plan and the baselines on the same scenario, one after the other."""
    import copy

    runs, code = {}, 0
    for kind in ("planner", "gpipe-uniform", "1f1b-uniform"):
        a = copy.copy(args)
        a.plan, a.json, a.measure_only, a.chaos, a.duration = kind, True, False, [], None
        if kind != "planner":
            a.schedule = "gpipe" if kind == "gpipe-uniform" else "1f1b"
        print(f"bench: {kind}", file=sys.stderr, flush=True)
        rc, summary = run_swarm(a)
        if rc != 0 or summary is None:
            code = rc or 1
            runs[kind] = {"error": f"exit code {rc}"}
            continue
        keep = ("samples_per_s", "tokens_per_s", "step_s", "predicted_step_s", "bound_samples_per_s", "bottleneck",
                "compute_utilization", "wire_bytes_per_step", "fidelity", "plan")
        runs[kind] = {k: summary.get(k) for k in keep}
    base = runs.get("planner", {}).get("samples_per_s")
    ratios = {f"planner/{k}": round(base / v["samples_per_s"], 3) for k, v in runs.items()
              if k != "planner" and base and v.get("samples_per_s")}
    out = {"scenario": args.scenario, "steps": args.steps, "runs": runs, "ratios": ratios}
    if not args.json:
        for k, v in runs.items():
            print(f"{k:>14}: {v.get('samples_per_s')} samples/s (bound {v.get('bound_samples_per_s')})")
        print(f"ratios: {ratios}")
    print(json.dumps(out), flush=True)
    return code


def swarm_command(args) -> int:
    code, summary = run_swarm(args)
    if summary is not None and args.json:
        print(json.dumps(summary), flush=True)
    return code


def run_swarm(args) -> tuple[int, Optional[dict]]:
    from . import scenario as sc

    s = sc.load(args.scenario)
    from .chaos import parse as parse_chaos

    chaos = [parse_chaos(c, [p.name for p in s.peers], list(s.regions)) for c in (args.chaos or [])]
    held = tuple(c.target for c in chaos if c.action == "join")
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
        first_args, every_args = job_args(args, len(s.peers) - len(held)) if training else ([], [])
        every_args += ["--emulate-t0", str(time.monotonic())]
        if args.measure_only:
            every_args.append("--measure-only")
        if getattr(args, "verbose", 0) > 1:  # -vv: the peers log at debug level too
            every_args.append("-" + "v" * args.verbose)
        procs = launch_scenario(args.scenario, run_dir, heartbeat=args.heartbeat, extra_args=tuple(every_args),
                                first_args=tuple(first_args), hold=held)
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
            summary = train_and_report(procs, args, say, chaos, launch_peer, s)
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
        for p in locals().get("all_procs", []):
            p.kill()
    return code, summary
