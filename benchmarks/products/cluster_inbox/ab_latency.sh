#!/usr/bin/env bash
# Batch-1 decode (`cupy-llama bench latency`) of Qwen3-0.6B, Gemma-3-1B and Llama-3.2-1B
# random models: this tree beside BASE_TREE (a checkout of the commit before the cluster
# inbox merge), alternating, ROUNDS rounds. Run from the repository root on a GPU:
#   bash benchmarks/products/cluster_inbox/ab_latency.sh OUT_DIR BASE_TREE [MODELS_DIR]
set -eu
out=$(realpath -m "$1") base=$(realpath "$2") models=$(realpath -m "${3:-/tmp/inbox_models}")
rounds=${ROUNDS:-2} here=$PWD
mkdir -p "$out" "$models"
for preset in qwen3-0.6b gemma-3-1b llama-3.2-1b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
latency() {  # preset tag tree round
  json=$out/$1_$2_$4.json
  (cd "$3" && PYTHONPATH="$3" python3 -m cupy_llama.cli bench latency --device cuda \
    --model "$models/$1" --json "$json" > "${json%.json}.log" 2>&1)
  echo "$1 $2 round $4: $(grep -o '"tok_s": [0-9.]*' "$json" | head -1)"
}
for i in $(seq "$rounds"); do
  for preset in qwen3-0.6b gemma-3-1b llama-3.2-1b; do
    latency $preset base "$base" $i
    latency $preset inbox "$here" $i
  done
done
