"""The operator's view of a live swarm (issue 18): /metrics for Prometheus, /swarm and the dashboard
page (in a real headless Chromium), a ZB-H1 step's timeline in /report, and a clean SIGTERM (also with the peer's p2p daemon frozen).

One emulated lan-4 swarm trains for the whole module (an even 4-stage pipeline, ZB-H1); the SIGTERM
tests run last, since each stops a peer."""
import math
import os
import re
import shutil
import signal
import time
import urllib.request

import pytest

from spantrain_p2p.launch import PeerProcess, wait_until
from spantrain_p2p.train import cpu_use
from spantrain_p2p.view import browser

pytestmark = pytest.mark.serial  # measures times or rates: run alone (scripts/test.sh)

SCENARIO = "peers/lan-4.toml"
NAMES = ("p0", "p1", "p2", "p3")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("view"))
    name = f"view-{os.getpid()}"
    common = ["--swarm", name, "--emulate-t0", str(time.monotonic())]
    procs = [PeerProcess(n, ["--emulate", f"{SCENARIO}:{n}", *common], run_dir) for n in NAMES]
    procs[0].args += ["--steps", "1000000", "--peers", "4", "--plan", "even", "--schedule", "zb-h1"]
    try:
        procs[0].start().wait_ready(60)
        for p in procs[1:]:
            p.args += ["--join", procs[0].info["address"]]
            p.start()
        for p in procs[1:]:
            p.wait_ready(60)
        wait_until(lambda: all((p.status().get("train") or {}).get("steps_done", 0) >= 3 for p in procs), 120,
                   interval=0.5)
        yield {p.name: p for p in procs}
    finally:
        for p in procs:
            p.kill()


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def test_metrics_parse_and_hold_every_figure_with_plausible_values(swarm):
    from prometheus_client.parser import text_string_to_metric_families

    last = next(p for p in swarm.values() if p.status()["train"]["stage"] == 3)
    wait_until(lambda: last.status()["train"]["loss"] is not None, 30)
    text = get(last.info["data_url"] + "/metrics").decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def values(name, **labels):  # a counter's family is named without its samples' "_total"
        fam = fams[name.removesuffix("_total")]
        return [s.value for s in fam.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    assert values("spantrain_peers") == [4]
    assert values("spantrain_step")[0] >= 3
    loss = values("spantrain_loss")[0]
    assert math.isfinite(loss) and 0 < loss < 20
    assert values("spantrain_tokens_per_second")[0] > 0
    pred, meas = values("spantrain_stage_seconds", kind="predicted"), values("spantrain_stage_seconds", kind="measured")
    assert pred and meas and 0 < pred[0] < 10 and 0 < meas[0] < 10
    assert len(values("spantrain_link_rtt_ms")) == 3 and all(v > 0 for v in values("spantrain_link_rtt_ms"))
    assert len(values("spantrain_link_mbps", source="probe")) == 3
    wait_until(lambda: "source=\"passive\"" in get(last.info["data_url"] + "/metrics").decode(), 30)
    assert all(n in text for n in ("spantrain_wire_bytes_total{", "spantrain_replans_total{", "spantrain_recoveries_total{"))
    wire = fams["spantrain_wire_bytes"].samples
    assert any(s.labels["kind"] == "grad" and s.labels["dst"] in NAMES and s.labels["dst"] != last.name
               and s.value > 0 for s in wire if s.name == "spantrain_wire_bytes_total"), wire
    assert values("spantrain_replans_total") == [0] and values("spantrain_recoveries_total") == [0]
    assert 0 < values("spantrain_fidelity")[0] <= 1


def test_any_peer_serves_the_whole_swarm(swarm):
    import json

    for p in (swarm["p1"], swarm["p3"]):
        d = json.loads(get(p.info["data_url"] + "/swarm"))
        assert d["self"] == p.name and sorted(m["name"] for m in d["members"]) == list(NAMES)
        assert all(m["reachable"] and m["train"]["plan"]["stages"] for m in d["members"])
        assert all(len(m["links"]) == 3 for m in d["members"])


def test_a_zb_h1_step_fills_the_pipeline_bubble_with_weight_gradients(swarm):
    # the second stage's W lags its B by one slot (a first stage's follows at once and runs fused, BW;
    # the last one's, with as many micro-batches as stages, all come after its last B)
    r = next(p.status(path="/report") for p in swarm.values() if p.status()["train"]["stage"] == 1)
    tl = r["timelines"][-1]
    ops = [op for op, *_ in tl["ops"] if op in ("F", "B", "W", "BW")]
    assert "BW" not in ops and ops.count("W") == ops.count("B") == ops.count("F") > 0
    # ZB-H1 defers weight gradients into the cool-down, where 1F1B waits: a W runs between two B's
    first_b, last_b = ops.index("B"), len(ops) - 1 - ops[::-1].index("B")
    assert "W" in ops[first_b:last_b], ops


def test_a_middle_stage_keeps_when_each_of_its_tensors_came_in(swarm):
    # (``transport.take_arrivals``: the data plane's first byte and whole frame, then filed in the inbox)
    r = next(p.status(path="/report") for p in swarm.values() if p.status()["train"]["stage"] == 1)
    tl = r["timelines"][-1]
    mbs = sorted({mb for op, mb, *_ in tl["ops"] if op == "F"})
    assert sorted((kind, mb) for kind, mb, *_ in tl["arrivals"]) == [(k, mb) for k in ("act", "grad") for mb in mbs]
    assert all(first <= whole <= filed <= tl["end"] for _k, _mb, first, whole, filed in tl["arrivals"])


@pytest.mark.skipif(browser.binary() is None or shutil.which("chromedriver") is None,
                    reason="Chromium and chromedriver are not installed (scripts/setup-browser.sh installs them)")
def test_the_dashboard_in_a_headless_browser_shows_members_stage_map_and_a_moving_loss(swarm, tmp_path):
    from selenium.webdriver.common.by import By

    driver = browser.chromium(str(tmp_path / "chromium"), "1400,1100")
    try:
        # opened after 40 steps: the peers' recent losses (30) no longer reach step 0, the run's history does
        wait_until(lambda: all((p.status().get("train") or {}).get("steps_done", 0) >= 40 for p in swarm.values()),
                   120, interval=0.5)
        driver.get(swarm["p2"].info["data_url"] + "/")

        def members():  # in one script, as the charts below: a row found before a redraw is stale after it
            return sorted(driver.execute_script(
                "return Array.from(document.querySelectorAll('#members tr.member'))"
                ".map(r => r.querySelector('td').innerText.trim());")) or None
        wait_until(lambda: members() == list(NAMES), 30, interval=0.5)
        wait_until(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#stagemap g.stage")) == 4, 30, interval=0.5)
        stage_text = driver.find_element(By.ID, "stagemap").text
        assert all(n in stage_text for n in NAMES) and "layers" in stage_text
        # each peer's peak memory, measured / predicted, once it has stepped
        wait_until(lambda: driver.find_element(By.ID, "stagemap").text.count(" MB") == 4, 30, interval=0.5)
        wait_until(lambda: driver.find_element(By.ID, "loss").text not in ("", "–"), 30, interval=0.5)
        first = driver.find_element(By.ID, "loss").text
        wait_until(lambda: driver.find_element(By.ID, "loss").text != first, 30, interval=0.5)
        assert len(driver.find_elements(By.CSS_SELECTOR, "#links rect.link")) == 16
        assert driver.find_elements(By.CSS_SELECTOR, "#losschart polyline")
        # the charts draw the whole run: the loss from step 0, the swarm's tokens/s from its first steps on
        assert "step 0.000" in driver.find_element(By.ID, "losschart").text
        # read in one script: the page redraws its charts every poll, and an element found before a
        # redraw is stale after it (seen once in the suite)
        points, labels = driver.execute_script(
            "const c = document.getElementById('tpschart');"
            "return [(c.querySelector('polyline').getAttribute('points') || '').trim().split(/\\s+/),"
            " Array.from(c.querySelectorAll('text')).map(t => t.textContent)];")
        assert len(points) >= 10 and float(labels[-1]) >= 3.0, (len(points), labels)  # (40 steps at ~10 a second)
        rows = driver.find_element(By.ID, "members").text  # each peer's step breakdown and background CPU
        assert rows.count(" / ") >= 12 and rows.count(" %") >= 8, rows
        if os.path.exists("/proc/thread-self/schedstat"):  # the compute's wait for a core, in brackets
            assert len(re.findall(r"\d \([0-9.e+-]+\) / ", rows)) >= 4, rows
        table = driver.find_element(By.ID, "members-section")  # the members table's last column is seen whole
        assert table.size["width"] >= driver.find_element(By.CSS_SELECTOR, "#members-section table").size["width"]
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
    finally:
        driver.quit()


def _sigterm(p) -> tuple[float, str]:
    """SIGTERM to peer ``p``: the seconds until it exited and its log from the signal on."""
    before = os.path.getsize(p.log_file)
    t0 = time.monotonic()
    p.signal(signal.SIGTERM)
    wait_until(lambda: not p.alive(), 15, interval=0.05)
    took = time.monotonic() - t0
    with open(p.log_file, errors="replace") as f:
        f.seek(before)
        return took, f.read()


def test_sigterm_stops_a_training_peer_within_two_seconds_without_a_traceback(swarm):
    took, tail = _sigterm(swarm["p3"])
    assert "Traceback" not in tail, tail
    assert took <= 2.0, (took, tail)
    print(f"\nSIGTERM of a training peer: exited in {took:.2f}s")


def _state(pid: int) -> str:
    """The process's state letter in /proc ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _daemons_of(pid: int) -> list[int]:
    out = []
    for kid in cpu_use.children(pid):
        with open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"p2pd" in f.read():
                out.append(kid)
    return out


def test_sigterm_stops_a_peer_whose_p2p_daemon_is_frozen_within_two_seconds(swarm):
    """A daemon that answers nothing (SIGSTOP) must not hold the peer's leave: the tombstone it
    cannot store and the daemon's own stop are bounded, and the daemon is killed. (Runs after the
    SIGTERM test, on another peer.)"""
    p = swarm["p2"]
    daemons = _daemons_of(p.info["pid"])
    assert len(daemons) == 1, daemons
    os.kill(daemons[0], signal.SIGSTOP)
    took, tail = _sigterm(p)
    assert "Traceback" not in tail, tail
    assert took <= 2.0, (took, tail)
    wait_until(lambda: _state(daemons[0]) in ("", "Z"), 5, interval=0.05)  # killed
    print(f"\nSIGTERM of a peer with a frozen daemon: exited in {took:.2f}s")
