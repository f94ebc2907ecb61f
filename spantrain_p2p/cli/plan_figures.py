"""The planner's figures (issue 5's "done when"), as ``scripts/plan_figures.sh`` prints them.

    python -m spantrain_p2p.cli.plan_figures [--instances N] [--seed S]

1. throughput of the planner and the baselines on the shipped scenarios (simulated), and the
   planner's speed-up over the best baseline;
2. cost model against simulator on every plan of 1;
3. the planner (DP + local search) against exhaustive search on random small instances
   (6 peers, 8 layers), in the same cost model: with the planner's rule for a stage (one compute
   class of one network group) and with every subset of peers allowed;
4. planning time for 100, 300 and 1000 synthetic peers in 10 regions.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Optional

from .. import scenario
from ..sim import simulate
from ..plan.cost import estimate
from ..plan.layout import LinkTable
from ..plan.planner import PlannerOptions, baselines, plan, plan_largest
from ..plan.synthetic import synthetic_swarm
from ..plan.types import Link, ModelProfile, Network, PeerInfo, Snapshot, default_planning_model


def small_instance(rng: random.Random, n: int = 6, depth: int = 6) -> tuple[Snapshot, ModelProfile]:
    """``n`` peers of mixed speed (0.25-4 TFLOP/s) and memory (8-48 GB) in 1-3 regions (0.2-5 ms,
    1-10 Gbit/s inside; 20-150 ms, 20-500 Mbit/s between) and a GPT of ``depth`` blocks
    (``depth + 2`` layers), d = 1024 or 2048, T = 1024."""
    from ..plan.model import ModelConfig

    regions = rng.randint(1, 3)
    reg = [rng.randrange(regions) for _ in range(n)]
    peers = tuple(PeerInfo(f"p{i}", rng.choice([0.25, 0.5, 1.0, 2.0, 4.0]) * 1e12 * rng.uniform(0.9, 1.1),
                           rng.choice([8e9, 16e9, 48e9]), f"r{reg[i]}") for i in range(n))
    intra = [(rng.uniform(0.2, 5) / 1e3, rng.uniform(1e9, 10e9) / 8) for _ in range(regions)]
    inter: dict = {}
    links = {}
    for i in range(n):
        for j in range(i + 1, n):
            a, b = reg[i], reg[j]
            if a == b:
                rtt, bw = intra[a]
            else:
                key = (min(a, b), max(a, b))
                if key not in inter:
                    inter[key] = (rng.uniform(20, 150) / 1e3, rng.uniform(20e6, 500e6) / 8)
                rtt, bw = inter[key]
            links[(peers[i].id, peers[j].id)] = Link(rtt * rng.uniform(0.95, 1.05), bw * rng.uniform(0.95, 1.05))
    cfg = ModelConfig(vocab=32000, dim=rng.choice([1024, 2048]), depth=depth, heads=16, seq_len=1024)
    return Snapshot(peers, Network(links)), ModelProfile.from_model_config(cfg)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def scenarios(names: list[str], global_batch: int) -> None:
    from .plan import ladder_configs

    print(f"== shipped scenarios (global batch {global_batch}; step times simulated)")
    for name in names:
        snap = Snapshot.from_scenario(scenario.load(f"peers/{name}.toml"))
        opts = PlannerOptions(global_batch=global_batch)
        _, prof, result = plan_largest(snap, ladder_configs(), opts)
        links = LinkTable(snap, result.grouping.group_of())
        rows = [("planner", result.plan)] + list(baselines(snap, prof, opts, links).items())
        print(f"{name}: {prof.name}; planned in {result.seconds:.3f} s")
        rates = {}
        for label, p in rows:
            if not math.isfinite(p.step_s):
                print(f"  {label:14} does not fit: {p.bottleneck}")
                continue
            sim = simulate(p, snap, prof, links, seed=0).step_s
            model = estimate(p, snap, prof, links).step_s
            rates[label] = p.global_batch / sim
            print(f"  {label:14} {rates[label]:8.4f} samples/s  step {sim:9.2f} s simulated, {model:9.2f} s "
                  f"cost model ({_pct(model / sim - 1)})  {p.schedule} b={p.micro_batch_size} "
                  f"{p.num_stages} stages  {p.bottleneck}")
        best = max(v for k, v in rates.items() if k != "planner")
        print(f"  speed-up over the best baseline: {rates['planner'] / best:.2f}x")


def exhaustive(instances: int, seed: int) -> None:
    print(f"== planner vs exhaustive search: {instances} random instances, 6 peers, 8 layers (seed {seed})")
    for rule, single in (("stages within one compute class of one group (the planner's rule)", True),
                         ("exhaustive over every subset of peers", False)):
        rng = random.Random(seed)
        opts = PlannerOptions(global_batch=64, micro_batch_sizes=(1, 4))
        gaps, sim_gaps, t_dp, t_ex = [], [], [], []
        for _ in range(instances):
            snap, prof = small_instance(rng)
            t0 = time.perf_counter()
            mine = plan(snap, prof, opts).plan
            t1 = time.perf_counter()
            best = plan(snap, prof, PlannerOptions(global_batch=64, micro_batch_sizes=(1, 4),
                                                   single_class_stages=single), exhaustive=True).plan
            t2 = time.perf_counter()
            t_dp.append(t1 - t0)
            t_ex.append(t2 - t1)
            gaps.append(mine.step_s / best.step_s - 1)
            links = LinkTable(snap)
            sim_gaps.append(simulate(mine, snap, prof, links, jitter=False).step_s /
                            simulate(best, snap, prof, links, jitter=False).step_s - 1)
        within = sum(g <= 0.05 for g in gaps) / len(gaps)
        print(f"  {rule}:")
        print(f"    cost model: planner/exhaustive - 1: mean {_pct(statistics.mean(gaps))}, "
              f"median {_pct(statistics.median(gaps))}, worst {_pct(max(gaps))}; within 5 %: {100 * within:.0f}%")
        print(f"    simulated : mean {_pct(statistics.mean(sim_gaps))}, worst {_pct(max(sim_gaps))}")
        print(f"    time: planner {statistics.mean(t_dp):.3f} s, exhaustive {statistics.mean(t_ex):.2f} s (means)")


def timings(sizes: list[int], regions: int, global_batch: int) -> None:
    print(f"== planning time, synthetic swarms in {regions} regions (global batch {global_batch})")
    prof = ModelProfile.from_model_config(default_planning_model())
    prev: Optional[tuple[int, float]] = None
    for n in sizes:
        snap = synthetic_swarm(n, regions, seed=0)
        result = plan(snap, prof, PlannerOptions(global_batch=global_batch))
        t = result.timings
        growth = ""
        if prev:
            nlogn = (n * math.log(n)) / (prev[0] * math.log(prev[0]))
            growth = f"  x{result.seconds / prev[1]:.2f} for N log N x{nlogn:.2f}"
        print(f"  {n:5d} peers: {result.seconds:.3f} s (grouping {t['grouping_s']:.3f}, DP {t['dp_s']:.3f}, "
              f"evaluation {t['evaluate_s']:.3f}, local search {t['local_search_s']:.3f}){growth}; "
              f"{result.plan.num_stages} stages, {len(result.plan.peers())} peers used, "
              f"predicted {result.plan.samples_per_s:.1f} samples/s")
        prev = (n, result.seconds)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="plan_figures", description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=40, help="random small instances (default: %(default)s)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--global-batch", type=int, default=256)
    a = p.parse_args(argv)
    scenarios(["cee-3region", "edge-volunteers", "lan-4"], a.global_batch)
    print()
    exhaustive(a.instances, a.seed)
    print()
    timings([100, 300, 1000], 10, 2048)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
