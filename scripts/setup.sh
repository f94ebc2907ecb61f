#!/usr/bin/env bash
# Creates .venv with everything the project needs, once; later calls return at once.
# torch is pinned to 2.13.0 first: on this machine kind that is a CPU build already on disk,
# where an unpinned torch would pull a multi-GB CUDA build. On a machine whose python3 already has
# a CUDA build of torch that sees a GPU, .venv uses that one (system site packages) instead.
# With SPANTRAIN_WHEELS=DIR (a machine with no package index, e.g. a GPU box: scripts/offline_wheels.sh
# makes DIR elsewhere), the project's packages come from the wheels in DIR alone, with no index.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=".venv/.spantrain-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
echo "setting up .venv (once; about a minute)…" >&2
if python3 -c "import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "using the CUDA build of torch that is here ($(python3 -c 'import torch; print(torch.__version__)'))" >&2
  python3 -m venv --system-site-packages .venv
  # python3 may itself run in a virtual environment (torch in its own site-packages): a venv made from
  # it sees only the base interpreter's packages, so its folders are named in a .pth file
  python3 -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
    > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_spantrain_python3.pth"
else
  python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
fi
if [ -n "${SPANTRAIN_WHEELS:-}" ]; then
  # exactly the wheels given (offline_wheels.sh lists what the project needs beyond such a machine's image)
  .venv/bin/pip install -q --disable-pip-version-check --no-index --no-deps "$SPANTRAIN_WHEELS"/*.whl
  .venv/bin/pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation -e .
else
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
fi
rm -f .venv/.spantrain-setup-*
touch "$stamp"
echo "set-up done" >&2
