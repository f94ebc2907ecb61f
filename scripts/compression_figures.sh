#!/usr/bin/env bash
# Issue 6 compression figures: wire bytes per step and final loss, none vs adaptive, same seed.
# Usage: scripts/compression_figures.sh [SCENARIO] [STEPS]   (default peers/edge-volunteers.toml 200)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
scenario="${1:-peers/edge-volunteers.toml}"
steps="${2:-200}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
for c in ${CODECS:-none adaptive}; do
  .venv/bin/spantrain swarm --scenario "$scenario" --steps "$steps" --plan even --schedule 1f1b \
    --compression "$c" --seed 0 --json 2>"$out/$c.err" | tail -1 > "$out/$c.json"
done
.venv/bin/python - "$out" <<'PY'
import json, sys
d = {c: json.load(open(f"{sys.argv[1]}/{c}.json")) for c in ("none", "adaptive")}
for c, r in d.items():
    print(f"{c:>9}: {r['wire_bytes_per_step'] / 1e6:.3f} MB/step on the wire, {r['samples_per_s']:.2f} samples/s, "
          f"final loss {r['losses'][-1]:.4f} (mean of last 10: {sum(r['losses'][-10:]) / 10:.4f})")
ratio = d["none"]["wire_bytes_per_step"] / d["adaptive"]["wire_bytes_per_step"]
last = lambda r: sum(r["losses"][-10:]) / 10
print(f"wire bytes none/adaptive: {ratio:.2f}x; loss after {len(d['none']['losses'])} steps: "
      f"{(last(d['adaptive']) / last(d['none']) - 1) * 100:+.2f} % (mean of the last 10 steps)")
print("per link class (adaptive):", d["adaptive"]["wire_bytes_per_step_by_link_class"],
      "(none):", d["none"]["wire_bytes_per_step_by_link_class"])
from collections import Counter
print("codecs adaptive chose last (kind->destination per peer):", dict(Counter(d["adaptive"].get("codecs", {}).values())))
PY
