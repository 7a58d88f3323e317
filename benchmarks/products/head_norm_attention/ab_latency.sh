#!/usr/bin/env bash
# Batch-1 decode (`cupy-llama bench latency`) of random models of the presets, alternating,
# ROUNDS rounds: this tree with the head norms in the decode attention kernel
# (CUPY_LLAMA_HEAD_NORM_ATTENTION=1, "both": with the sandwich norms' fold), this tree
# without them (=0, "fold": the fold only; Qwen3 and Llama have no sandwich norms) and,
# where BASE_TREE is given, that checkout ("base"). Run from the repository root on a GPU:
#   bash benchmarks/products/head_norm_attention/ab_latency.sh OUT_DIR [MODELS_DIR [BASE_TREE]]
# The models are written once under MODELS_DIR (default /tmp/head_norm_models); the
# numbers of h100_2e5197a/ came from BASE_TREE a checkout of b06e537.
set -eu
out=$(realpath -m "$1") models=$(realpath -m "${2:-/tmp/head_norm_models}") base=${3:-}
rounds=${ROUNDS:-2} here=$PWD
mkdir -p "$out" "$models"
for preset in gemma-3-1b qwen3-0.6b llama-3.2-1b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
latency() {  # preset tag tree head_norm_attention round
  json=$out/$1_$2_$5.json
  (cd "$3" && CUPY_LLAMA_HEAD_NORM_ATTENTION=$4 PYTHONPATH="$3${PYTHONPATH:+:$PYTHONPATH}" \
    python3 -m cupy_llama.cli bench latency --device cuda --model "$models/$1" --json "$json" \
    > "${json%.json}.log" 2>&1)
  echo "$1 $2 round $5: $(grep -o '"tok_s": [0-9.]*' "$json" | head -1)"
}
for i in $(seq "$rounds"); do
  for preset in gemma-3-1b qwen3-0.6b llama-3.2-1b; do
    [ -z "$base" ] || latency $preset base "$(realpath "$base")" 1 $i
    latency $preset fold "$here" 0 $i
    [ $preset = llama-3.2-1b ] || latency $preset both "$here" 1 $i
  done
done
