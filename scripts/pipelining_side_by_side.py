"""This project's pipeline against torch.distributed.pipelining on the same job, back to back (issue 31).

The job, the same on both sides: the built-in byte-level GPT (``--model transformer``, dim 128, 8
blocks, 4 heads, vocab 256: 10 layers, embedding + 8 blocks + head), sequence 64, 8 micro-batches of
8 a step, fp32, Adam at lr 1e-3, the generated corpus, seed 0. Both sides build their layers with
the project's own builder (``ModelHandle.build``: layer ``i`` seeded from ``(seed, i)``, so the
initial weights are equal), take micro-batch ``m`` of step ``s`` from ``open_data(job).batch(s, m)``,
compute the head's mean cross-entropy per micro-batch with gradients scaled by 1/8 (ours scales the
loss before its backward, torch's ``scale_grads`` the gradients after), and step
``make_optimizer(job)`` (Adam, torch's fused kernel on the CPU: ``job.optim.adam_kernel``) over
each process's own parameters.

Theirs: four processes forked from this one, one thread each (``torch.set_num_threads(1)``, as a
peer does), over gloo on 127.0.0.1, each holding ``PipelineStage``s of the layer ranges
``even_split`` gives (what ``--plan even`` uses). The last stage's module returns the head's logits
and torch's ``loss_fn`` takes the cross-entropy (the same arithmetic as ``LMHead.forward``).

- ``1f1b``: ours ``--schedule 1f1b`` against ``Schedule1F1B``: 4 stages, one a process, layers
  [0,3) [3,6) [6,8) [8,10) on both sides.
- ``zb``: ours ``--schedule zb-h1`` against two of torch's zero-bubble schedules, one pair each:
  ``ScheduleInterleavedZeroBubble`` with one stage a process (ZB1P, the paper's ZB-H1; the same 4
  stages as ours), and ``ScheduleZBVZeroBubble``, which needs exactly two stages a process: the
  model is cut in 8 (``even_split(10, 8)``) and process r holds stages r and 7 - r (the V), so it
  computes layers {0,1,9}, {2,3,8}, {4,7}, {5,6}: the same number of layers a process as our 4
  stages (3, 3, 2, 2), not the same layers.

Ours: ``spantrain swarm`` with ``--plan even --stages 4 --schedule 1f1b|zb-h1 --precision fp32
--compression none --aggregate sum --verify 0 --recompute none --lanes`` (``--no-lanes``: without
``--lanes``, each tensor through the peers' event loops) on a scenario this script writes to
a temporary folder: four peers on one link class as fast as loopback (0.01 ms, 100 Gbit/s: the
emulator adds next to nothing, as gloo on 127.0.0.1 has nothing added) and a virtual device so fast
(1e6 TFLOP/s) that no op is ever held: compute runs at the CPU's own pace, nothing padded (the
scenarios in ``peers/`` all pad, and there is no flag for unpadded compute). The launcher warns
that such a device outruns a CPU; that is the point here, and its ``fidelity`` means nothing.
The four peers share one ``host`` in the scenario, as four processes of this machine do: their
connections stay on it and are not encrypted (``net.handshake``; gloo's are not either), where a
scenario's peers are otherwise machines of their own, whose connections are. ``--encrypted`` runs
ours that way (as four machines of one site would connect: encrypted, where gloo's are not).

samples/s, the same rule on both sides: each step's end is the latest of its processes' ends
(after the optimizer step; ours from the peers' reports, ``step_times``); the steps after
``--warmup`` are timed from the end of the last warm-up step to the end of the last step:
``(steps - warmup) x 64 / that time``. Our run summary's own ``samples_per_s`` (a step over the
median gap between step ends) is kept beside it in the JSON. A pair runs both sides back to back,
alternating which goes first; ``ratio`` = ours / theirs; the loss difference is the largest
``|ours - theirs| / |theirs|`` over the steps of the pair. With ``--pairs N`` the median ratio of
each comparison is printed last.

Where the two share a host's cores, each pair also prints (Linux) how long a step's compute waited,
runnable, for a core on the side's most waiting process: ours the compute thread's
(``compute_core_wait_s`` of the run summary's breakdown), theirs the one thread that computes and
drives gloo (its wait over the step, the median after the warm-up). More work beside the compute on
the same cores (our event loops, gloo's threads) shows there. And each pair prints the CPU a step
took on each side, summed over its processes (whole runs): ours split into the compute threads, the
rest of the peers' threads (their event loops: the data plane, the schedule's hand-offs, the control
plane) and the p2p daemons; theirs into the computing threads and the rest (gloo's). Where every
core is busy, as here, a step takes about its side's CPU over the cores. Ours also prints its hops
(``train.hop_times``, over the last steps the peers' reports keep): how long a tensor took to a stage
already waiting for it, and a step's wall time with at most one stage computing (a core idle, on two).

    .venv/bin/python scripts/pipelining_side_by_side.py --pairs 3
    .venv/bin/python scripts/pipelining_side_by_side.py --pairs 1 --steps 15 --schedules 1f1b --json

Run it on an idle machine: four processes a side on this 2-core box share its cores.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from spantrain_p2p.job.dataset import open_data
from spantrain_p2p.job.optim import make_optimizer
from spantrain_p2p.job.spec import JobSpec, ModelHandle
from spantrain_p2p.osproc import core_wait_s
from spantrain_p2p.plan.stagemap import even_split
from spantrain_p2p.train.hop_times import PARTS as HOP_PARTS, hop_times

MODEL_ARGS = {"dim": 128, "depth": 8, "heads": 4, "vocab": 256}
SEQ_LEN, MICRO_BATCH_SIZE, MICRO_BATCHES, PROCESSES = 64, 8, 8, 4
SAMPLES_PER_STEP = MICRO_BATCH_SIZE * MICRO_BATCHES

# --schedules name -> [(our --schedule, torch's schedule class, its stages a process)]
COMPARISONS = {
    "1f1b": [("1f1b", "Schedule1F1B", 1)],
    "zb": [("zb-h1", "ScheduleInterleavedZeroBubble", 1), ("zb-h1", "ScheduleZBVZeroBubble", 2)],
}

SCENARIO = """\
name = "unpadded-4"
description = "4 peers of this machine on loopback-fast links, compute not padded"
compute_scale = 1.0

[link_classes.loopback]
rtt_ms = 0.01
mbps = 100000

[device_classes.unpadded]
tflops = 1000000
memory_gb = 64

[regions.local]
link = "loopback"
""" + "".join(f'\n[[peers]]\nname = "p{i}"\nregion = "local"\ndevice = "unpadded"\nhost = "this"\n'
            for i in range(PROCESSES))
# --encrypted: the same peers as machines of their own (the scenario gives them no host)
SCENARIO_APART = SCENARIO.replace('host = "this"\n', "")


def make_job(steps: int) -> JobSpec:
    """The job both sides train (the fields the swarm's flags set; the rest are JobSpec's defaults)."""
    return JobSpec(model_args=dict(MODEL_ARGS), seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH_SIZE,
                   num_micro_batches=MICRO_BATCHES, steps=steps, precision="fp32", compression="none",
                   aggregate="sum", verify=0.0, plan="even", stages=PROCESSES)


def throughput(ends: list[float], warmup: int) -> float:
    """samples/s over the steps after ``warmup``: from the end of the last warm-up step to the last end."""
    if len(ends) <= warmup or warmup < 1:
        raise ValueError(f"need more steps than --warmup {warmup} (>= 1), got {len(ends)}")
    return (len(ends) - warmup) * SAMPLES_PER_STEP / (ends[-1] - ends[warmup - 1])


def max_rel_diff(ours: list[float], theirs: list[float]) -> float:
    if len(ours) != len(theirs):
        raise ValueError(f"the two runs reported {len(ours)} and {len(theirs)} losses")
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))


# ---- theirs: torch.distributed.pipelining ---------------------------------------------------------

class StageModule(nn.Module):
    """A contiguous run of the project's layers as one module; on the last stage it ends in the
    head's logits, since torch's schedules take the loss from ``loss_fn(output, target)``."""

    def __init__(self, layers: list[nn.Module], last: bool):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1] if self.last else self.layers:
            x = layer(x)
        return self.layers[-1].logits(x) if self.last else x


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``LMHead.forward``'s loss on its logits: the micro-batch's mean cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def file_store(folder: str) -> str:
    """gloo's rendezvous in a file of ``folder``, not over TCP: a TCPStore names each connection's
    far end with getnameinfo, which asked the host's resolver for 127.0.0.1's name (a dual-stack
    socket's ::ffff:127.0.0.1, not in /etc/hosts): 10-11 DNS queries a run, beyond the loopback
    these runs keep to."""
    return f"file://{os.path.join(folder, 'store')}"


def torch_rank(rank: int, schedule: str, per_process: int, steps: int, out_dir: str) -> None:
    """One process of torch's pipeline: its stages, ``steps`` steps, then its step ends (wall clock)
    and, on the process with the last stage, the step losses, written to ``out_dir``."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=file_store(out_dir), rank=rank, world_size=PROCESSES)
    job = make_job(steps)
    handle = ModelHandle(job)
    n = PROCESSES * per_process
    ranges = even_split(handle.num_layers, n)
    mine = [rank] if per_process == 1 else [rank, n - 1 - rank]  # ZBV's V: stages r and n-1-r
    stages = [pipelining.PipelineStage(StageModule(handle.build(*ranges[s]), s == n - 1), s, n, torch.device("cpu"))
              for s in mine]
    opt = make_optimizer(job, [p for st in stages for p in st.submod.parameters()])
    cls = getattr(pipelining, schedule)
    single = issubclass(cls, PipelineScheduleSingle)  # 1F1B takes its one stage, the others a list
    sched = cls(stages[0] if single else stages, n_microbatches=MICRO_BATCHES, loss_fn=cross_entropy)
    first, last = 0 in mine, n - 1 in mine
    batch = open_data(job).batch
    ends, losses, waits = [], [], []
    cpu0 = time.thread_time(), time.process_time()  # the computing thread's, the whole process's
    for step in range(steps):
        w0 = core_wait_s()
        parts = [batch(step, m) for m in range(MICRO_BATCHES)] if first or last else []
        args = (torch.cat([x for x, _ in parts]),) if first else ()
        mb_losses: list = []
        sched.step(*args, target=torch.cat([y for _, y in parts]) if last else None,
                   losses=mb_losses if last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.time())
        w1 = core_wait_s()
        waits.append(None if w0 is None or w1 is None else w1 - w0)
        if last:
            losses.append(sum(float(x.detach()) for x in mb_losses) / len(mb_losses))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ends": ends, "losses": losses if last else None, "core_waits": waits,
                   "cpu_main_s": time.thread_time() - cpu0[0], "cpu_process_s": time.process_time() - cpu0[1]}, f)
    dist.destroy_process_group()


def run_theirs(schedule: str, per_process: int, steps: int, warmup: int, tmp: str) -> dict:
    out = tempfile.mkdtemp(prefix=f"{schedule}-", dir=tmp)
    # forked, not spawned: the children inherit the imported torch (seconds of CPU each on this box)
    mp.start_processes(torch_rank, args=(schedule, per_process, steps, out), nprocs=PROCESSES,
                       start_method="fork")
    ranks = []
    for path in sorted(glob.glob(os.path.join(out, "rank*.json"))):
        with open(path) as f:
            ranks.append(json.load(f))
    ends = [max(r["ends"][s] for r in ranks) for s in range(steps)]
    losses = next(r["losses"] for r in ranks if r["losses"] is not None)
    # the process whose thread waited longest for a core, its median a step after the warm-up
    waits = [[w for w in r["core_waits"][warmup:] if w is not None] for r in ranks]
    core_wait = max((statistics.median(w) for w in waits if w), default=None)
    main, proc = sum(r["cpu_main_s"] for r in ranks), sum(r["cpu_process_s"] for r in ranks)
    cpu = {"compute": main / steps, "threads": (proc - main) / steps}  # (gloo's among the threads)
    return {"samples_per_s": round(throughput(ends, warmup), 3), "losses": losses, "core_wait_s": core_wait,
            "cpu_s_per_step": cpu}


# ---- ours: spantrain swarm ------------------------------------------------------------------------

def ours_argv(schedule: str, steps: int, scenario: str, lanes: bool = True) -> list[str]:
    """``spantrain swarm``'s arguments for our side of the job (also ``scripts/loop_cpu.py``'s)."""
    model_args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    return ["swarm", "--scenario", scenario, "--steps", str(steps), "--plan", "even", "--stages", str(PROCESSES),
            "--schedule", schedule, "--model", "transformer", *model_args, "--seq-len", str(SEQ_LEN),
            "--micro-batch-size", str(MICRO_BATCH_SIZE), "--micro-batches", str(MICRO_BATCHES),
            "--precision", "fp32", "--compression", "none", "--aggregate", "sum", "--verify", "0",
            "--recompute", "none", *(["--lanes"] if lanes else [])]


def run_ours(schedule: str, steps: int, warmup: int, tmp: str, scenario: str, lanes: bool = True) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"swarm-{schedule}-", dir=tmp)
    cmd = [sys.executable, "-m", "spantrain_p2p", *ours_argv(schedule, steps, scenario, lanes), "--run-dir", run_dir,
           "--json"]
    with open(os.path.join(run_dir, "launcher.log"), "w") as log:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=120 + 10 * steps)
    if done.returncode != 0:
        with open(os.path.join(run_dir, "launcher.log")) as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"spantrain swarm exited {done.returncode}:\n{tail}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    ends: dict[int, float] = {}
    cpu = {"compute": 0.0, "threads": 0.0, "daemons": 0.0}  # from each peer's training start to its report
    timelines: dict[int, list[dict]] = {}  # per stage, its peer's last steps (for the hops)
    for path in glob.glob(os.path.join(run_dir, "reports", "*.json")):
        with open(path) as f:
            report = json.load(f)
        c = report.get("cpu") or {}
        cpu["compute"] += c.get("training_threads_cpu_s") or 0.0
        cpu["threads"] += c.get("background_cpu_s") or 0.0  # the event loop's among them
        cpu["daemons"] += c.get("daemon_cpu_s") or 0.0
        if report.get("stage") is not None and report.get("timelines"):
            timelines[report["stage"]] = report["timelines"]
        for step, _t0, t1, *_ in report.get("step_times") or []:
            ends[step] = max(ends.get(step, 0.0), t1)
    if sorted(ends) != list(range(steps)):
        raise RuntimeError(f"the swarm's reports time steps {sorted(ends)}, not 0..{steps - 1} (a re-plan?)")
    waits = [p["breakdown"]["compute_core_wait_s"] for p in summary.get("peers", [])
             if "compute_core_wait_s" in (p.get("breakdown") or {})]
    return {"samples_per_s": round(throughput([ends[s] for s in range(steps)], warmup), 3),
            "summary_samples_per_s": summary["samples_per_s"], "losses": summary["losses"],
            "core_wait_s": max(waits, default=None), "cpu_s_per_step": {k: v / steps for k, v in cpu.items()},
            "hops": hop_times(timelines) if len(timelines) > 1 else None}


# ---- the comparison -------------------------------------------------------------------------------

def one_pair(ours_schedule: str, theirs: str, per_process: int, args, k: int, tmp: str, scenario: str) -> dict:
    """Both sides back to back; the even pairs run ours first, the odd ones theirs."""
    def run_o():
        return run_ours(ours_schedule, args.steps, args.warmup, tmp, scenario, not args.no_lanes)

    def run_t():
        return run_theirs(theirs, per_process, args.steps, args.warmup, tmp)

    if k % 2 == 0:
        o, t = run_o(), run_t()
    else:
        t, o = run_t(), run_o()
    return {"ours": o, "theirs": t, "ratio": round(o["samples_per_s"] / t["samples_per_s"], 3),
            "loss_max_rel_diff": max_rel_diff(o["losses"], t["losses"]), "ours_first": k % 2 == 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="back-to-back pairs per comparison (default 3)")
    p.add_argument("--steps", type=int, default=30, help="steps a run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of samples/s (default 5)")
    p.add_argument("--schedules", default="1f1b,zb", help="comma-separated: 1f1b, zb (default both)")
    p.add_argument("--json", action="store_true", help="print one JSON object, last")
    p.add_argument("--encrypted", action="store_true",
                   help="our peers stand for machines of their own: their connections are encrypted")
    p.add_argument("--no-lanes", action="store_true",
                   help="our peers without --lanes: every tensor through their event loops")
    a = p.parse_args()
    names = [s for s in a.schedules.split(",") if s]
    if not names or any(s not in COMPARISONS for s in names):
        p.error(f"--schedules takes a comma-separated list of {', '.join(COMPARISONS)}")
    if a.pairs < 1 or a.steps <= a.warmup or a.warmup < 1:
        p.error("want --pairs >= 1 and --steps > --warmup >= 1")
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    say(f"job: transformer {MODEL_ARGS}, seq {SEQ_LEN}, {MICRO_BATCHES} micro-batches of {MICRO_BATCH_SIZE}, "
        f"fp32, Adam 1e-3, {PROCESSES} processes; {a.steps} steps, samples/s after {a.warmup}; "
        f"torch {torch.__version__}")
    results = []
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as tmp:
        scenario = os.path.join(tmp, "unpadded-4.toml")
        with open(scenario, "w") as f:
            f.write(SCENARIO_APART if a.encrypted else SCENARIO)
        for name in names:
            for ours_schedule, theirs, per_process in COMPARISONS[name]:
                pairs = []
                for k in range(a.pairs):
                    r = one_pair(ours_schedule, theirs, per_process, a, k, tmp, scenario)
                    pairs.append(r)
                    o, t = r["ours"], r["theirs"]
                    say(f"{ours_schedule} vs {theirs} pair {k + 1}: ours {o['samples_per_s']:.1f} samples/s "
                        f"(summary {o['summary_samples_per_s']:.1f}), theirs {t['samples_per_s']:.1f}: "
                        f"{r['ratio']:.3f}x; losses {o['losses'][0]:.4f} -> {o['losses'][-1]:.4f}, "
                        f"largest relative difference {r['loss_max_rel_diff']:.2e}")
                    if o["core_wait_s"] is not None and t["core_wait_s"] is not None:
                        say(f"  a step's compute waited for a core, the longest of a side's processes: "
                            f"ours {o['core_wait_s'] * 1e3:.0f} ms, theirs {t['core_wait_s'] * 1e3:.0f} ms")
                    oc, tc = o["cpu_s_per_step"], t["cpu_s_per_step"]
                    say(f"  CPU a step, all processes: ours {sum(oc.values()) * 1e3:.0f} ms (compute "
                        f"{oc['compute'] * 1e3:.0f}, event loops and other threads {oc['threads'] * 1e3:.0f}, p2p daemons "
                        f"{oc['daemons'] * 1e3:.0f}), theirs {sum(tc.values()) * 1e3:.0f} ms (compute "
                        f"{tc['compute'] * 1e3:.0f}, gloo's and other threads {tc['threads'] * 1e3:.0f})")
                    h = o["hops"]
                    if h and h["count"]:
                        say(f"  ours, hops of a tensor to a stage waiting for it (last {h['steps']} steps): median "
                            f"{h['made_to_taken']['median_ms']:.2f} ms, 90th percentile {h['made_to_taken']['p90_ms']:.2f}, "
                            f"{h['made_to_taken']['per_step_ms']:.1f} ms a step ({h['made_to_send']['per_step_ms']:.1f} "
                            f"before the send began); a step with one stage computing or none: {h['single_s'] * 1e3:.0f} ms")
                        if h.get("split"):
                            say("    after the send began, ms a step: " + ", ".join(
                                f"{w} {h[k]['per_step_ms']:.1f}" for k, w in HOP_PARTS))
                results.append({"ours": ours_schedule, "theirs": theirs, "stages_per_process": per_process,
                                "pairs": pairs, "median_ratio": statistics.median(r["ratio"] for r in pairs),
                                "loss_max_rel_diff": max(r["loss_max_rel_diff"] for r in pairs)})
    for c in results:
        say(f"{c['ours']} vs {c['theirs']}: median ratio {c['median_ratio']:.3f}x over {len(c['pairs'])} pair(s), "
            f"losses within {c['loss_max_rel_diff']:.2e}")
    if a.json:
        print(json.dumps({"job": {"model": "transformer", "model_args": MODEL_ARGS, "seq_len": SEQ_LEN,
                                  "micro_batch_size": MICRO_BATCH_SIZE, "micro_batches": MICRO_BATCHES,
                                  "processes": PROCESSES, "steps": a.steps, "warmup": a.warmup, "encrypted": a.encrypted,
                                  "torch": torch.__version__},
                          "comparisons": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
