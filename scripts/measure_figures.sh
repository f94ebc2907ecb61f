#!/usr/bin/env bash
# Issue 4 figures: how well the profiler and prober see an emulated swarm (run on an idle machine).
# Usage: scripts/measure_figures.sh [SCENARIO]   (default peers/cee-3region.toml)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
scenario="${1:-peers/cee-3region.toml}"
start=$(date +%s.%N)
.venv/bin/spantrain swarm --scenario "$scenario" --measure-only --json 2>/dev/null | tail -1 > /tmp/spantrain-measure.json
end=$(date +%s.%N)
.venv/bin/python - "$start" "$end" <<'PY'
import json, statistics, sys
d = json.load(open("/tmp/spantrain-measure.json"))
ok = [l for l in d["links"] if l["status"] == "ok"]
bw = [abs(l["mbps"] / l["configured_mbps"] - 1) for l in ok]
rtt = [abs(l["rtt_ms"] / l["configured_rtt_ms"] - 1) for l in ok]
print(f"links measured: {len(ok)}/{len(d['links'])}")
print(f"bandwidth rel. error: median {statistics.median(bw):.3f}, worst {max(bw):.3f}")
print(f"rtt rel. error:       median {statistics.median(rtt):.3f}, worst {max(rtt):.3f}")
worst = sorted(ok, key=lambda l: -abs(l["mbps"] / l["configured_mbps"] - 1))[:3]
for l in worst:
    print(f"  {l['src']}->{l['dst']}: {l['mbps']:.1f} Mbit/s (configured {l['configured_mbps']:g}), "
          f"{l['rtt_ms']:.2f} ms (configured {l['configured_rtt_ms']:g})")
slow = min(d["devices"], key=lambda x: x["configured_tflops"])
for x in d["devices"]:
    ratio, want = x["tflops"] / slow["tflops"], x["configured_tflops"] / slow["configured_tflops"]
    print(f"device {x['peer']}: {x['tflops']:.3f} TFLOP/s (configured {x['configured_tflops']:g}), "
          f"speed ratio {ratio:.3f} vs {want:g} ({ratio / want - 1:+.1%})")
print(f"probing: {d['probe_seconds']:.1f} s; fidelity {d['fidelity']}; whole command {float(sys.argv[2]) - float(sys.argv[1]):.1f} s")
PY
