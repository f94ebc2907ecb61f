#!/usr/bin/env bash
# Installs Debian's Chromium and ChromeDriver for the dashboard's browser test
# (tests/test_operator_view.py), once; without them that test is skipped. Needs root and the
# distribution's package mirror; says so and goes on (exit 0) where either is missing.
set -uo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-browser: not root or no apt-get: the browser test will be skipped" >&2
  exit 0
fi
echo "installing chromium and chromium-driver (once)…" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }; then
  echo "setup-browser: apt-get failed: the browser test will be skipped" >&2
fi
exit 0
