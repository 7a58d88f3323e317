#!/usr/bin/env bash
# `cupy-llama bench decode-sweep` of a Gemma-3-1B random model at batches 1 to 8: this
# tree beside BASE_TREE (a checkout of the commit before clustered decode batches shared
# their query heads out), alternating, ROUNDS rounds. Run from the repository root on a GPU:
#   bash benchmarks/products/batch_head_parts/ab_sweep.sh OUT_DIR BASE_TREE [MODELS_DIR]
set -eu
out=$(realpath -m "$1") base=$(realpath "$2") models=$(realpath -m "${3:-/tmp/inbox_models}")
rounds=${ROUNDS:-2} here=$PWD
mkdir -p "$out" "$models"
[ -d "$models/gemma-3-1b" ] || python3 scripts/make_random_model.py --preset gemma-3-1b "$models/gemma-3-1b" > /dev/null
for i in $(seq "$rounds"); do
  for tag in base new; do
    tree=$here; [ $tag = base ] && tree=$base
    json=$out/gemma-3-1b_${tag}_$i.json
    (cd "$tree" && PYTHONPATH="$tree" python3 -m cupy_llama.cli bench decode-sweep --device cuda \
      --model "$models/gemma-3-1b" --batch-sizes 1,2,3,4,5,8 --json "$json" > "${json%.json}.log" 2>&1)
    echo "gemma-3-1b $tag round $i: $(grep 'decode-sweep: batch' "${json%.json}.log" | tr '\n' ' ')"
  done
done
