"""Where a pipeline run waited on its transport: the hops of its tensors from stage to stage while
the next stage waited, and how much of a step only one stage computed (issue 31;
``spantrain_p2p.train.hop_times``), from a run folder's peer reports (their last few step timelines).

    .venv/bin/python scripts/pipeline_hops.py RUN_DIR [--json]

For runs with one peer a stage (``spantrain swarm --plan even``, the side-by-side's job); the peers'
clocks must agree (one host).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from spantrain_p2p.train.hop_times import PARTS, hop_times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    timelines: dict[int, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(a.run_dir, "reports", "*.json"))):
        with open(path) as f:
            report = json.load(f)
        k = report.get("stage")
        if k is None or not report.get("timelines"):
            continue
        if k in timelines:
            print(f"stage {k} has more than one peer: hops are read for one peer a stage", file=sys.stderr)
            return 2
        timelines[k] = report["timelines"]
    if len(timelines) < 2:
        print(f"no pipeline of two or more stages with timelines in {a.run_dir}/reports", file=sys.stderr)
        return 2
    h = hop_times(timelines)
    if a.json:
        print(json.dumps(h))
        return 0
    print(f"{h['count']} hops whose receiver waited, over {h['steps']} steps:")
    rows = [("made_to_taken", "made to taken"), ("made_to_send", "made to its send's start"),
            ("send_to_taken", "send's start to taken")]
    if h.get("split"):
        print(f"  (of these, {h['split']} with the receiver's arrivals: the send's start to taken in parts)")
        rows += [(name, f"  {what}") for name, what in PARTS]
    for key, what in rows:
        s = h[key]
        print(f"  {what:30s} median {s['median_ms']} ms, 90th percentile {s['p90_ms']} ms, {s['per_step_ms']} ms a step")
    print(f"a step's wall time with at most one compute op under way: {h['single_s']} s (with none: {h['idle_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
