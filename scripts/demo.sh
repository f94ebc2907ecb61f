#!/usr/bin/env bash
# The main job on a fresh clone: sets itself up if needed, trains a BPE tokenizer on a corpus that
# is on every machine (the Python standard library's sources), starts a local emulated swarm from a
# scenario in peers/ (default: cee-3region) and trains a transformers model (default: a tiny Llama,
# rotary positions and grouped-query attention) across its peers on the planner's plan, with the plan
# and a progress display; then exports the last checkpoint as a directory transformers loads.
# SCENARIO, STEPS, MODEL (hf:PRESET or hf:DIR), DATA, VOCAB and RUN (where it all goes) change the
# run; extra arguments go to `spantrain swarm`. MODEL=transformer runs the built-in byte model on
# generated text (no tokenizer, no export).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
scenario="${SCENARIO:-peers/cee-3region.toml}"
steps="${STEPS:-200}"
model="${MODEL:-hf:llama-tiny}"
run="${RUN:-runs/demo}"
if [ "$model" = transformer ]; then
  exec .venv/bin/spantrain swarm --scenario "$scenario" --steps "$steps" "$@"
fi
data="${DATA:-stdlib}"
mkdir -p "$run"
tok="$run/tokenizer-${VOCAB:-2048}.json"
if [ ! -f "$tok" ] || [ "$data" != stdlib ]; then
  .venv/bin/spantrain tokenizer --data "$data" --vocab "${VOCAB:-2048}" --out "$tok"
fi
rm -rf "$run/checkpoints" "$run/model"
.venv/bin/spantrain swarm --scenario "$scenario" --steps "$steps" --model "$model" --data "$data" \
  --tokenizer "$tok" --checkpoint-every "$steps" --checkpoint-dir "$run/checkpoints" "$@"
.venv/bin/spantrain export "$run/checkpoints" --out "$run/model"
echo "the trained weights are in $run/model (config.json, model.safetensors, tokenizer.json):" \
  "transformers.AutoModelForCausalLM.from_pretrained('$run/model')"
