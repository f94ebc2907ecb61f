#!/usr/bin/env bash
# Installs what the tests across network boundaries need (tests/test_network_world.py): iproute2
# (network namespaces, veth, bridges, tbf) and nftables (the home routers' NAT), once; without them
# those tests are skipped and say why. Needs root and the distribution's package mirror; says so and
# goes on (exit 0) where either is missing.
set -uo pipefail
if command -v ip >/dev/null && command -v nft >/dev/null && command -v tc >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-netns: not root or no apt-get: the network-world tests will be skipped" >&2
  exit 0
fi
echo "installing iproute2 and nftables (once)…" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables >/dev/null; }; then
  echo "setup-netns: apt-get failed: the network-world tests will be skipped" >&2
fi
exit 0
