"""Where a peer's CPU goes, by part, from sampled stacks (issue 33: "control-plane CPU <= 5 % of one
core per peer"; issue 31: the background's share): ``scripts/control_cpu.py`` samples running peers
with py-spy (``record --format raw``: one line per distinct stack and its count, on-CPU samples
only) and hands the lines here. ``train.cpu_use`` splits a peer's CPU into its training threads and
the rest; this splits the rest too, by the code it was in.

A sample is put down to the innermost frame of a file this project (or hivemind) owns, in
``PARTS``' order: a signature checked under a SWIM message's handling is the control plane's; a
tensor decoded under the data plane's server, the data plane's; torch's kernels under the stage's
executor, training. Frames of the standard library and of torch say nothing on their own; a stack
with none of ours is the event loop's own ("loop"). The framing of a control message before its
handler is named counts as the data plane's (the same code reads both): a small undercount.
Plain functions over plain data.
"""
from __future__ import annotations

import re
from typing import Iterable

__all__ = ["PARTS", "part_of", "shares"]

# (part, file path fragments), looked up in this order for each frame
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("control", ("spantrain_p2p/swarm/", "spantrain_p2p/peer/", "spantrain_p2p/train/coordinator",
                 "spantrain_p2p/train/run_records", "spantrain_p2p/train/map_tree", "spantrain_p2p/train/measuring",
                 "spantrain_p2p/train/planning", "spantrain_p2p/plan/", "spantrain_p2p/net/ping", "spantrain_p2p/net/prober",
                 "spantrain_p2p/_hivemind_lite", "hivemind/")),
    ("pages", ("spantrain_p2p/view/",)),
    ("data plane", ("spantrain_p2p/net/", "spantrain_p2p/train/transport", "spantrain_p2p/compress/")),
    ("training", ("spantrain_p2p/pipeline/", "spantrain_p2p/train/", "spantrain_p2p/models/", "spantrain_p2p/robust/",
                  "spantrain_p2p/islands/", "spantrain_p2p/job/", "spantrain_p2p/data/")),
)
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def part_of(frames: list[str]) -> str:
    """The part a stack's sample counts for; ``frames`` outermost first, each "function (file:line)"
    as py-spy writes them (full file names)."""
    for frame in reversed(frames):
        m = _FRAME.match(frame.strip())
        if m is None:
            continue
        path = m.group("file").replace("\\", "/")
        for part, fragments in PARTS:
            if any(f in path for f in fragments):
                return part
    return "loop"


def shares(lines: Iterable[str], rate_hz: float, seconds: float) -> dict:
    """From py-spy's raw lines ("frame;frame;... COUNT", a thread's "thread (0x...)" first with
    ``--threads``, the process's before it with ``--subprocesses``): each part's share of one
    core over ``seconds`` (samples / rate / seconds), and the samples counted."""
    counts: dict[str, int] = {}
    for line in lines:
        line = line.rstrip("\n")
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("thread (", "process "))]
        part = part_of(frames)
        counts[part] = counts.get(part, 0) + int(n)
    total = sum(counts.values())
    out = {p: round(c / rate_hz / seconds, 4) for p, c in sorted(counts.items())}
    return {"share_of_a_core": out, "all": round(total / rate_hz / seconds, 4), "samples": total}
