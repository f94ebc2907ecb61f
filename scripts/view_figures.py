"""The operator's-view figures (issue 18), on an idle machine:

1. what the dashboard and /metrics cost: the same cee-3region training run without anyone looking,
   then with a headless Chromium showing the dashboard (it polls /swarm once a second, which
   fetches every peer's /status and /measurements) and a scraper reading every peer's /metrics once
   a second (Prometheus scrapes every 15-60 s); alternated, samples/s of each;
2. a screenshot of the dashboard of that cee-3region run (written to OUT/dashboard-cee-3region.png);
3. `spantrain report` of a cee-3region run under ZB-H1 with a kill and a re-plan (OUT/report/).

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


def swarm(out: str, name: str, steps: int, *extra: str, watch=None) -> dict:
    """Runs `spantrain swarm` on cee-3region; ``watch(url, stop_event)`` runs in a thread from the moment
    the launcher prints the dashboard's address until the run ends. Its summary."""
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "spantrain_p2p.cli.main", "swarm", "--scenario", SCENARIO, "--steps", str(steps),
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
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={user_dir}", "--window-size=1500,1250"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def looking(screenshot: str | None):
    """A watcher: the dashboard open in Chromium, and /metrics of every peer scraped every second."""
    def watch(url: str, stop: threading.Event, run_dir: str) -> None:
        driver = chromium(os.path.join(run_dir, "chromium"))
        scrapes = 0
        try:
            driver.get(url + "/")
            t_shot = time.monotonic() + 25
            while not stop.is_set():
                for f in sorted(os.listdir(run_dir)):  # a Prometheus scraping every peer
                    if f.endswith(".ready.json"):
                        try:
                            with open(os.path.join(run_dir, f)) as fh:
                                urllib.request.urlopen(json.load(fh)["data_url"] + "/metrics", timeout=5).read()
                            scrapes += 1
                        except (OSError, ValueError):
                            pass
                if screenshot and time.monotonic() > t_shot:
                    driver.save_screenshot(screenshot)
                    screenshot_taken.append(screenshot)
                    t_shot = float("inf")
                stop.wait(1.0)
        finally:
            driver.quit()
            print(f"  scraped /metrics {scrapes} times", file=sys.stderr)
    return watch


screenshot_taken: list[str] = []


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
            s = swarm(a.out, f"{kind}-{r}", a.steps, watch=looking(shot if r == 0 else None) if kind == "watched" else None)
            out[kind].append(s["samples_per_s"])
            print(f"{kind} round {r}: {s['samples_per_s']} samples/s", file=sys.stderr, flush=True)
    alone, watched = statistics.mean(out["alone"]), statistics.mean(out["watched"])
    out["cost"] = round(1 - watched / alone, 4)
    out["screenshot"] = screenshot_taken[0] if screenshot_taken else None
    s = swarm(a.out, "kill-zbh1", a.steps, "--schedule", "zb-h1", "--chaos", "kill:worker@step=20")
    pics = subprocess.run([sys.executable, "-m", "spantrain_p2p.cli.main", "report", os.path.join(a.out, "kill-zbh1")],
                          capture_output=True, text=True, check=True).stdout
    out["report"] = pics.strip().splitlines()
    out["kill_run"] = {"replans": s["replans"], "lost_steps": s["lost_steps"], "events": s["events"]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
