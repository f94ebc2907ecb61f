"""Following a training run from the peers' /status: the progress line, the chaos events fired at
their step or time, the losses gathered as the run goes, recovery and re-plan times; then the
run summary (``train_and_report``)."""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from .chaos import set_link_factor
from .processes import PeerProcess
from .progress import ProgressDisplay
from . import predict
from .report import describe_plan, epoch_figures, figures, summarize


class RunFollower:
    """Follows a training run from the peers' /status: progress line, chaos, losses, events.

    Losses are gathered while the run goes (each peer's recent ones, tagged with its epoch), so a
    peer killed later does not take its part of the loss curve with it; for each step the newest
    epoch's values count (a redone step replaces the abandoned one).
    """

    def __init__(self, procs: list["PeerProcess"], args, say, chaos: list, launch_peer=None,
                 time_dilation: float = 1.0):
        self.procs, self.args, self.say = procs, args, say
        self.k = time_dilation  # the progress shows tokens/s in real time
        # (place on the command line, event) of those not fired yet; a Byzantine peer attacks from its start
        self.chaos = [(i, c) for i, c in enumerate(chaos) if c.action != "byzantine"]
        self.fired_at: dict[int, float] = {}  # place on the command line -> when it fired (an @after counts from it)
        self.launch_peer = launch_peer
        self.t0 = time.monotonic()
        self.killed: set[str] = set()
        self.losses: dict[tuple[int, str], dict[int, tuple[float, int]]] = {}
        self.plans: dict[int, dict] = {}
        self.events: list[dict] = []
        self.pending_recovery: list[dict] = []
        self.pending_replan: list[dict] = []
        self.train_t0: Optional[float] = None  # when every peer of the stage map had completed a step
        self.max_step = 0
        self._last_seen: Optional[tuple[float, int]] = None  # (when, the slowest peer's step) at the last poll

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
                sts.append((p, p.status(path="/status/brief")))  # (the histories come with /report at the end)
            except OSError:
                continue
        for p, st in sts:
            t = st.get("train") or {}
            if t.get("error") and "stopped the run" in t["error"]:
                return sts, f"{p.name}: {t['error']}"
            for plan in [t.get("plan"), *(t.get("published") or [])]:  # (a planner's: maps superseded at once too)
                if isinstance(plan, dict) and isinstance(plan.get("epoch"), int):
                    self.plans.setdefault(plan["epoch"], plan)
            self.add_losses(p.name, t.get("recent_losses", []))
        return sts, None

    def add_losses(self, name: str, rows) -> None:
        """``rows`` of [step, loss sum, count, epoch] a peer reported (its recent ones while it trains,
        all of its epoch's at the end: steps faster than the polls are not lost from the curve)."""
        for step, total, count, epoch in rows:
            self.losses.setdefault((epoch, name), {})[step] = (total, count)

    def loss_curve(self) -> list[float]:
        """Per step, the newest epoch's loss; every replica of the last stage reports the whole
        step's (sum, count) (the replicas add them up with the gradients), so any one report will do."""
        best: dict[int, tuple[int, float, int]] = {}
        for (epoch, _), steps in self.losses.items():
            for step, (total, count) in steps.items():
                if step not in best or (epoch, count) > (best[step][0], best[step][2]):
                    best[step] = (epoch, total, count)
        return [best[s][1] / best[s][2] for s in sorted(best) if best[s][2]]

    def due(self, place: int, c, done: int, now_train: float) -> bool:
        """Whether a chaos event is due: at a step, a time after training's start, or a time after the
        event listed before it fired."""
        if c.at_step is not None:
            return done >= c.at_step
        if c.at_t is not None:
            return now_train >= c.at_t
        before = self.fired_at.get(place - 1)
        return before is not None and time.monotonic() - before >= c.after_s

    def fire_chaos(self, sts) -> None:
        now = time.monotonic() - self.t0
        done = min((st["train"]["steps_done"] for _, st in sts if (st.get("train") or {}).get("stage") is not None),
                   default=0)
        if self.plans and self.train_t0 is None and done >= 1:
            self.train_t0 = time.monotonic()  # @t=S counts from here: a slow start does not move a fault
        now_train = time.monotonic() - self.train_t0 if self.train_t0 is not None else -1.0
        for place, c in list(self.chaos):  # one not yet due does not hold back another that is
            if not self.due(place, c, done, now_train):
                continue
            self.chaos.remove((place, c))
            self.fired_at[place] = time.monotonic()
            ev = {"kind": c.action, "target": c.target, "step": self.max_step, "t_s": round(now, 2),
                  "t_unix": round(time.time(), 3)}
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
                errors = set_link_factor([p.info["data_url"] for p in peers], c.regions, c.factor,
                                         getattr(self.args, "operator_identity", ""))
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
        """An event is recovered once a newer epoch runs past the step the swarm had reached; a kill of
        a peer outside the map in force (a spare, a relay) once that map's peers do."""
        for ev in list(self.pending_recovery):
            before = self.plans.get(ev["epoch_before"])
            outside = ev["kind"] == "kill" and before is not None and \
                all(ev["target"] not in s["peers"] for s in before["stages"])
            newer = [st for _, st in sts if (st.get("train") or {}).get("plan")
                     and st["train"]["plan"]["epoch"] >= ev["epoch_before"] + (not outside)
                     and st["state"] in ("training", "done")]
            if newer and self._past(newer, ev):
                ev["recovery_s"] = round(time.monotonic() - self.t0 - ev["t_s"], 2)
                self.pending_recovery.remove(ev)
                self.say(f"recovered from {ev['kind']} {ev['target']} in {ev['recovery_s']}s")

    @staticmethod
    def _past(newer: list[dict], ev: dict) -> bool:
        """Whether the peers of a newer epoch have trained past the data step the swarm had reached at
        ``ev``: every peer's step, or with islands (whose steps count their own, each island on data
        steps of its own) every peer's latest data step in its epoch."""
        if any(st["train"].get("island") is not None for st in newer):
            return all(any(row[0] > ev["step"] for row in st["train"].get("recent_steps") or ()
                           if isinstance(row, list) and len(row) == 4 and row[3] == st["train"]["plan"]["epoch"])
                       for st in newer)
        return min(st["train"]["step"] for st in newer) > ev["step"]

    def follow(self) -> dict:
        display = ProgressDisplay(self.args.steps, self.say)
        say, self.say = self.say, display.note  # plans and events print above a live bar
        try:
            return self._follow(display)
        finally:
            display.close()
            self.say = say

    def _until_next_poll(self, done: int, most_s: float = 1.0, least_s: float = 0.1) -> float:
        """Seconds to the next poll of a quiet run: ``most_s``, or sooner where the steps seen so far
        say the last one ends sooner (its end was seen up to a whole poll late: half a second of
        every run, on average)."""
        now = time.monotonic()
        seen, self._last_seen = self._last_seen, (now, done)
        steps = getattr(self.args, "steps", None)
        if seen is None or done <= seen[1] or steps is None:
            return most_s
        left_s = (steps - done) * (now - seen[0]) / (done - seen[1])
        return min(most_s, max(least_s, left_s))

    def _follow(self, display: ProgressDisplay) -> dict:
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
            pending = [c for _, c in self.chaos if c.action in ("kill", "join")]
            finished = bool(current) and not pending and all(st["state"] == "done" for _, st in current) and \
                all(st["state"] != "recovering" for _, st in sts)
            curve = self.loss_curve()
            done = min((st["train"]["step"] for _, st in current), default=0)
            if any(st["train"].get("island") is not None for _, st in current):
                done = len(curve)  # islands: each counts its own steps; the data steps trained so far
            if self.plans:
                display.started()
            # the swarm's tokens/s: the first stage's peers between them carry every sample
            tps = [st["train"].get("tokens_per_s") for _, st in current if st["train"].get("stage") == 0]
            display.update(done, curve[-1] if curve else None, sum(t for t in tps if t) * self.k or None, newest,
                           finished)
            if finished:
                return {"statuses": sts}
            # each poll asks every peer for its status: on a shared machine that is CPU the training
            # peers miss, so poll often only while a chaos event, recovery or re-plan is being timed
            busy = self.chaos or self.pending_recovery or self.pending_replan
            time.sleep(0.3 if busy else self._until_next_poll(done))


def keep(run_dir: str, folder: str, name: str, d: dict) -> None:
    """Saves a peer's page in the run folder (``spantrain report`` draws from them)."""
    os.makedirs(os.path.join(run_dir, folder), exist_ok=True)
    with open(os.path.join(run_dir, folder, f"{name}.json"), "w") as f:
        json.dump(d, f)


def train_and_report(procs: list["PeerProcess"], args, say, chaos=(), launch_peer=None, scenario=None) -> dict:
    """Follows training until every stage of the newest epoch is done; returns the run summary."""
    predict.prefetch()
    follower = RunFollower(procs, args, say, list(chaos), launch_peer,
                           scenario.time_dilation if scenario is not None else 1.0)
    follower.follow()
    reports = []
    for p in follower.live():
        try:
            # a done peer answers at once, but a loaded box can hold it past a status call's 5 s
            reports.append(p.status(timeout=30, path="/report"))
            follower.add_losses(p.name, reports[-1].get("loss_sums") or [])
            keep(p.run_dir, "reports", p.name, reports[-1])
            keep(p.run_dir, "measurements", p.name, p.status(timeout=30, path="/measurements"))
        except OSError:
            continue
    seq = args.workload_seq_len if getattr(args, "workload", None) else args.seq_len  # a workload's tokens
    summary = summarize(reports, args.micro_batches * args.micro_batch_size, seq)
    summary["losses"] = follower.loss_curve()
    epochs = sorted(follower.plans)
    moves = 0
    for a, b in zip(epochs, epochs[1:]):
        old = {tuple(s["layers"]): sorted(s["peers"]) for s in follower.plans[a]["stages"]}
        new = {tuple(s["layers"]): sorted(s["peers"]) for s in follower.plans[b]["stages"]}
        moves += sum(1 for k, v in new.items() if old.get(k) != v)
    summary["samples_per_step"] = args.micro_batches * args.micro_batch_size
    summary["seq_len"] = seq
    summary.update(figures(summary, reports, scenario))
    summary.update(predict.configured(summary.get("plan"), next((r["job"] for r in reports if r.get("job")), None),
                                      scenario, next((r["model_profile"] for r in reports if r.get("model_profile")), None)))
    summary.update(predict.rates(summary))
    summary["epochs"] = epoch_figures(reports, follower.plans, summary["samples_per_step"])
    summary.update({"replans": max(0, len(epochs) - 1), "stage_moves": moves,
                    "lost_steps": max(0, args.steps - len(summary["losses"])), "events": follower.events,
                    "plans": [follower.plans[e] for e in epochs]})
    return summary
