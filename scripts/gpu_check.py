"""Issue 14's GPU checks (scripts/gpu_check.sh): on one CUDA machine,

1. overhead: a transformers model trained in one process with plain PyTorch (``transformers_reference_run``)
   against one peer (``spantrain-peer``) running the same job: tokens/s of each and their ratio;
2. four peers on the one GPU (2 stages x 2 replicas) training a GPT-2-small-shaped model in bf16
   on a local corpus with a tokenizer trained here: tokens/s, every peer's MFU, and the losses
   against single-process training of the same job.

``--device cpu`` runs the same steps on the CPU with a tiny model: a dry run of this script on a
machine without a GPU (its figures say nothing of a GPU). Prints one JSON object at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from spantrain_p2p.launch.processes import PeerProcess, wait_until
from spantrain_p2p.job.dataset import with_data
from spantrain_p2p.job.spec import JobSpec
from spantrain_p2p.job.reference import transformers_reference_run
from spantrain_p2p.data.tokenizer import train_bpe


def run_peers(run_dir: str, job_args: list[str], device: str, n: int, timeout: float) -> list[dict]:
    """Starts ``n`` peers (the first defines the job), waits until all are done, returns their reports."""
    os.makedirs(run_dir, exist_ok=True)
    common = ["--device", device, "--no-measure", "--swarm", f"gpu-check-{os.getpid()}-{n}"]
    procs = [PeerProcess("p0", [*common, "--name", "p0", *job_args, "--peers", str(n)], run_dir).start()]
    try:
        procs[0].wait_ready(120)
        for i in range(1, n):
            procs.append(PeerProcess(f"p{i}", [*common, "--name", f"p{i}", "--join", procs[0].info["address"]],
                                     run_dir).start())
        for p in procs[1:]:
            p.wait_ready(120)

        def done():
            for p in procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.log_tail()}")
            states = [p.status()["state"] for p in procs]
            for p, state in zip(procs, states):
                if state == "failed":  # stopped (the run, or its trainer): it stays up, so say why now
                    raise RuntimeError(f"{p.name} failed:\n{p.log_tail()}")
            return all(s == "done" for s in states)
        wait_until(done, timeout, interval=1.0)
        return [p.status(path="/report", timeout=30) for p in procs]
    finally:
        for p in procs:
            p.kill()


def release_cache(device: str) -> None:
    """Gives the CUDA allocator's cached blocks back to the GPU, for the peers this process starts."""
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def last_stage_losses(reports: list[dict]) -> list[float]:
    """The step's loss: the last stage's replicas' (sum, count) of micro-batch losses, added up."""
    last = max(r["stage"] for r in reports)
    sums: dict[int, list[float]] = {}
    for r in reports:
        if r["stage"] == last:
            for step, total, count, _ in r["loss_sums"]:
                s = sums.setdefault(step, [0.0, 0])
                s[0] += total
                s[1] += count
    return [t / c for _, (t, c) in sorted(sums.items())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run with a tiny model)")
    ap.add_argument("--model", default=None, help="default: hf:gpt2 on cuda, hf:gpt2-tiny on cpu")
    ap.add_argument("--steps", type=int, default=None, help="default 30 on cuda, 8 on cpu")
    ap.add_argument("--seq-len", type=int, default=None, help="default 1024 on cuda, 32 on cpu")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="default 8 on cuda, 2 on cpu")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--vocab", type=int, default=None, help="tokenizer size (default: 8192 on cuda, 512 on cpu)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--sections", default="overhead,four,memory",
                    help="which checks, comma-separated: overhead, four (four peers), memory (levers: predicted "
                         "peak against the CUDA allocator's)")
    ap.add_argument("--memory-steps", type=int, default=6)
    ap.add_argument("--levers", default="", help="the memory section's levers, comma-separated (default: all of "
                    + ", ".join(LEVERS) + ")")
    ap.add_argument("--memory-precision", default="bf16", help="the memory check's precision (fp32, bf16, fp16)")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    gpu = a.device.startswith("cuda")
    model = a.model or ("hf:gpt2" if gpu else "hf:gpt2-tiny")
    steps = a.steps or (30 if gpu else 8)
    seq = a.seq_len or (1024 if gpu else 32)
    mbs = a.micro_batch_size or (8 if gpu else 2)
    vocab = a.vocab or (8192 if gpu else 512)
    work = tempfile.mkdtemp(prefix="gpu-check-")
    out: dict = {"device": a.device, "model": model, "steps": steps, "seq_len": seq, "micro_batch_size": mbs,
                 "micro_batches": a.micro_batches, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if gpu:
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
    tok = os.path.join(work, "tokenizer.json")
    train_bpe(a.data, vocab, tok)
    shape = ["--model", model, "--seq-len", str(seq), "--micro-batch-size", str(mbs),
             "--micro-batches", str(a.micro_batches), "--data", a.data, "--tokenizer", tok]
    tokens_per_step = seq * mbs * a.micro_batches
    skip = min(3, steps // 3)  # warm-up steps left out of the speeds

    # 1. overhead: plain PyTorch in one process against one peer, fp32 and bf16 alike here: bf16
    for precision in (("bf16",) if "overhead" in sections else ()):
        job = with_data(JobSpec(model=model, seq_len=seq, micro_batch_size=mbs, num_micro_batches=a.micro_batches,
                                steps=steps, precision=precision), a.data, tok)
        times: list[float] = []
        plain_losses, _ = transformers_reference_run(job, steps, device=a.device, step_times=times)
        release_cache(a.device)
        plain = tokens_per_step / statistics.median(times[skip:])
        reports = run_peers(os.path.join(work, "one"), ["--steps", str(steps), "--precision", precision, *shape],
                            a.device, 1, 3600)
        rows = sorted(reports[0]["step_times"])[skip:]
        # the peer's pace: the gap between step ends, so what it does between steps (its snapshot of
        # the stage's state) counts, as every line of the plain loop does; ``in_step``: within a step
        gaps = [b[2] - a[2] for a, b in zip(rows, rows[1:])]
        peer = tokens_per_step / statistics.median(gaps)
        in_step = tokens_per_step / statistics.median(e - s for _, s, e, _ in rows)
        out["overhead"] = {"precision": precision, "plain_tokens_per_s": round(plain, 1),
                           "peer_tokens_per_s": round(peer, 1), "ratio": round(peer / plain, 4),
                           "peer_in_step_tokens_per_s": round(in_step, 1),
                           "peer_mfu": (reports[0].get("work") or {}).get("mfu"),
                           "loss_rel_err": max(abs(x - y) / y for x, y in zip(last_stage_losses(reports), plain_losses))}
        print(f"overhead ({precision}): plain PyTorch {plain:,.0f} tokens/s, one peer {peer:,.0f} tokens/s "
              f"({in_step:,.0f} within its steps), ratio {peer / plain:.3f}", file=sys.stderr, flush=True)

    if "four" in sections:
        four_peers(a, out, work, model, steps, seq, mbs, tok, shape, tokens_per_step, skip)
    if "memory" in sections:
        out["memory"] = memory_levers(a, work, shape)
    line = json.dumps(out)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


# lever -> (its flags, peers): sharding needs a stage's replicas, so its run has 2 stages x 2 replicas
LEVERS = {"none": ([], 2), "recompute": (["--recompute", "full"], 2),
          "recompute-1f1b": (["--recompute", "full", "--schedule", "1f1b"], 2),
          "adam8bit": (["--optimizer", "adam8bit"], 2), "offload": (["--offload-optimizer"], 2),
          "shard": (["--aggregate", "sum", "--shard-optimizer", "full"], 4)}


def memory_levers(a, work: str, shape: list[str]) -> list[dict]:
    """3. issue 30's levers on the device: two peers (2 stages, ``--memory-precision``) per lever (four for the sharded
    optimizer state: 2 stages x 2 replicas); each peer's predicted
    peak (the cost model's), the peak it counts itself (state + stash) and the CUDA allocator's peak."""
    rows = []
    for name, (flags, n) in LEVERS.items():
        if a.levers and name not in a.levers.split(","):
            continue
        t0 = time.time()
        try:
            reports = run_peers(os.path.join(work, f"mem-{name}"),
                                ["--steps", str(a.memory_steps), "--precision", a.memory_precision, "--plan", "even", "--stages",
                                 "2", *flags, *shape], a.device, n, 900)
        except Exception as e:  # one lever failing must not hide the others' figures
            rows.append({"lever": name, "error": repr(e)[-1500:]})
            print(f"memory, {name}: FAILED {e!r}"[:2000], file=sys.stderr, flush=True)
            continue
        peers = []
        for r in sorted(reports, key=lambda r: r["stage"]):
            m = r.get("memory") or {}
            pred, meas = m.get("predicted") or {}, m.get("measured") or {}
            peers.append({"stage": r["stage"], "name": r.get("name"), "predicted_peak": pred.get("peak"), "counted_peak": meas.get("peak"),
                          "counted_stash": meas.get("stash"), "predicted_stash": pred.get("stash"),
                          "cuda_max_allocated": m.get("cuda_max_allocated"),
                          "counted_over_predicted": m.get("measured_over_predicted"),
                          "cuda_over_predicted": m.get("cuda_over_predicted"),
                          "step_s_median": r.get("step_s_median"),
                          "counted": meas, "predicted": pred})
        losses = last_stage_losses(reports)
        rows.append({"lever": name, "wall_s": round(time.time() - t0, 1), "peers": peers,
                     "losses": [round(x, 5) for x in losses]})
        print(f"memory, {name}: " + "; ".join(
            f"stage {p['stage']}: predicted {p['predicted_peak']}, counted {p['counted_peak']}, CUDA {p['cuda_max_allocated']}"
            f" (x{p['cuda_over_predicted']}), step {p['step_s_median']}" for p in peers), file=sys.stderr, flush=True)
    return rows


def four_peers(a, out, work, model, steps, seq, mbs, tok, shape, tokens_per_step, skip) -> None:
    """2. four peers on the one device, 2 stages x 2 replicas, bf16"""
    job = with_data(JobSpec(model=model, seq_len=seq, micro_batch_size=mbs, num_micro_batches=a.micro_batches,
                            steps=steps, precision="bf16"), a.data, tok)
    ref_losses, _ = transformers_reference_run(job, steps, device=a.device)
    release_cache(a.device)  # the peers share this GPU: the reference run's cached blocks held 9.8 GB of it
    reports = run_peers(os.path.join(work, "four"), ["--steps", str(steps), "--precision", "bf16", "--plan", "even",
                                                     "--stages", "2", *shape], a.device, 4, 3600)
    ends: dict[int, float] = {}
    for r in reports:
        for step, _, end, _ in r["step_times"]:
            ends[step] = max(ends.get(step, 0.0), end)
    order = sorted(ends)[skip:]
    step_s = statistics.median(ends[b] - ends[x] for x, b in zip(order, order[1:]))
    losses = last_stage_losses(reports)
    out["four_peers"] = {
        "tokens_per_s": round(tokens_per_step / step_s, 1), "step_s": round(step_s, 4),
        "peers": [{"name": r["name"], "stage": r["stage"], **{k: (r.get("work") or {}).get(k) for k in
                                                              ("tokens_per_s", "mfu", "peak_source")},
                   "step_breakdown": r.get("step_breakdown"), "cpu": r.get("cpu"),
                   "memory": {k: (r.get("memory") or {}).get(k) for k in
                              ("predicted", "measured", "cuda_max_allocated", "cuda_over_predicted")}}
                  for r in reports],
        "mfu": round(sum(r["work"]["achieved_flops_per_s"] for r in reports) / max(r["work"]["peak_flops_per_s"]
                                                                                   for r in reports), 5),
        "losses": [round(x, 5) for x in losses],
        "reference_losses": [round(x, 5) for x in ref_losses],
        "loss_rel_err": max(abs(x - y) / y for x, y in zip(losses, ref_losses)),
    }
    print(f"four peers (2 stages x 2 replicas, bf16): {tokens_per_step / step_s:,.0f} tokens/s, MFU of the device "
          f"{out['four_peers']['mfu']:.3f}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, worst rel. error against one "
          f"process {out['four_peers']['loss_rel_err']:.2e}", file=sys.stderr, flush=True)
    for p in out["four_peers"]["peers"]:
        print(f"  {p['name']} (stage {p['stage']}): step breakdown {p['step_breakdown']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
