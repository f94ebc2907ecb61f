"""The headless Chromium the dashboard is checked and pictured in (``tests/test_operator_view.py``,
``scripts/view_figures.py``; ``scripts/setup-browser.sh`` installs it and its driver, and selenium).

It reaches nothing beyond the page it is sent to: no background networking, no component updates,
and no name resolved (the page is an IP literal's): with the flags the two had before, Chromium
looked up about 40 names of its own at the host's resolver while the test ran, beyond the loopback
and the test's namespaces that the suite keeps to."""
from __future__ import annotations

import shutil

FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost , EXCLUDE 127.0.0.1")


def binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(user_dir: str, window: str):
    """A selenium driver of headless Chromium with its profile in ``user_dir``, ``window`` wide and
    high ("1400,1100")."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary()
    for flag in (*FLAGS, f"--user-data-dir={user_dir}", f"--window-size={window}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
