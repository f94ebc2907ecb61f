"""Measurement of an emulated swarm: what the profiler and prober see of cee-3region.

The accuracy figures of the issue come from scripts/measure_figures.sh (a benchmark, run on an
idle machine); this test checks that every link and device is measured and roughly right, with
margins that hold on a loaded 2-core machine too.
"""
import statistics

from tests._helpers import run_swarm_json
import pytest

pytestmark = pytest.mark.serial  # measures times or rates: run alone (scripts/test.sh)


@pytest.mark.heavy
def test_measure_only_reports_every_link_and_device_of_cee_3region(tmp_path):
    out = run_swarm_json("--scenario", "peers/cee-3region.toml", "--measure-only", "--run-dir", str(tmp_path))
    names = ["cloud-1", "cloud-2", "edge-1", "edge-2", "end-1", "end-2", "end-3"]
    assert sorted((l["src"], l["dst"]) for l in out["links"]) == sorted((a, b) for a in names for b in names if a != b)
    assert all(l["status"] == "ok" for l in out["links"])
    bw = [abs(l["mbps"] / l["configured_mbps"] - 1) for l in out["links"]]
    rtt = [abs(l["rtt_ms"] / l["configured_rtt_ms"] - 1) for l in out["links"]]
    assert statistics.median(bw) <= 0.25 and statistics.median(rtt) <= 0.25, (bw, rtt)
    wan = [l for l in out["links"] if l["configured_mbps"] == 100]
    off = [{k: l[k] for k in ("src", "dst", "mbps", "rtt_ms")} for l in wan
           if not (60 <= l["mbps"] <= 110 and 35 <= l["rtt_ms"] <= 50)]
    assert not off, off  # the slow links are seen slow
    speeds = {d["peer"]: d["tflops"] for d in out["devices"]}
    for d in out["devices"]:  # speed ratios against the slowest device
        ratio = d["tflops"] / speeds["end-1"]
        assert abs(ratio / (d["configured_tflops"] / 0.25) - 1) <= 0.25, (d, speeds)
        assert d["memory_gb"] == d["configured_memory_gb"]
    assert out["fidelity"] >= 0.9
    print(f"\nmedian error: bandwidth {statistics.median(bw):.3f}, rtt {statistics.median(rtt):.3f}; worst "
          f"{max(bw):.3f}, {max(rtt):.3f}; probing {out['probe_seconds']:.1f}s; fidelity {out['fidelity']}")
