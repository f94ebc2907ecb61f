#!/usr/bin/env bash
# Fetches, here, the wheels the project needs on a machine with no package index whose python
# already holds torch, transformers, numpy, aiohttp, pytest and the like (the GPU machines' 'cuda'
# image: /work/.library/device/KINDS.md lists it), for that machine's python version; there,
# SPANTRAIN_WHEELS=DIR ./scripts/setup.sh installs them. The pins are the versions this project's
# .venv holds; sdist-only ones are built into pure-Python wheels here.
# Usage: scripts/offline_wheels.sh DIR [PYTHON_VERSION (default 3.12)]
set -euo pipefail
dir=${1:?usage: offline_wheels.sh DIR [PYTHON_VERSION]}; py=${2:-3.12}
mkdir -p "$dir"
binary=(hivemind==1.1.12 grpcio-tools==1.85.1 configargparse==1.9.0 py-multihash==3.0.0 morphys==1.0
        base58==2.1.1 blake3==1.0.11 mmh3==5.3.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
        pydantic==2.14.4 annotated-types==0.8.0 pydantic-core==2.50.5 typing-inspection==0.4.5
        netaddr==1.3.0 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0 zeroconf==0.154.0
        ifaddr==0.2.0 torchao==0.18.0 pytest-asyncio==1.5.0)
platforms=()
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  "${platforms[@]}" -d "$dir" "${binary[@]}"
python3 -m pip wheel -q --no-deps -w "$dir" prefetch-generator==1.0.3 varint==1.0.2 python-baseconv==1.2.2
du -sh "$dir" >&2
