#!/usr/bin/env bash
# Batch-1 decode (`cupy-llama bench latency`) of random models of the presets with q/k head
# norms, the head norms fused into the decode kernel (CUPY_LLAMA_HEAD_NORM_ATTENTION=1)
# and not (=0), alternating, ROUNDS rounds, in a tree with head_norm_attention.patch
# applied (main does not read the variable). Run from the repository root on a GPU:
#   bash benchmarks/products/head_norm_attention/ab_latency.sh OUT_DIR [MODELS_DIR]
# The models are written once under MODELS_DIR (default /tmp/head_norm_models).
set -eu
out=$1 models=${2:-/tmp/head_norm_models} rounds=${ROUNDS:-2}
mkdir -p "$out" "$models"
for preset in qwen3-0.6b gemma-3-1b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
for i in $(seq "$rounds"); do
  for preset in qwen3-0.6b gemma-3-1b; do
    for fused in 0 1; do
      json=$out/lat_${preset}_fused${fused}_$i.json
      CUPY_LLAMA_HEAD_NORM_ATTENTION=$fused python3 -m cupy_llama.cli bench latency --device cuda \
        --model "$models/$preset" --json "$json" > "${json%.json}.log" 2>&1
      echo "$preset fused=$fused round $i: $(grep -o '"tok_s": [0-9.]*' "$json" | head -1)"
    done
  done
done
