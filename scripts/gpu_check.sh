#!/usr/bin/env bash
# Issue 14's GPU checks, on a machine with CUDA: (1) plain PyTorch in one process against one peer
# running the same transformers job (the runtime's overhead as a ratio of tokens/s), (2) four peers
# on the one GPU training a GPT-2-small-shaped model in bf16 from a local corpus: tokens/s, MFU,
# losses against a single-process reference. One JSON object on the last line of stdout. With CUDA
# it first runs the GPU-only tests (a stage on the GPU against the CPU; sends in pinned memory).
# Usage: scripts/gpu_check.sh [--device cuda|cpu] [--model hf:...] [--steps N] [--out FILE]
# (--device cpu: a dry run of the same steps with a tiny model, for machines without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  .venv/bin/python -m pytest -q tests/test_devices.py >&2
fi
exec .venv/bin/python scripts/gpu_check.py "$@"
