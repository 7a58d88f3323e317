#!/usr/bin/env bash
# Batch-1 decode (`cupy-llama bench latency`) of Gemma-3-1B, Qwen3-0.6B and Llama-3.2-1B
# random models with each kv head's query heads shared out among more decode CTAs:
# BASE_TREE (a checkout of the commit before cluster_head_parts) as it is ("h4": at most 4
# heads a CTA) beside copies of it with DECODE_MAX_CTA_HEADS 2 and 1 ("h2", "h1"),
# alternating, ROUNDS rounds. At batch 1 the copies launch the kernels and grids that
# cluster_head_parts chooses for these shapes (one head a CTA for Gemma-3-1B and
# Qwen3-0.6B, two for Llama-3.2-1B: tests/test_attention_plan.py). On a GPU:
#   bash benchmarks/products/cluster_head_parts/ab_latency.sh OUT_DIR BASE_TREE [MODELS_DIR]
set -eu
out=$(realpath -m "$1") base=$(realpath "$2") models=$(realpath -m "${3:-/tmp/head_parts_models}")
rounds=${ROUNDS:-2} copies=$(mktemp -d)
mkdir -p "$out" "$models"
for preset in gemma-3-1b qwen3-0.6b llama-3.2-1b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
for heads in 2 1; do
  mkdir -p "$copies/h$heads" && cp -r "$base/cupy_llama" "$base/cuda_src" "$copies/h$heads/"
  sed -i "s/^DECODE_MAX_CTA_HEADS = 4$/DECODE_MAX_CTA_HEADS = $heads/" \
    "$copies/h$heads/cupy_llama/backends/cuda/attention.py"
  grep -q "^DECODE_MAX_CTA_HEADS = $heads$" "$copies/h$heads/cupy_llama/backends/cuda/attention.py" \
    || { echo "BASE_TREE's attention.py has no 'DECODE_MAX_CTA_HEADS = 4' line to change"; exit 1; }
done
latency() {  # preset variant round
  tree=$base; [ $2 = h4 ] || tree=$copies/$2
  json=$out/$1_$2_$3.json
  (cd "$tree" && PYTHONPATH="$tree" python3 -m cupy_llama.cli bench latency --device cuda \
    --model "$models/$1" --json "$json" > "${json%.json}.log" 2>&1)
  echo "$1 $2 round $3: $(grep -o '"tok_s": [0-9.]*' "$json" | head -1)"
}
for i in $(seq "$rounds"); do
  for v in h4 h2 h1; do latency gemma-3-1b $v $i; done
  for v in h4 h1; do latency qwen3-0.6b $v $i; done
  for v in h4 h2; do latency llama-3.2-1b $v $i; done
done
