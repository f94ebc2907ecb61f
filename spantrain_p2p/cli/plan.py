"""``spantrain plan``: plan a swarm offline and compare with the baselines.

    spantrain plan --scenario peers/cee-3region.toml [--measurements FILE.json] [--json]
    spantrain plan --synthetic-peers 1000 --regions 10 [--seed S] [--json]

Plans with the planner (``plan.planner``), predicts with the cost model (``plan.cost``), and
reports the step times of the discrete-event simulator (``sim``) for the plan and for the
baselines. ``plan_seconds`` is the planner's own time (grouping + search + evaluation).
With ``--json`` the last line of stdout is one JSON object; otherwise a table.

A scenario's devices count at their own speed (``tflops``, as ``--measure-only`` reports them);
``--emulated`` plans for the speed its emulated peers really run at (``tflops x compute_scale``).

The model planned for is GPT-like (``--model-dim/--model-depth/--seq-len/--vocab``); with none
of those flags, the largest of GPT-1.3B (d=2048, 24 blocks), GPT-350M (d=1024, 24 blocks) and
GPT-125M (d=768, 12 blocks) at T=1024 that the swarm can hold.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Optional

MODEL_LADDER = (  # (dim, depth, heads): GPT-3 XL, Medium, Small shapes
    (2048, 24, 16),
    (1024, 24, 16),
    (768, 12, 12),
)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``spantrain plan`` (for ``spantrain_p2p.cli.main`` to add to its subparser)."""
    src = p.add_argument_group("swarm to plan (one of)")
    src.add_argument("--scenario", metavar="FILE", help="scenario file, e.g. peers/cee-3region.toml")
    src.add_argument("--measurements", metavar="FILE.json",
                     help="measured links and devices (the JSON of `spantrain swarm --measure-only --json`)")
    src.add_argument("--synthetic-peers", type=int, metavar="N", help="plan a generated swarm of N peers")
    src.add_argument("--regions", type=int, default=10, help="regions of the synthetic swarm (default: %(default)s)")
    src.add_argument("--seed", type=int, default=0, help="seed of the synthetic swarm and of link jitter")
    src.add_argument("--emulated", action="store_true",
                     help="plan a scenario at the speed its emulated peers run here (tflops x compute_scale); "
                     "default: the devices' own speed, the units the profiler reports")
    mod = p.add_argument_group("model (default: the largest GPT of 1.3B / 350M / 125M that fits)")
    mod.add_argument("--workload", metavar="NAME", help="a transformers model to plan: hf:PRESET (gpt2 … gpt2-xl, "
                     "llama-7b, …) or hf:DIR (its config.json); planned at --seq-len in bf16")
    mod.add_argument("--model-dim", type=int, metavar="D")
    mod.add_argument("--model-depth", type=int, metavar="L", help="transformer blocks")
    mod.add_argument("--model-heads", type=int, metavar="H")
    mod.add_argument("--seq-len", type=int, default=1024, metavar="T")
    mod.add_argument("--vocab", type=int, default=32000)
    run = p.add_argument_group("training step")
    run.add_argument("--global-batch", type=int, metavar="G",
                     help="samples per step (default: 256; synthetic swarms: 2048)")
    run.add_argument("--micro-batch-sizes", default="1,2,4,8", metavar="LIST",
                     help="candidate micro-batch sizes (default: %(default)s)")
    run.add_argument("--schedules", default="zb-h1,1f1b,gpipe", metavar="LIST")
    run.add_argument("--compressions", default="none,fp16,int8", metavar="LIST",
                     help="allowed on activation hops, e.g. none,fp16,int8,topk:0.1 (default: %(default)s)")
    run.add_argument("--recompute", default="auto", choices=("auto", "none", "full"),
                     help="activation recomputation: auto (on the stages whose peers cannot hold their activations "
                     "otherwise; each stage says), none, or full on every stage (default: auto)")
    run.add_argument("--shard-optimizer", default="none", choices=("auto", "none", "full"),
                     help="optimizer state of replicated stages sharded across their replicas (ZeRO-1): auto (where "
                     "their peers cannot hold it otherwise, inside a fast group), none, or full (default: none, as a "
                     "run with the default --aggregate robust plans; auto is what a run with --aggregate sum plans)")
    run.add_argument("--no-jitter", action="store_true", help="simulate links without their delay jitter")
    run.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line of stdout")


def _csv(text: str, name: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(f"--{name} needs at least one value")
    return items


def _snapshot(args: argparse.Namespace) -> tuple[Any, str]:
    from ..plan.synthetic import synthetic_swarm
    from ..plan.types import Snapshot

    given = [x for x in ("scenario", "measurements", "synthetic_peers") if getattr(args, x, None) is not None]
    if not given:
        raise ValueError("give --scenario FILE, --measurements FILE.json or --synthetic-peers N")
    if args.synthetic_peers is not None:
        if len(given) > 1:
            raise ValueError("--synthetic-peers cannot be combined with --scenario or --measurements")
        if args.synthetic_peers < 1:
            raise ValueError("--synthetic-peers must be >= 1")
        return synthetic_swarm(args.synthetic_peers, args.regions, args.seed), \
            f"synthetic {args.synthetic_peers} peers / {args.regions} regions (seed {args.seed})"
    if args.measurements:
        try:
            with open(args.measurements) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"measurements file {args.measurements} not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.measurements}: not valid JSON: {e}") from None
        return Snapshot.from_measurements(data), f"measurements {args.measurements}"
    from .. import scenario

    sc = scenario.load(args.scenario)
    emulated = getattr(args, "emulated", False)
    return Snapshot.from_scenario(sc, emulated=emulated), f"scenario {sc.name}" + (" (emulated speed)" if emulated else "")


def ladder_configs(**kwargs: Any) -> list[Any]:
    """The models `spantrain plan` tries by default, largest first (``kwargs``: seq_len, vocab)."""
    from ..plan.types import default_planning_model

    return [default_planning_model(dim=d, depth=l, heads=h, **kwargs) for d, l, h in MODEL_LADDER]


def _model_configs(args: argparse.Namespace) -> list[Any]:
    from ..plan.types import default_planning_model

    if args.model_dim is None and args.model_depth is None and args.model_heads is None:
        return ladder_configs(seq_len=args.seq_len, vocab=args.vocab)
    dim = args.model_dim or 2048
    heads = args.model_heads or max(1, dim // 128)
    if dim % heads:
        heads = 1
    return [default_planning_model(dim=dim, depth=args.model_depth or 24, heads=heads, seq_len=args.seq_len,
                                   vocab=args.vocab)]


def _workload(args: argparse.Namespace) -> tuple[Any, dict]:
    """(the planner's profile of ``--workload``, what the output says of it). Weights and
    activations in bf16 (2 bytes), the optimizer in fp32, as a GPU run would train it (the live
    swarm's ``--workload`` is profiled by the same function)."""
    from ..models.hf_model import HFModel, is_hf
    from ..models.workload import facts, profile_of

    if not is_hf(args.workload):
        raise ValueError(f"--workload {args.workload!r}: name a transformers model, hf:PRESET or hf:DIR")
    return profile_of(args.workload, args.seq_len), {
        **facts(args.workload, args.seq_len), "model_type": HFModel(args.workload, {}, 0, args.seq_len).model_type}


def _fmt(x: Optional[float], unit: str = "", digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}{unit}"


ISLANDS_MAX_PEERS = 200  # as the planner's own per-group planning (plan.planner.REGIONS_MAX_PEERS)


def _islands(snapshot, profile, opts, result, links, best) -> tuple[Optional[dict], dict]:
    """What ``--sync islands`` and ``--sync auto`` would run here, as ``spantrain swarm`` plans them
    (``plan.islands``): the islands' figures (None where fewer than two groups hold the model), and
    auto's pick with its reason."""
    from ..plan import islands
    from ..plan.planner import plan

    if len(snapshot.peers) > ISLANDS_MAX_PEERS:
        return None, {"pick": "global", "why": f"islands not planned beyond {ISLANDS_MAX_PEERS} peers here"}
    try:
        isl = islands.plan_islands(snapshot, profile, [g.peers for g in result.grouping.groups], links,
                                   lambda region: plan(region, profile, opts, regions=False).plan)
    except ValueError:
        isl = None
    pick, why = islands.choose(best if math.isfinite(best.step_s) else None, isl, "auto")
    figures = None
    if isl is not None:
        figures = {**isl.figures(), "plans": [{"peers": sorted(p.peers()), "schedule": p.schedule,
                                              "step_s": round(p.step_s, 6),
                                              "stages": [st.to_dict() for st in p.stages]} for p in isl.islands]}
    return figures, {"pick": pick, "why": why}


def run_plan(args: argparse.Namespace) -> dict:
    """Everything ``spantrain plan`` prints, as a dict (raises ValueError on bad input)."""
    from ..sim import simulate
    from ..plan.model import num_params
    from ..plan.layout import LinkTable
    from ..plan.planner import PlannerOptions, baselines, plan, plan_largest
    from ..plan.types import compression_ratio

    snapshot, source = _snapshot(args)
    g = args.global_batch or (2048 if args.synthetic_peers is not None else 256)
    if g < 1:
        raise ValueError("--global-batch must be >= 1")
    sizes = tuple(int(x) for x in _csv(args.micro_batch_sizes, "micro-batch-sizes"))
    if any(b < 1 for b in sizes):
        raise ValueError("--micro-batch-sizes must be positive")
    comps = _csv(args.compressions, "compressions")
    for c in comps:
        compression_ratio(c)
    opts = PlannerOptions(global_batch=g, micro_batch_sizes=sizes, schedules=_csv(args.schedules, "schedules"),
                          compressions=comps, recompute=args.recompute, shard=args.shard_optimizer)
    if args.workload:
        profile, model = _workload(args)
        result = plan(snapshot, profile, opts)
    else:
        cfg, profile, result = plan_largest(snapshot, _model_configs(args), opts)
        model = {**cfg.to_dict(), "params": num_params(cfg), "layers": profile.num_layers, "name": profile.name}
    links = LinkTable(snapshot, result.grouping.group_of())
    jitter = not args.no_jitter

    def simulated(p: Any) -> Any:
        from dataclasses import replace

        if not math.isfinite(p.step_s):
            return p  # does not fit: nothing to run
        sim = simulate(p, snapshot, profile, links, jitter=jitter, seed=args.seed)
        return replace(p, simulated_step_s=sim.step_s)

    best = simulated(result.plan)
    out: dict[str, Any] = {
        "plan_seconds": round(result.seconds, 4),
        "source": source,
        "peers": len(snapshot.peers),
        "model": model,
        "global_batch": g,
        "grouping": {"digest": result.grouping.digest(), "groups": len(result.grouping.groups),
                     "sizes": [len(x.peers) for x in result.grouping.groups]},
        "planner": best.to_dict(),
        "baselines": {},
    }
    out["planner"]["peers_used"] = len(best.peers())
    if math.isfinite(best.step_s):  # each peer's memory as the cost model holds it, beside its device's
        from ..plan.levers import predicted_peaks

        out["planner"]["memory"] = {p: {"peak_bytes": round(v["peak"]), "device_bytes": round(snapshot.peer(p).memory_bytes)}
                                    for p, v in predicted_peaks(best, profile).items()}
    out["islands"], out["sync_auto"] = _islands(snapshot, profile, opts, result, links, best)
    if args.workload:
        out["workload"] = model
    # the aggregate-compute bound: every peer's FLOP/s on the model, used or not (the physical limit)
    per_sample = sum(x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in profile.layers)
    agg = sum(p.flops for p in snapshot.peers) / per_sample
    out["aggregate_bound_samples_per_s"] = round(agg, 4)
    if out["planner"].get("samples_per_s"):
        out["planner"]["of_aggregate_bound"] = round(out["planner"]["samples_per_s"] / agg, 4)
    if not args.no_baselines:
        for name, bp in baselines(snapshot, profile, opts, links).items():
            bp = simulated(bp)
            d = bp.to_dict()
            out["baselines"][name] = {k: d[k] for k in ("samples_per_s", "step_s", "predicted_step_s", "bottleneck",
                                                        "schedule", "micro_batch_size", "stages")}
        rates = [v["samples_per_s"] for v in out["baselines"].values() if v["samples_per_s"]]
        if rates and out["planner"]["samples_per_s"]:
            out["speedup_vs_best_baseline"] = round(out["planner"]["samples_per_s"] / max(rates), 3)
    return out


def _table(out: dict) -> str:
    lines = [f"{out['source']}: {out['peers']} peers in {out['grouping']['groups']} network groups "
             f"(digest {out['grouping']['digest'][:12]}); model {out['model']['name']}; "
             f"global batch {out['global_batch']}",
             f"planned in {out['plan_seconds']:.3f} s", ""]
    pl = out["planner"]
    lines.append(f"planner: {pl['schedule']}, micro-batch {pl['micro_batch_size']} x {pl['num_micro_batches']}, "
                 f"bottleneck {pl['bottleneck']}")
    for i, st in enumerate(pl["stages"]):
        share = ", ".join(f"{p} {s:.2f}" for p, s in st["microbatch_share"].items())
        comp = f"  -> {pl['compression'][i]}" if i < len(pl["compression"]) else ""
        lever = ("  recompute" if st.get("recompute", "none") != "none" else "") + \
            ("  sharded optimizer" if st.get("shard") else "")
        mem = pl.get("memory") or {}
        peaks = ", ".join(f"{mem[p]['peak_bytes'] / 2**30:.1f}/{mem[p]['device_bytes'] / 2**30:.1f} GiB"
                          for p in st["microbatch_share"] if p in mem)
        lines.append(f"  stage {i}: layers {st['layers'][0]:>3}-{st['layers'][1] - 1:<3} {share}{comp}{lever}"
                     + (f"  (memory {peaks})" if peaks else ""))
    lines.append("")
    lines.append(f"{'':16}{'samples/s':>11}{'step (sim)':>13}{'step (model)':>14}  bottleneck")
    rows = [("planner", pl)] + list(out["baselines"].items())
    for name, r in rows:
        lines.append(f"{name:16}{_fmt(r['samples_per_s'], '', 4):>11}{_fmt(r['step_s'], ' s', 5):>13}"
                     f"{_fmt(r['predicted_step_s'], ' s', 5):>14}  {r['bottleneck']}")
    if "speedup_vs_best_baseline" in out:
        lines.append(f"\nplanner vs best baseline: {out['speedup_vs_best_baseline']:.2f}x samples/s")
    return "\n".join(lines)


def plan_command(args: argparse.Namespace) -> int:
    """``spantrain plan``: 0 on success, 1 (message on stderr) on bad input or no feasible plan."""
    from ..scenario import ScenarioError

    try:
        t0 = time.perf_counter()
        out = run_plan(args)
        out["total_seconds"] = round(time.perf_counter() - t0, 3)
    except (ValueError, ScenarioError) as e:
        print(f"spantrain plan: error: {e}", file=sys.stderr, flush=True)
        return 1
    if args.json:
        print(json.dumps(out, allow_nan=False), flush=True)
    else:
        print(_table(out), flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Stand-alone entry point (``python -m spantrain_p2p.cli.plan``); ``spantrain plan`` is the same."""
    p = argparse.ArgumentParser(prog="spantrain plan", description="plan a swarm offline")
    add_plan_arguments(p)
    return plan_command(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
