"""``spantrain report RUN_DIR``: pictures of a run with matplotlib, and a one-page HTML index.

A run folder that ``spantrain swarm`` wrote holds ``summary.json`` (the run summary), and
``reports/PEER.json`` and ``measurements/PEER.json`` (each peer's ``/report`` and
``/measurements`` when the run ended). From them:

- ``loss.png``: the loss against steps and against tokens;
- ``throughput.png``: tokens/s over time (a point per step completion), re-plans and chaos events marked;
- ``timeline.png``: one step's pipeline per peer: F, B, W (or BW) compute, sends, waits for
  receives, the gradient sum and the optimizer: where the bubble is;
- ``links.png``: the measured link matrix (bandwidth, with the RTT written in each cell);
- ``index.html``: the four with the run's headline figures.
"""
from __future__ import annotations

import glob
import html
import json
import os
from typing import Optional

COLOURS = {"F": "#1a5fb4", "B": "#2ec27e", "W": "#f5c211", "BW": "#26a269", "SEND_F": "#99c1f1",
           "SEND_B": "#8ff0a4", "RECV_F": "#e01b24", "RECV_B": "#ff7800", "SUM": "#9141ac", "OPT": "#5e5c64"}
LABELS = {"F": "forward", "B": "backward (input)", "W": "backward (weights)", "BW": "backward (both)",
          "SEND_F": "send activation", "SEND_B": "send gradient", "RECV_F": "wait for activation",
          "RECV_B": "wait for gradient", "SUM": "gradient sum", "OPT": "optimizer"}


def load_run(run_dir: str) -> dict:
    """The run's summary, peer reports and measurements (ValueError: not a run folder)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        raise ValueError(f"{run_dir} has no summary.json: is it a folder `spantrain swarm --steps N` wrote?")
    with open(path) as f:
        summary = json.load(f)

    def folder(name: str) -> dict[str, dict]:
        out = {}
        for p in sorted(glob.glob(os.path.join(run_dir, name, "*.json"))):
            with open(p) as f:
                out[os.path.basename(p)[:-5]] = json.load(f)
        return out
    return {"summary": summary, "reports": folder("reports"), "measurements": folder("measurements")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    return plt


def loss_picture(run: dict, out: str) -> Optional[str]:
    s = run["summary"]
    losses = s.get("losses") or []
    if not losses:
        return None
    plt = _plt()
    tokens_per_step = (s.get("samples_per_step") or 0) * (s.get("seq_len") or 0)
    fig, axes = plt.subplots(1, 2 if tokens_per_step else 1, figsize=(10 if tokens_per_step else 6, 3.6), squeeze=False)
    steps = list(range(len(losses)))
    axes[0][0].plot(steps, losses, color="#1a5fb4")
    axes[0][0].set_xlabel("step")
    axes[0][0].set_ylabel("loss")
    if tokens_per_step:
        axes[0][1].plot([(k + 1) * tokens_per_step for k in steps], losses, color="#1a5fb4")
        axes[0][1].set_xlabel("tokens")
    fig.suptitle(f"loss: {losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps")
    fig.tight_layout()
    path = os.path.join(out, "loss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def step_ends(reports: dict) -> list[tuple[int, float, int]]:
    """(step, unix time it ended on its last peer, epoch), in step order."""
    ends: dict[int, tuple[float, int]] = {}
    for r in reports.values():
        for row in r.get("step_times", []):
            step, _, t1, epoch = row[:4]
            if t1 > ends.get(step, (0.0, 0))[0]:
                ends[step] = (t1, epoch)
    return [(k, *ends[k]) for k in sorted(ends)]


def throughput_picture(run: dict, out: str) -> Optional[str]:
    s = run["summary"]
    ends = step_ends(run["reports"])
    if len(ends) < 2:
        return None
    k = s.get("time_dilation") or 1.0  # the report's times are the emulation's: real time is K times faster
    tokens = (s.get("samples_per_step") or 0) * (s.get("seq_len") or 0)
    t0 = ends[0][1]
    xs, ys = [], []
    for (a, ta, _), (b, tb, _) in zip(ends, ends[1:]):
        if tb > ta:
            xs.append((tb - t0) / k)
            ys.append(tokens * (b - a) / (tb - ta) * k)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(xs, ys, marker=".", color="#1a5fb4", label="tokens/s")
    first = True
    for (a, ta, ea), (b, tb, eb) in zip(ends, ends[1:]):
        if eb != ea:
            ax.axvline((tb - t0) / k, color="#e5a50a", linestyle="--", label="re-plan" if first else None)
            ax.annotate(f"epoch {eb}", ((tb - t0) / k, max(ys) if ys else 0), fontsize=8, color="#9c6d00")
            first = False
    for ev in s.get("events") or []:  # chaos: kills, joins, link changes (launcher time, real)
        if ev.get("t_unix"):
            x = (ev["t_unix"] - t0) / k
            ax.axvline(x, color="#b3261e", linestyle=":")
            ax.annotate(f"{ev.get('kind')} {ev.get('target', '')}", (x, 0), fontsize=8, color="#b3261e", rotation=90)
    ax.set_xlabel("time since the first step ended (s" + (", real time)" if k != 1 else ")"))
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    if not first:
        ax.legend(loc="lower right")
    fig.tight_layout()
    path = os.path.join(out, "throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pick_step(reports: dict) -> Optional[int]:
    """A step every staged peer kept the timeline of (the newest such), else None."""
    sets = [set(tl["step"] for tl in r.get("timelines", [])) for r in reports.values() if r.get("stage") is not None]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def timeline_picture(run: dict, out: str, step: Optional[int] = None) -> Optional[str]:
    reports = run["reports"]
    step = pick_step(reports) if step is None else step
    if step is None:
        return None
    rows = []
    for name, r in reports.items():
        tl = next((x for x in r.get("timelines", []) if x["step"] == step), None)
        if tl is not None:
            rows.append((tl["stage"], name, tl))
    rows.sort()
    t0 = min(tl["start"] for _, _, tl in rows)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.55 * len(rows)))
    used = set()
    for y, (stage, name, tl) in enumerate(rows):
        for op, mb, a, b in tl["ops"]:
            # sends overlap compute: a thin lane just above the row's compute bar (the y axis runs down)
            lane = (y - 0.42, 0.14) if op.startswith("SEND") else (y - 0.25, 0.5)
            ax.broken_barh([(a - t0, max(b - a, 1e-6))], lane,
                           color=COLOURS.get(op, "#999999"), label=LABELS.get(op, op) if op not in used else None)
            used.add(op)
            if op in ("F", "B", "W", "BW") and (b - a) > 0.03 * (tl["end"] - tl["start"]) and mb >= 0:
                ax.text((a + b) / 2 - t0, y, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{name} (stage {stage})\n{_breakdown_label(reports[name])}" for stage, name, _ in rows],
                       fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds into step {step} (emulation time)")
    schedule = (run["summary"].get("plan") or {}).get("schedule", "")
    ax.set_title(f"step {step}" + (f", schedule {schedule}" if schedule else "") +
                 ": compute, sends (thin), waits for tensors (red/orange): the bubble")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(rows) > 2 else -0.5), ncol=5, fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "timeline.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (the row labels, the title and the legend whole)
    plt.close(fig)
    return path


def _breakdown_label(r: dict) -> str:
    """A peer's median step, split (``train.cpu_use``), and its background CPU, for its row's label."""
    bd, cpu = r.get("step_breakdown") or {}, r.get("cpu") or {}
    if not bd:
        return ""
    waited = f" (waiting for a core {bd['compute_core_wait_s']:.3g})" if "compute_core_wait_s" in bd else ""
    text = (f"compute {bd['compute_s']:.3g}{waited} / wait {bd['wait_s']:.3g}\n"
            f"sum+opt {bd['gradient_sum_s'] + bd['optimizer_s']:.3g} / rest {bd['other_s']:.3g} s")
    if cpu.get("background_share") is not None:
        text += f"; background CPU {100 * cpu['background_share']:.0f} %"
    return text


def links_picture(run: dict, out: str) -> Optional[str]:
    meas = run["measurements"]
    names = sorted(meas)
    if len(names) < 2:
        return None
    k = run["summary"].get("time_dilation") or 1.0
    import numpy as np

    grid = np.full((len(names), len(names)), np.nan)
    rtt = {}
    for i, src in enumerate(names):
        for dst, m in (meas[src].get("links") or {}).items():
            if dst in names and m.get("mbps"):
                j = names.index(dst)
                grid[i, j] = m["mbps"] * k  # real units
                rtt[(i, j)] = m.get("rtt_ms") / k if m.get("rtt_ms") else None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.2 + 0.75 * len(names), 0.9 + 0.6 * len(names)))
    shown = np.log10(grid)
    im = ax.imshow(shown, cmap="viridis")
    for (i, j), r in rtt.items():
        txt = f"{grid[i, j]:.3g}\n{r:.3g} ms" if r is not None else f"{grid[i, j]:.3g}"
        ax.text(j, i, txt, ha="center", va="center", fontsize=7,
                color="white" if shown[i, j] < np.nanmean(shown) else "black")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("to")
    ax.set_ylabel("from")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("log10 Mbit/s (probed)")
    ax.set_title("measured links: Mbit/s and RTT" + (" (real units)" if k != 1 else ""))
    fig.tight_layout()
    path = os.path.join(out, "links.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_index(run: dict, out: str, pictures: dict[str, Optional[str]]) -> str:
    s = run["summary"]
    facts = [("scenario", s.get("scenario")), ("steps", s.get("steps")), ("samples/s", s.get("samples_per_s")),
             ("tokens/s", s.get("tokens_per_s")), ("predicted samples/s", s.get("predicted_samples_per_s")),
             ("re-plans", s.get("replans")), ("lost steps", s.get("lost_steps")), ("fidelity", s.get("fidelity")),
             ("time dilation", s.get("time_dilation", 1))]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts if v is not None)
    imgs = "".join(f'<figure><img src="{os.path.basename(p)}" alt="{k}"><figcaption>{k}</figcaption></figure>'
                   for k, p in pictures.items() if p)
    missing = [k for k, p in pictures.items() if not p]
    note = f"<p>Not drawn (the run has no data for them): {', '.join(missing)}.</p>" if missing else ""
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>run {html.escape(str(s.get('scenario')))}</title>"
            "<style>body{font:14px system-ui,sans-serif;margin:20px}img{max-width:100%;border:1px solid #ddd}"
            "th{text-align:left;padding-right:12px}figure{margin:16px 0}</style></head><body>"
            f"<h1>Run of {html.escape(str(s.get('scenario')))}</h1><table>{rows}</table>{note}{imgs}</body></html>")
    path = os.path.join(out, "index.html")
    with open(path, "w") as f:
        f.write(page)
    return path


def report(run_dir: str, out: Optional[str] = None, step: Optional[int] = None) -> dict:
    """Draws every picture of ``run_dir`` into ``out`` (default: RUN_DIR/report); their paths."""
    run = load_run(run_dir)
    out = out or os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    pics = {"loss": loss_picture(run, out), "throughput": throughput_picture(run, out),
            "timeline": timeline_picture(run, out, step), "links": links_picture(run, out)}
    return {**pics, "index": write_index(run, out, pics)}


def bubble(run: dict, step: Optional[int] = None) -> dict:
    """Per peer, of one step: the time its compute ran, and how much of the time it waited for a
    tensor while it still had compute left to do after the wait (what the report calls the bubble)."""
    reports = run["reports"]
    step = pick_step(reports) if step is None else step
    out = {}
    for name, r in reports.items():
        tl = next((x for x in r.get("timelines", []) if x["step"] == step), None)
        if tl is None:
            continue
        ops = tl["ops"]
        compute = sum(b - a for op, _, a, b in ops if op in ("F", "B", "W", "BW"))
        last_compute = max((b for op, _, a, b in ops if op in ("F", "B", "W", "BW")), default=tl["start"])
        waits = sum(b - a for op, _, a, b in ops if op.startswith("RECV") and b <= last_compute)
        out[name] = {"compute_s": compute, "wait_s": waits, "span_s": last_compute - tl["start"]}
    return out
