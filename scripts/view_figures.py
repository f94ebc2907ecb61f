"""The operator's-view figures (issue 18), on an idle machine:

1. what the dashboard and /metrics cost: the same cee-3region training run without anyone looking,
   then with a headless Chromium showing the dashboard (it polls /swarm once a second, which
   fetches every peer's /status and /measurements) and a scraper reading every peer's /metrics once
   a second (Prometheus scrapes every 15-60 s); alternated, samples/s of each;
2. a screenshot of the dashboard of that cee-3region run (written to OUT/dashboard-cee-3region.png);
3. `spantrain report` of a cee-3region run under ZB-H1 with a kill (cloud-2, a stage peer; the
   dashboard watched is cloud-1's) and its re-plan (OUT/kill-zbh1/report/), and of a 4-stage ZB-H1
   pipeline on lan-4 (OUT/zbh1-lan4/report/timeline.png: W ops in the cool-down).

    .venv/bin/python scripts/view_figures.py [--out runs/view-figures] [--steps 60] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

SCENARIO = "peers/cee-3region.toml"
SPANTRAIN = os.path.join(os.path.dirname(sys.executable), "spantrain")


def swarm(out: str, name: str, steps: int, *extra: str, watch=None) -> dict:
    """Runs `spantrain swarm` on cee-3region; ``watch(url, stop_event)`` runs in a thread from the moment
    the launcher prints the dashboard's address until the run ends. Its summary."""
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [SPANTRAIN, "swarm", "--scenario", SCENARIO, "--steps", str(steps),
           "--run-dir", run_dir, "--json", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, thread = threading.Event(), None
    for line in p.stderr:
        sys.stderr.write(f"  [{name}] {line}")
        m = re.search(r"dashboard .*: (http://\S+)/", line)
        if m and watch is not None and thread is None:
            thread = threading.Thread(target=watch, args=(m.group(1), stop, run_dir), daemon=True)
            thread.start()
    out_text = p.stdout.read()
    p.wait()
    stop.set()
    if thread is not None:
        thread.join(30)
    if p.returncode != 0:
        raise SystemExit(f"{name}: spantrain swarm exited {p.returncode}")
    return json.loads(out_text.strip().splitlines()[-1])


def chromium(user_dir: str):
    from spantrain_p2p.view import browser

    return browser.chromium(user_dir, "1500,1250")


def looking(screenshot: str | None):
    """A watcher: the dashboard open in Chromium, and /metrics of every peer scraped every second."""
    def watch(url: str, stop: threading.Event, run_dir: str) -> None:
        driver = chromium(os.path.join(run_dir, "chromium"))
        scrapes = 0
        try:
            driver.get(url + "/")
            shot_due = screenshot is not None
            while not stop.is_set():
                for f in sorted(os.listdir(run_dir)):  # a Prometheus scraping every peer
                    if f.endswith(".ready.json"):
                        try:
                            with open(os.path.join(run_dir, f)) as fh:
                                urllib.request.urlopen(json.load(fh)["data_url"] + "/metrics", timeout=5).read()
                            scrapes += 1
                        except (OSError, ValueError):
                            pass
                if shot_due and progressed(driver, 0.8):  # late in the run: curves, a re-plan, events
                    time.sleep(1.5)
                    driver.save_screenshot(screenshot)
                    screenshot_taken.append(screenshot)
                    shot_due = False
                stop.wait(1.0)
        finally:
            driver.quit()
            print(f"  scraped /metrics {scrapes} times", file=sys.stderr)
    return watch


screenshot_taken: list[str] = []


def progressed(driver, fraction: float) -> bool:
    """The page says the run is at least ``fraction`` done ("k / N" in its header)."""
    from selenium.webdriver.common.by import By

    try:
        k, _, n = driver.find_element(By.ID, "step").text.partition(" / ")
        return bool(n) and int(k) >= fraction * int(n)
    except Exception:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/view-figures")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out = {"alone": [], "watched": []}
    shot = os.path.abspath(os.path.join(a.out, "dashboard-cee-3region.png"))
    for r in range(a.rounds):
        for kind in ("alone", "watched"):
            s = swarm(a.out, f"{kind}-{r}", a.steps, watch=looking(None) if kind == "watched" else None)
            out[kind].append(s["samples_per_s"])
            print(f"{kind} round {r}: {s['samples_per_s']} samples/s", file=sys.stderr, flush=True)
    if a.rounds:
        alone, watched = statistics.mean(out["alone"]), statistics.mean(out["watched"])
        out["cost"] = round(1 - watched / alone, 4)
    # the screenshot: the kill run, watched, late enough to show the kill, the re-plan and the curves
    s = swarm(a.out, "kill-zbh1", a.steps, "--schedule", "zb-h1", "--chaos", "kill:cloud-2@step=20", watch=looking(shot))
    out["screenshot"] = screenshot_taken[0] if screenshot_taken else None
    pics = subprocess.run([SPANTRAIN, "report", os.path.join(a.out, "kill-zbh1")],
                          capture_output=True, text=True, check=True).stdout
    out["report"] = pics.strip().splitlines()
    out["kill_run"] = {"replans": s["replans"], "lost_steps": s["lost_steps"], "events": s["events"]}
    # a ZB-H1 step of a 4-stage pipeline (lan-4, one peer per stage): its W ops in the cool-down
    run_dir = os.path.join(a.out, "zbh1-lan4")
    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run([SPANTRAIN, "swarm", "--scenario", "peers/lan-4.toml", "--steps", "30", "--plan", "even",
                    "--schedule", "zb-h1", "--run-dir", run_dir, "--json"], check=True, capture_output=True)
    out["zbh1_timeline"] = subprocess.run([SPANTRAIN, "report", run_dir], capture_output=True, text=True,
                                          check=True).stdout.split("timeline:")[1].split()[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
